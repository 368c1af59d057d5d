"""Shared by the kernels: which tokens a split attends to, and launch sizing."""

import math

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_CONST = tl.constexpr(LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: kernels may read it


@triton.jit
def kept_span(n, window, sinks, HAS_WINDOW: tl.constexpr):
    """(tokens attended, sinks kept before the window, first window position) of a context.

    Kept tokens are numbered 0..kept-1: first the sinks, then the window, so a split can
    walk only what it attends to."""
    kept = n
    sinks_kept = n * 0
    window_start = n * 0
    if HAS_WINDOW:
        window_kept = tl.minimum(window, n)
        sinks_kept = tl.minimum(sinks, n - window_kept)
        kept = window_kept + sinks_kept
        window_start = n - window_kept
    return kept, sinks_kept, window_start


@triton.jit
def split_bounds(kept, split, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of a split over the kept tokens, in whole tiles of BLOCK_N."""
    per_split = tl.cdiv(tl.cdiv(kept, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    return start, tl.minimum(start + per_split, kept)


@triton.jit
def online_softmax_step(m, total, scores):
    """One tile of base-2 scores ``(rows, tokens)`` into the running max and denominator.

    Returns the new max, the new denominator, the factor ``alpha`` to rescale the old
    accumulator by, and the tile's weights ``p``. Safe when a row has seen only -inf (empty,
    masked or evicted tokens): nothing computes ``-inf - -inf``."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    return m_new, total * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def load_scaled_rows(q, row, row_mask, d, d_mask, scale_log2, HEAD_DIM: tl.constexpr):
    """Query rows ``(rows, BLOCK_D)`` as float32, scaled by sm_scale * log2(e)."""
    rows = tl.load(q + row[:, None] * HEAD_DIM + d[None, :],
                   mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    return rows.to(tl.float32) * scale_log2


@triton.jit
def tanh(x):
    """tanh in float32 for any x: its odd series below 0.25 (error under 1e-8), else
    ``1 - 2 / (e^(2|x|) + 1)``, whose exponential overflows to inf and gives exactly +-1,
    never inf / inf."""
    squared = x * x
    series = x * (1.0 + squared * (-1.0 / 3.0 + squared * (2.0 / 15.0 + squared * (
        -17.0 / 315.0 + squared * (62.0 / 2835.0)))))
    far = 1.0 - 2.0 / (tl.exp2(tl.abs(x) * (2.0 * LOG2E_CONST)) + 1.0)
    return tl.where(tl.abs(x) < 0.25, series, tl.where(x < 0, -far, far))


@triton.jit
def modified_scores(scores, offsets, slopes, cap_log2, HAS_CAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr):
    """Base-2 scores ``(rows, tokens)`` capped (``cap_log2 = cap * log2(e)``: the cap in
    base-2 units) and biased by ALiBi (``slopes (rows,)`` natural, ``offsets`` key position
    minus query position, ``(1 or rows, tokens)``)."""
    if HAS_CAP:
        scores = cap_log2 * tanh(scores / cap_log2)
    if HAS_ALIBI:
        scores = scores + (slopes[:, None] * LOG2E_CONST) * offsets.to(tl.float32)
    return scores


@triton.jit
def kept_position(i, sinks_kept, window_start):
    """The context position of kept token number ``i``."""
    return tl.where(i < sinks_kept, i, i - sinks_kept + window_start)


@triton.jit
def tile_slots(table_row, tile, end, sinks_kept, window_start, PAGE_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Kept tokens ``tile .. tile + BLOCK_N`` of a split ending at ``end``: their context
    positions, which of them are read (inside the split, on an allocated page), and the
    pool slot (``page * PAGE_SIZE + offset``, int64) each lies in."""
    i = tile + tl.arange(0, BLOCK_N)
    valid = i < end
    position = kept_position(i, sinks_kept, window_start)
    page = tl.load(table_row + position // PAGE_SIZE, mask=valid, other=-1)
    slot = page.to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE
    return position, valid & (page >= 0), slot


def rows_per_program(tensor, tile: int) -> int:
    """Rows a small kernel handles per program: one tile's worth on a GPU, many under the
    interpreter, whose cost is per program."""
    if tensor.device.type == "cpu":
        return 64
    return max(1, min(16, 8192 // tile))


def choose_splits(batch: int, num_kv_heads: int, longest_kept: int, sm_count: int,
                  block_n: int, waves: float = 2.0) -> int:
    """Enough programs to fill the GPU ``waves`` times, without splits shorter than 2 tiles;
    none when the unsplit grid fills every SM already (H200, 32 x 4096 tokens, 8 KV heads:
    139 us unsplit against 160 us in two splits, fp16 and e4m3 alike;
    benchmarks/results/h200-multi-token/sweep-splits.log)."""
    if longest_kept <= 0 or batch * num_kv_heads >= sm_count:
        return 1
    wanted = math.ceil(waves * sm_count / max(1, batch * num_kv_heads))
    useful = math.ceil(longest_kept / (2 * block_n))
    return max(1, min(wanted, useful, 256))
