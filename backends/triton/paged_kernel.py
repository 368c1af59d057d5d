"""Paged decode, one program per (sequence, query head): the straightforward kernel.

Grid ``(batch, heads / BLOCK_H)`` with ``BLOCK_H = 1`` on a GPU. Each program walks its
sequence's block table one page at a time with an online softmax (base 2); the dot products
are elementwise (no ``tl.dot``), so any group size works. ``-1`` pages and every slot outside
the context, the window and the sinks are masked at load. The Triton interpreter's cost is
per program, so there the same code runs ``BLOCK_H`` heads per program. An fp8 cache is
dequantized in float32 on load (per tensor, per KV head or per token); an fp8 query's scale
joins the softmax scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

from conformance.backends.triton.kernel_common import (
    LN2,
    LOG2E,
    load_scaled_rows,
    modified_scores,
    online_softmax_step,
)
from conformance.backends.triton.splitkv_kernel import PER_PROGRAM, PER_TOKEN, scale_arguments
from conformance.backends.triton.validation import Scales, ScoreModifiers, paged_shapes

LOG2E_TL = tl.constexpr(LOG2E)


@triton.jit
def _paged_decode_kernel(
    q, k_pages, v_pages, block_table, context_lens, out, lse, k_scale, v_scale, q_scale,
    sink_logits, alibi_slopes, scale_log2, cap_log2, window, sinks, stride_table, scale_stride,
    NUM_QO_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WINDOW: tl.constexpr,
    KV_SCALE: tl.constexpr, Q_SCALED: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < NUM_QO_HEADS
    kv_heads = heads // GROUP
    n = tl.load(context_lens + b)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row = (b * NUM_QO_HEADS + heads).to(tl.int64)
    q_rows = load_scaled_rows(q, row, h_mask, d, d_mask, scale_log2, HEAD_DIM)
    if Q_SCALED:
        q_rows = q_rows * tl.load(q_scale)
    if KV_SCALE == PER_PROGRAM:  # one scale per KV head (stride 0: per tensor)
        k_head_scale = tl.load(k_scale + kv_heads * scale_stride, mask=h_mask, other=0.0)
        v_head_scale = tl.load(v_scale + kv_heads * scale_stride, mask=h_mask, other=0.0)
    slopes = tl.zeros([BLOCK_H], tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_slopes + heads, mask=h_mask, other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    slot = tl.arange(0, BLOCK_P)
    table_row = block_table + b.to(tl.int64) * stride_table
    for page_index in range(0, tl.cdiv(n, PAGE_SIZE)):
        # the page id as a vector: the interpreter rejects masks mixing a loaded scalar in
        page = tl.load(table_row + page_index + slot * 0)
        position = page_index * PAGE_SIZE + slot
        valid = (slot < PAGE_SIZE) & (position < n) & (page >= 0)
        if HAS_WINDOW:
            valid = valid & ((position >= n - window) | (position < sinks))
        token = (page.to(tl.int64) * PAGE_SIZE + slot) * NUM_KV_HEADS
        offsets = ((token[None, :, None] + kv_heads[:, None, None]) * HEAD_DIM
                   + d[None, None, :])  # (H, P, D)
        mask = h_mask[:, None, None] & valid[None, :, None] & d_mask[None, None, :]
        keys = tl.load(k_pages + offsets, mask=mask, other=0.0).to(tl.float32)
        values = tl.load(v_pages + offsets, mask=mask, other=0.0).to(tl.float32)
        if KV_SCALE == PER_TOKEN:
            slots = token[None, :] + kv_heads[:, None]  # (H, P): per-token scales, paged
            slot_mask = h_mask[:, None] & valid[None, :]
            keys = keys * tl.load(k_scale + slots, mask=slot_mask, other=0.0)[:, :, None]
            values = values * tl.load(v_scale + slots, mask=slot_mask, other=0.0)[:, :, None]
        elif KV_SCALE == PER_PROGRAM:
            keys = keys * k_head_scale[:, None, None]
            values = values * v_head_scale[:, None, None]
        scores = tl.sum(keys * q_rows[:, None, :], axis=2)  # (H, P)
        scores = modified_scores(scores, (position - (n - 1))[None, :], slopes, cap_log2, HAS_CAP,
                                 HAS_ALIBI)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, total, alpha, p = online_softmax_step(m, total, scores)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values, axis=1)
    if HAS_SINK:  # exp(z_h) joins the denominator once, as a state of its own
        sink = tl.load(sink_logits + heads, mask=h_mask, other=float("-inf")) * LOG2E_TL
        top = tl.maximum(m, sink)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        alpha = tl.exp2(m - top_safe)
        total = total * alpha + tl.exp2(sink - top_safe)
        acc = acc * alpha[:, None]
        m = top
    empty = m == float("-inf")
    result = acc / tl.where(empty, 1.0, total)[:, None]
    tl.store(out + row[:, None] * HEAD_DIM + d[None, :], result.to(out.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])
    row_lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, total))) * LN2)
    tl.store(lse + row, row_lse, mask=h_mask)


def paged_decode(q, k_pages, v_pages, block_table, context_lens, out, lse, *,
                 sm_scale: float, window: int | None = None, sinks: int = 0,
                 validate: bool = True, scales: Scales | None = None,
                 modifiers: ScoreModifiers | None = None) -> None:
    """Same contract as ``splitkv_decode``, without splits."""
    modifiers = modifiers or ScoreModifiers()
    scales = scales or Scales()
    batch, hq, hkv, head_dim, page_size = paged_shapes(
        q, k_pages, v_pages, block_table, context_lens, out, lse, window=window, sinks=sinks,
        validate=validate, scales=scales)
    if batch == 0:
        return
    block_h = hq if q.device.type == "cpu" else 1
    kv_mode, stride, k_scale, v_scale = scale_arguments(scales, lse)
    if validate:
        modifiers.check(hq, q.device)
    _paged_decode_kernel[(batch, triton.cdiv(hq, block_h))](
        q, k_pages, v_pages, block_table, context_lens, out, lse, k_scale, v_scale,
        scales.q_scale if scales.q_scale is not None else lse,
        modifiers.sink_logits if modifiers.sink_logits is not None else lse,
        modifiers.alibi_slopes if modifiers.alibi_slopes is not None else lse,
        sm_scale * LOG2E, (modifiers.soft_cap or 1.0) * LOG2E,
        window or 0, sinks, block_table.stride(0), stride, NUM_QO_HEADS=hq, NUM_KV_HEADS=hkv,
        GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size, BLOCK_P=triton.next_power_of_2(page_size),
        BLOCK_H=triton.next_power_of_2(block_h), HAS_WINDOW=window is not None,
        KV_SCALE=kv_mode, Q_SCALED=scales.q_scale is not None,
        HAS_CAP=modifiers.soft_cap is not None, HAS_SINK=modifiers.sink_logits is not None,
        HAS_ALIBI=modifiers.alibi_slopes is not None)
