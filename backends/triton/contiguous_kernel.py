"""Split-K decode over a contiguous cache ``(batch, qo_heads, max_len, head_dim)``.

The cache holds every query head's own copy of its KV head (GQA expanded), as a kernel
written for MHA sees it; the adapter gathers pages into it outside the timed call. Grid
``(batch, heads / BLOCK_H, splits)`` with ``BLOCK_H = 1`` on a GPU; each program walks the
kept tokens of its split and writes partial states that ``combine_splits`` merges.
"""

from __future__ import annotations

import triton
import triton.language as tl

from conformance.backends.triton.kernel_common import (
    LOG2E,
    choose_splits,
    kept_position,
    kept_span,
    load_scaled_rows,
    online_softmax_step,
    split_bounds,
)
from conformance.backends.triton.splitkv_kernel import combine_splits
from conformance.backends.triton.validation import check_output_buffers, check_tensor

BLOCK_N = 64


@triton.jit
def _contiguous_partial_kernel(
    q, k_cache, v_cache, context_lens, part_m, part_l, part_acc,
    scale_log2, window, sinks, max_len, num_splits,
    NUM_QO_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = heads < NUM_QO_HEADS
    n = tl.load(context_lens + b)
    kept, sinks_kept, window_start = kept_span(n, window, sinks, HAS_WINDOW)
    start, end = split_bounds(kept, split, num_splits, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row = (b * NUM_QO_HEADS + heads).to(tl.int64)
    q_rows = load_scaled_rows(q, row, h_mask, d, d_mask, scale_log2, HEAD_DIM)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        i = tile + tl.arange(0, BLOCK_N)
        valid = i < end
        position = kept_position(i, sinks_kept, window_start)
        offsets = (row[:, None, None] * max_len + position[None, :, None]) * HEAD_DIM \
            + d[None, None, :]
        mask = h_mask[:, None, None] & valid[None, :, None] & d_mask[None, None, :]
        keys = tl.load(k_cache + offsets, mask=mask, other=0.0).to(tl.float32)
        scores = tl.sum(keys * q_rows[:, None, :], axis=2)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, total, alpha, p = online_softmax_step(m, total, scores)
        values = tl.load(v_cache + offsets, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values, axis=1)
    state = row * num_splits + split
    tl.store(part_m + state, m, mask=h_mask)
    tl.store(part_l + state, total, mask=h_mask)
    tl.store(part_acc + state[:, None] * HEAD_DIM + d[None, :], acc,
             mask=h_mask[:, None] & d_mask[None, :])


def contiguous_decode(q, k_cache, v_cache, context_lens, out, lse, *, sm_scale: float,
                      window: int | None = None, sinks: int = 0, num_splits: int | None = None,
                      sm_count: int = 132, validate: bool = True) -> None:
    """``q (batch, heads, dim)``, ``k_cache``/``v_cache (batch, heads, max_len, dim)``,
    ``context_lens (batch,)`` int32 (at most ``max_len``), ``out``, ``lse`` as for the
    paged kernels."""
    import torch

    if validate:
        check_tensor("q", q, ndim=3)
        check_tensor("k_cache", k_cache, ndim=4, dtype=q.dtype, device=q.device)
        if tuple(k_cache.shape[:2]) != tuple(q.shape[:2]) or k_cache.shape[3] != q.shape[2]:
            raise ValueError(f"k_cache: shape {tuple(k_cache.shape)} does not match q "
                             f"{tuple(q.shape)} as (batch, heads, max_len, head_dim)")
        check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtype=q.dtype,
                     device=q.device)
        check_tensor("context_lens", context_lens, shape=(q.shape[0],), int32=True,
                     device=q.device)
        if q.shape[0] and int(context_lens.max()) > k_cache.shape[2]:
            raise ValueError(f"context_lens: {int(context_lens.max())} tokens exceed the "
                             f"cache's max_len {k_cache.shape[2]}")
        check_output_buffers(q, out, lse)
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits: {num_splits} must be at least 1")
    batch, heads, head_dim = q.shape
    if batch == 0:
        return
    block_h = heads if q.device.type == "cpu" else 1
    if num_splits is None:
        longest = k_cache.shape[2] if window is None else min(k_cache.shape[2], window + sinks)
        num_splits = choose_splits(batch, heads, longest, sm_count, BLOCK_N)
    part_m = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32,
                           device=q.device)
    _contiguous_partial_kernel[(batch, triton.cdiv(heads, block_h), num_splits)](
        q, k_cache, v_cache, context_lens, part_m, part_l, part_acc, sm_scale * LOG2E,
        window or 0, sinks, k_cache.shape[2], num_splits, NUM_QO_HEADS=heads,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=BLOCK_N,
        BLOCK_H=triton.next_power_of_2(block_h), HAS_WINDOW=window is not None)
    combine_splits(part_m, part_l, part_acc, out, lse)
