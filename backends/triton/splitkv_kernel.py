"""Paged split-KV flash decoding with the query heads of a GQA group packed into one tile.

Grid ``(batch, kv_heads, splits)``. Each program walks the *kept* tokens of its split (sinks,
then the window; every token without a window) in tiles of ``BLOCK_N``, looks each token's
page up in the block table, and keeps an online softmax (base 2) for its whole query-head
group with ``tl.dot``. Evicted, padded and ``-1`` slots are never loaded. ``combine`` then
merges the splits and writes output and natural-log LSE for every row, empty ones included.

Several query tokens per sequence (speculative verification, ``Queries``) share the walk:
the tile's rows are query tokens x group (``QUERY_TOKENS`` x the group padded to a power of
two), the span walked is the union of what they see (the window widened by the drafts), and
each row masks its own view: causal by position, or the draft-visibility matrix, the window
and ALiBi counted from its own position. The KV tile is read once for every draft.

An fp8 cache (``KV_SCALE``) is read as codes: with one scale per program (per tensor or per
KV head) the codes go into ``tl.dot`` as they are (every e4m3/e5m2 value is exact in 16 bits)
and the scales are folded into the scores and the partial output; with per-token scales each
tile is dequantized in float32 and rounded to the dot dtype. An fp8 query's scale is folded
into the scores.

Compiled, a float16 dot reads fp8 tiles as 32-bit words of four codes converted in registers
(``FP8_WORDS``): loaded as fp8, the V tile went from shared memory into the ``tl.dot``
operand layout one byte per instruction (sm_90 has no transposing ``ldmatrix`` for 8-bit
data), 128 shared loads per thread per tile where a float16 tile takes 16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from conformance.backends.triton.kernel_common import (
    LN2,
    LOG2E,
    choose_splits,
    kept_span,
    modified_scores,
    online_softmax_step,
    rows_per_program,
    split_bounds,
    tile_slots,
)
from conformance.backends.triton.validation import Queries, Scales, ScoreModifiers, paged_shapes

LOG2E_TL = tl.constexpr(LOG2E)

# KV_SCALE: how the pages are read (host values; the kernels compare with the constexprs)
UNSCALED, SCALE_PER_PROGRAM, SCALE_PER_TOKEN = 0, 1, 2
PER_PROGRAM, PER_TOKEN = tl.constexpr(SCALE_PER_PROGRAM), tl.constexpr(SCALE_PER_TOKEN)
# FP8_WORDS: which per-program-scaled fp8 tiles are read as words (host values, as above)
WORDS_NONE, WORDS_V, WORDS_KV = 0, 1, 2


@triton.jit
def _splitkv_partial_kernel(
    q, k_pages, v_pages, block_table, context_lens, part_m, part_l, part_acc,
    k_scale, v_scale, q_scale, alibi_slopes, query_start, draft_mask,
    scale_log2, cap_log2, window, sinks, stride_table, num_splits, scale_stride, mask_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    ROWS: tl.constexpr, QUERY_TOKENS: tl.constexpr, HAS_DRAFT_MASK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_SCALE: tl.constexpr, Q_SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, FP8_WORDS: tl.constexpr,
    E5M2: tl.constexpr, LOOP_STAGES: tl.constexpr, HEAD_MAJOR: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(context_lens + b)
    first_row = b
    query_len = 1
    if QUERY_TOKENS > 1:  # several query tokens: the packed rows query_start[b]..[b + 1]
        first_row = tl.load(query_start + b)
        query_len = tl.load(query_start + b + 1) - first_row
    # what the drafts see together: each one's window ends at its own position
    kept, sinks_kept, window_start = kept_span(n, window + query_len - 1, sinks, HAS_WINDOW)
    start, end = split_bounds(kept, split, num_splits, BLOCK_N)

    rows = tl.arange(0, ROWS)  # query token rows // GROUP_P2, query head rows % GROUP_P2
    draft = rows // GROUP_P2
    row_mask = (draft < query_len) & (rows % GROUP_P2 < GROUP)
    heads = kv_head * GROUP + rows % GROUP_P2
    query_row = first_row + draft
    query_position = n - query_len + draft
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_offsets = (query_row[:, None] * NUM_KV_HEADS * GROUP + heads[:, None]).to(tl.int64) \
        * HEAD_DIM + d[None, :]
    q_tile = tl.load(q + q_offsets, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    score_scale = scale_log2
    if Q_SCALED:
        q_tile = q_tile.to(DOT_DTYPE)
        score_scale = score_scale * tl.load(q_scale)
    if KV_SCALE == PER_PROGRAM:
        score_scale = score_scale * tl.load(k_scale + kv_head * scale_stride)

    slopes = tl.zeros([ROWS], tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_slopes + heads, mask=row_mask, other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    table_row = block_table + b.to(tl.int64) * stride_table
    for tile in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
        position, valid, slot = tile_slots(table_row, tile, end, sinks_kept, window_start,
                                           PAGE_SIZE, BLOCK_N)
        token = slot * NUM_KV_HEADS + kv_head  # the scales' row, and the pages' (NHD)
        row = token
        if HEAD_MAJOR:  # (pages, kv_heads, page_size, dim) storage: a page's head contiguous
            row = ((slot // PAGE_SIZE) * NUM_KV_HEADS + kv_head) * PAGE_SIZE + slot % PAGE_SIZE
        kv_offsets = row[:, None] * HEAD_DIM + d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        if FP8_WORDS >= 2:
            keys = read_words(k_pages, row, valid, HEAD_DIM, BLOCK_N, E5M2)
        else:
            keys = read_kv(k_pages + kv_offsets, kv_mask, k_scale + token, valid, KV_SCALE,
                           DOT_DTYPE)
        scores = tl.dot(q_tile, tl.trans(keys), input_precision=DOT_PRECISION) * score_scale
        scores = modified_scores(scores, position[None, :] - query_position[:, None], slopes,
                                 cap_log2, HAS_CAP, HAS_ALIBI)
        seen = valid[None, :]
        if QUERY_TOKENS > 1:
            seen = seen & row_sees(position, query_position, query_row, n - query_len,
                                   row_mask, valid, draft_mask, mask_stride, window, sinks,
                                   HAS_DRAFT_MASK, HAS_WINDOW)
        scores = tl.where(seen, scores, float("-inf"))
        m, total, alpha, p = online_softmax_step(m, total, scores)
        if FP8_WORDS >= 1:
            values = read_words(v_pages, row, valid, HEAD_DIM, BLOCK_N, E5M2)
        else:
            values = read_kv(v_pages + kv_offsets, kv_mask, v_scale + token, valid, KV_SCALE,
                             DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values,
                                            input_precision=DOT_PRECISION)
    if KV_SCALE == PER_PROGRAM:
        acc = acc * tl.load(v_scale + kv_head * scale_stride)

    state = (query_row * NUM_KV_HEADS * GROUP + heads).to(tl.int64) * num_splits + split
    tl.store(part_m + state, m, mask=row_mask)
    tl.store(part_l + state, total, mask=row_mask)
    tl.store(part_acc + state[:, None] * HEAD_DIM + d[None, :], acc,
             mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def row_sees(position, query_position, query_row, first_draft, row_mask, valid, draft_mask,
             mask_stride, window, sinks, HAS_DRAFT_MASK: tl.constexpr,
             HAS_WINDOW: tl.constexpr):
    """``(rows, tokens)``: which walked positions each query row sees: up to its own
    position (causal) or the drafts its row of the visibility matrix marks, inside its own
    window (plus the first ``sinks``)."""
    if HAS_DRAFT_MASK:
        offset = position[None, :] - first_draft
        is_draft = offset >= 0
        marked = tl.load(draft_mask + query_row[:, None].to(tl.int64) * mask_stride + offset,
                         mask=row_mask[:, None] & valid[None, :] & is_draft, other=0)
        seen = (~is_draft) | (marked != 0)
    else:
        seen = position[None, :] <= query_position[:, None]
    if HAS_WINDOW:
        seen = seen & ((position[None, :] > query_position[:, None] - window)
                       | (position[None, :] < sinks))
    return seen


@triton.jit
def read_words(pages, row, valid, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               E5M2: tl.constexpr):
    """A ``(tokens, HEAD_DIM)`` float16 tile of fp8 codes, loaded as 32-bit words of four
    codes and converted in registers (``cvt.rn.f16x2``: exact), so that the float16 tile,
    not the codes, goes through shared memory into the ``tl.dot`` operand."""
    w = tl.arange(0, HEAD_DIM // 4)
    words = tl.load(pages.to(tl.pointer_type(tl.int32)) + row[:, None] * (HEAD_DIM // 4)
                    + w[None, :], mask=valid[:, None], other=0)
    if E5M2:
        a, b, c, d = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e5m2x2 x, lo; cvt.rn.f16x2.e5m2x2 y, hi; "
            "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    else:
        a, b, c, d = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 x, lo; cvt.rn.f16x2.e4m3x2 y, hi; "
            "mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    # word j holds codes 4j..4j+3, low byte first
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (BLOCK_N, HEAD_DIM))


@triton.jit
def read_kv(pointers, mask, scale_pointers, valid, KV_SCALE: tl.constexpr,
            DOT_DTYPE: tl.constexpr):
    """A ``(tokens, BLOCK_D)`` tile of K or V in the dot dtype: fp8 codes converted exactly
    (their scale applied by the caller), or dequantized by per-token scales."""
    tile = tl.load(pointers, mask=mask, other=0.0)
    if KV_SCALE == PER_TOKEN:
        scales = tl.load(scale_pointers, mask=valid, other=0.0)
        tile = (tile.to(tl.float32) * scales[:, None]).to(DOT_DTYPE)
    elif KV_SCALE == PER_PROGRAM:
        tile = tile.to(DOT_DTYPE)
    return tile


@triton.jit
def _combine_kernel(part_m, part_l, part_acc, out, lse, sink_logits, rows, num_splits,
                    num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINK: tl.constexpr):
    """``BLOCK_R`` (sequence, query head) rows: LSE-merge their splits (base-2 maxima), and
    a row's sink logit once, as one more state (m = z log2(e), l = 1, acc = 0)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < rows
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    state = r[:, None] * num_splits + s[None, :]  # (R, S)
    s_mask = r_mask[:, None] & (s[None, :] < num_splits)
    m = tl.load(part_m + state, mask=s_mask, other=float("-inf"))
    partial_total = tl.load(part_l + state, mask=s_mask, other=0.0)
    top = tl.max(m, axis=1)
    if HAS_SINK:
        sink = tl.load(sink_logits + r % num_heads, mask=r_mask, other=float("-inf")) * LOG2E_TL
        top = tl.maximum(top, sink)
    empty = top == float("-inf")
    base = tl.where(empty, 0.0, top)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - base[:, None]))
    total = tl.sum(partial_total * weight, axis=1)
    if HAS_SINK:
        total = total + tl.where(sink == float("-inf"), 0.0, tl.exp2(sink - base))
    acc_mask = s_mask[:, :, None] & (d[None, None, :] < HEAD_DIM)
    acc = tl.load(part_acc + state[:, :, None] * HEAD_DIM + d[None, None, :], mask=acc_mask,
                  other=0.0)
    merged = tl.sum(acc * weight[:, :, None], axis=1) / tl.where(empty, 1.0, total)[:, None]
    out_mask = r_mask[:, None] & (d[None, :] < HEAD_DIM)
    tl.store(out + r[:, None] * HEAD_DIM + d[None, :], merged.to(out.dtype.element_ty),
             mask=out_mask)
    row_lse = tl.where(empty, float("-inf"), (base + tl.log2(tl.where(empty, 1.0, total))) * LN2)
    tl.store(lse + r, row_lse, mask=r_mask)


def combine_splits(part_m, part_l, part_acc, out, lse, sink_logits=None) -> None:
    """Merge ``(batch, heads, splits[, dim])`` partial states into ``out`` and ``lse``, with
    a sink logit per head (``(heads,)`` float32) joined once."""
    batch, heads, splits = part_m.shape
    head_dim = out.shape[-1]
    rows = batch * heads
    if rows == 0:
        return
    block_s, block_d = triton.next_power_of_2(splits), triton.next_power_of_2(head_dim)
    block_r = triton.next_power_of_2(rows_per_program(out, block_s * block_d))
    _combine_kernel[(triton.cdiv(rows, block_r),)](
        part_m, part_l, part_acc, out, lse, sink_logits if sink_logits is not None else lse,
        rows, splits, heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s,
        BLOCK_R=block_r, HAS_SINK=sink_logits is not None)


DOT_DTYPES = {"torch.float32": tl.float32, "torch.float16": tl.float16,
              "torch.bfloat16": tl.bfloat16}


def scale_arguments(scales: Scales, placeholder) -> tuple[int, int, object, object]:
    """(KV_SCALE, the per-program scale's stride over KV heads, k_scale, v_scale): what the
    kernels take for ``scales``; ``placeholder`` stands in for a pointer never read."""
    if scales.kv_scale is None:
        return UNSCALED, 0, placeholder, placeholder
    if scales.kv_scale == "per-token":
        return SCALE_PER_TOKEN, 0, scales.k_scale, scales.v_scale
    return (SCALE_PER_PROGRAM, 1 if scales.kv_scale == "per-head" else 0, scales.k_scale,
            scales.v_scale)


def fp8_words(scales: Scales, out, head_dim: int, words: int = WORDS_V) -> int:
    """``FP8_WORDS`` for a launch: compiled (inline PTX: not under the interpreter), a
    float16 dot, per-program scales and a power-of-two head_dim; else ``WORDS_NONE``."""
    import torch

    if (scales.kv_scale in (None, "per-token") or out.device.type != "cuda"
            or out.dtype != torch.float16 or head_dim < 16 or head_dim & (head_dim - 1)):
        return WORDS_NONE
    return words


def tile_config(head_dim: int, fp8: bool = False, rows: int = 16, batch: int = 1) -> dict:
    """Launch parameters: the best worst-case of a sweep on an H200 at head_dim 128
    (benchmarks/sweep_splitkv.py); smaller tiles for wider heads, or more than 64 query rows
    (drafts x group), to bound registers. An fp8 tile holds half the bytes: a third stage in
    flight was faster at all seven gpu shapes (3-10%;
    benchmarks/results/h200-splitkv-sweep-fp8.json), wider tiles were not; and with a batch
    of 8 or more, four waves of programs instead of two (23% at 8 x 8192, 8% at 64 x 2048),
    which cost 11-17% at batch 1 (h200-fp8/sweep-fp8-bit-moves-2026-12-03.json).

    Two keys only the sweep changes: ``loop_stages`` (the tile loop's own
    ``tl.range(num_stages=)``, which pipelines every load in it, not only those feeding a
    ``tl.dot``) and ``head_major`` (pages stored ``(pages, kv_heads, page_size, dim)`` and given
    as a view of the problem's shape; validation refuses such a view: pass ``validate=False``)."""
    block_n = 128 if head_dim <= 128 and rows <= 64 else 64
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3 if fp8 else 2,
            "waves": 4 if fp8 and batch >= 8 else 2, "fp8_words": WORDS_V, "loop_stages": None,
            "head_major": False}


def splitkv_decode(q, k_pages, v_pages, block_table, context_lens, out, lse, *,
                   sm_scale: float, window: int | None = None, sinks: int = 0,
                   num_splits: int | None = None, sm_count: int = 132,
                   validate: bool = True, config: dict | None = None,
                   scales: Scales | None = None,
                   modifiers: ScoreModifiers | None = None,
                   queries: Queries | None = None) -> None:
    """Write attention output and natural-log LSE for every row of a paged decode batch.

    ``q (batch, qo_heads, dim)``, ``k_pages``/``v_pages (pages, page_size, kv_heads, dim)``,
    ``block_table (batch, max_blocks)`` int32 (-1 unallocated), ``context_lens (batch,)``
    int32, ``out`` like ``q``, ``lse (batch, qo_heads)`` float32; all on one device. An fp8
    cache or query comes with its ``scales`` (``validation.Scales``); ``out`` is then the
    dtype the kernel computes in. ``modifiers`` (``validation.ScoreModifiers``): soft-cap
    and ALiBi per score, sink logits in the combine. ``queries`` (``validation.Queries``):
    several query tokens per sequence, packed, q, out and lse holding one row per token.
    """
    import torch

    scales = scales or Scales()
    modifiers = modifiers or ScoreModifiers()
    batch, hq, hkv, head_dim, page_size = paged_shapes(
        q, k_pages, v_pages, block_table, context_lens, out, lse, window=window, sinks=sinks,
        validate=validate, scales=scales, queries=queries)
    if validate:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits: {num_splits} must be at least 1")
        modifiers.check(hq, q.device)
    group = hq // hkv
    if batch == 0:
        return
    query_tokens = triton.next_power_of_2(queries.max_query_len) if queries else 1
    rows = max(16, query_tokens * triton.next_power_of_2(group))
    config = {**tile_config(head_dim, scales.kv_scale is not None, rows, batch),
              **(config or {})}
    if num_splits is None:
        longest = int(context_lens.max())
        if window is not None:
            longest = min(longest, window + (queries.max_query_len if queries else 1) - 1
                          + sinks)
        num_splits = choose_splits(batch, hkv, longest, sm_count, config["BLOCK_N"],
                                   config["waves"])
    tokens = q.shape[0]
    part_m = torch.empty((tokens, hq, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((tokens, hq, num_splits, head_dim), dtype=torch.float32,
                           device=q.device)
    draft_mask = queries.draft_mask if queries and queries.draft_mask is not None else None
    precision = "ieee" if out.dtype == torch.float32 else "tf32"
    kv_mode, stride, k_scale, v_scale = scale_arguments(scales, part_m)
    _splitkv_partial_kernel[(batch, hkv, num_splits)](
        q, k_pages, v_pages, block_table, context_lens, part_m, part_l, part_acc,
        k_scale, v_scale, scales.q_scale if scales.q_scale is not None else part_m,
        modifiers.alibi_slopes if modifiers.alibi_slopes is not None else part_m,
        queries.query_start if queries else context_lens,
        draft_mask.view(torch.uint8) if draft_mask is not None else context_lens,
        sm_scale * LOG2E, (modifiers.soft_cap or 1.0) * LOG2E, window or 0, sinks,
        block_table.stride(0), num_splits, stride,
        draft_mask.stride(0) if draft_mask is not None else 0,
        NUM_KV_HEADS=hkv, GROUP=group, GROUP_P2=triton.next_power_of_2(group), ROWS=rows,
        QUERY_TOKENS=query_tokens, HAS_DRAFT_MASK=draft_mask is not None,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=page_size, BLOCK_N=config["BLOCK_N"], HAS_WINDOW=window is not None,
        DOT_PRECISION=precision, KV_SCALE=kv_mode, Q_SCALED=scales.q_scale is not None,
        DOT_DTYPE=DOT_DTYPES[str(out.dtype)], HAS_CAP=modifiers.soft_cap is not None,
        HAS_ALIBI=modifiers.alibi_slopes is not None,
        FP8_WORDS=fp8_words(scales, out, head_dim, config["fp8_words"]),
        E5M2=str(k_pages.dtype) == "torch.float8_e5m2", LOOP_STAGES=config["loop_stages"],
        HEAD_MAJOR=config["head_major"], num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    combine_splits(part_m, part_l, part_acc, out, lse, modifiers.sink_logits)
