"""Paged split-KV decode for multi-head latent attention (DeepSeek-V2/V3, absorbed weights).

Every token stores one latent ``c`` (``kv_lora_rank`` wide) and one rotary key part ``k_pe``
(``rope_dim``) in the paged cache, shared by all query heads; query head h scores it
``q_nope[h] . c + q_pe[h] . k_pe`` and its output is ``softmax . c``. Grid ``(batch, head
blocks, splits)``: a program packs ``BLOCK_H`` query heads into one ``tl.dot`` tile, walks
the kept tokens of its split in tiles of ``BLOCK_N``, and loads each latent tile once: as
the key (with the rotary tile beside it) and again as the value, from registers. The splits
are merged by the GQA kernel's combine (``splitkv_kernel.combine_splits``), with the
latent's width as the output's.

The cache is the problem's ``k_pages`` as it is: ``(pages, page_size, 1, kv_lora_rank +
rope_dim)``, a token's latent then its rotary part (the layout of FlashMLA's and vLLM's MLA
caches); sliding windows and first-N sinks are walked as in the GQA kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from conformance.backends.triton.kernel_common import (
    LOG2E,
    choose_splits,
    kept_span,
    online_softmax_step,
    split_bounds,
    tile_slots,
)
from conformance.backends.triton.splitkv_kernel import DOT_DTYPES, combine_splits
from conformance.backends.triton.validation import check_mla_inputs


@triton.jit
def _mla_partial_kernel(
    q, pages, block_table, context_lens, part_m, part_l, part_acc,
    scale_log2, window, sinks, stride_table, num_splits,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(context_lens + b)
    kept, sinks_kept, window_start = kept_span(n, window, sinks, HAS_WINDOW)
    start, end = split_bounds(kept, split, num_splits, BLOCK_N)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    c_mask, r_mask = c < RANK, r < ROPE
    q_row = (b.to(tl.int64) * NUM_HEADS + heads) * (RANK + ROPE)
    q_nope = tl.load(q + q_row[:, None] + c[None, :], mask=head_mask[:, None] & c_mask[None, :],
                     other=0.0)
    q_pe = tl.load(q + q_row[:, None] + RANK + r[None, :],
                   mask=head_mask[:, None] & r_mask[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    table_row = block_table + b.to(tl.int64) * stride_table
    for tile in range(start, end, BLOCK_N):
        _, valid, slot = tile_slots(table_row, tile, end, sinks_kept, window_start, PAGE_SIZE,
                                    BLOCK_N)
        token = slot * (RANK + ROPE)
        latent = tl.load(pages + token[:, None] + c[None, :],
                         mask=valid[:, None] & c_mask[None, :], other=0.0)
        rope = tl.load(pages + token[:, None] + RANK + r[None, :],
                       mask=valid[:, None] & r_mask[None, :], other=0.0)
        scores = tl.dot(q_nope, tl.trans(latent), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(rope), input_precision=DOT_PRECISION)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m, total, alpha, p = online_softmax_step(m, total, scores)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), latent,
                                            input_precision=DOT_PRECISION)

    state = (b.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
    tl.store(part_m + state, m, mask=head_mask)
    tl.store(part_l + state, total, mask=head_mask)
    tl.store(part_acc + state[:, None] * RANK + c[None, :], acc,
             mask=head_mask[:, None] & c_mask[None, :])


def tile_config(rank: int, num_heads: int, batch: int = 1) -> dict:
    """Launch parameters: 32-token tiles at the real latent width, 64 below it; 16 heads a
    tile (the smallest ``tl.dot`` row count) for few sequences, 64 heads and 8 warps once
    16 sequences fill the grid (each latent tile then serves 64 heads). The sweep on an
    H200 (benchmarks/results/h200-mla/sweep-mla.json, DeepSeek-V3, bf16): 1 x 32768 103 us
    at 16 heads (405 us at 64); 32 x 4096 296 us at 64 heads, 8 warps (353 us at 16);
    128 x 1024 256 us (380 us at 16)."""
    wide = rank > 256
    many = wide and batch >= 16 and num_heads >= 64
    return {"BLOCK_H": 64 if many else 16, "BLOCK_N": 32 if wide else 64,
            "num_warps": 8 if many else 4, "num_stages": 2, "waves": 2}


def mla_decode(q, pages, block_table, context_lens, out, lse, *, kv_lora_rank: int,
               sm_scale: float, window: int | None = None, sinks: int = 0,
               num_splits: int | None = None, sm_count: int = 132, validate: bool = True,
               config: dict | None = None) -> None:
    """Write the output ``(batch, heads, kv_lora_rank)`` and natural-log LSE ``(batch,
    heads)`` float32 of an MLA decode batch.

    ``q (batch, heads, kv_lora_rank + rope_dim)``: each head's absorbed ``q_nope`` then its
    ``q_pe``; ``pages (pages, page_size, 1, kv_lora_rank + rope_dim)``: each token's latent
    then its rotary part; ``block_table (batch, max_blocks)`` int32 (-1 unallocated),
    ``context_lens (batch,)`` int32; all on one device."""
    import torch

    if validate:
        check_mla_inputs(q, pages, block_table, context_lens, out, lse,
                         kv_lora_rank=kv_lora_rank, window=window, sinks=sinks)
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits: {num_splits} must be at least 1")
    batch, heads, width = q.shape
    if batch == 0:
        return
    rope_dim = width - kv_lora_rank
    config = {**tile_config(kv_lora_rank, heads, batch), **(config or {})}
    head_blocks = triton.cdiv(heads, config["BLOCK_H"])
    if num_splits is None:
        longest = int(context_lens.max())
        if window is not None:
            longest = min(longest, window + sinks)
        num_splits = choose_splits(batch, head_blocks, longest, sm_count, config["BLOCK_N"],
                                   config["waves"])
    part_m = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, heads, num_splits, kv_lora_rank), dtype=torch.float32,
                           device=q.device)
    _mla_partial_kernel[(batch, head_blocks, num_splits)](
        q, pages, block_table, context_lens, part_m, part_l, part_acc,
        sm_scale * LOG2E, window or 0, sinks, block_table.stride(0), num_splits,
        NUM_HEADS=heads, RANK=kv_lora_rank, ROPE=rope_dim,
        BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_H=config["BLOCK_H"],
        PAGE_SIZE=pages.shape[1], BLOCK_N=config["BLOCK_N"], HAS_WINDOW=window is not None,
        DOT_PRECISION="ieee" if out.dtype == torch.float32 else "tf32",
        DOT_DTYPE=DOT_DTYPES[str(out.dtype)], num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    combine_splits(part_m, part_l, part_acc, out, lse)
