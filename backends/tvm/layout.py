"""The canonical problem in the layout of TVM's paged KV cache (``paged_kv_cache.cc``).

What TVM's decode kernels read, as TVM 0.27's runtime lays it out:

- ``pages (num_pages, 2, num_kv_heads, page_size, head_dim)``: K at ``[:, 0]``, V at
  ``[:, 1]``; a sequence's tokens fill its pages in order.
- A CSR page table: sequence ``b`` owns ``page_values[page_indptr[b]:page_indptr[b + 1]]``;
  an empty sequence owns no page.
- ``length_info``: without a sliding window, shape ``(batch,)``: the slots used in each
  sequence's last page (``last_page_len``). With one, shape ``(3, batch)``:
  ``last_page_len``, ``sliding_window_offset`` and ``sink_size``.
- Sliding window with sinks (``SlideWindowForSeq``): TVM's window size counts the sinks, so
  ours is ``window + sinks``. Until a sequence outgrows it nothing slides and offset and sink
  size are 0. Once it slides, the ``sink_size`` first tokens stay at page-list positions
  ``0..sink_size-1``; the kept window tokens sit contiguously from page-list position
  ``sliding_window_offset``; pages left wholly between them are removed from the page list,
  so the offset is ``sink_size + slid`` while that stays inside the sink pages, else
  ``sink_pages * page_size + (sink_size + slid) % page_size``. The kernel reads position
  ``i`` of its ``window + sinks`` kept tokens at page-list position ``i`` if ``i < sink_size``
  else ``i - sink_size + offset``.
- No RoPE: ``rotary_mode`` 0, so ``k_rope_pos_offset`` and ``q_rope_position`` are unused.
- MLA (``_attention_prefill_mla``): one merged page ``(num_pages, page_size, d_latent +
  d_rope)`` per token, the latent first: the value is the key's first ``d_latent``
  entries, as in the canonical problem; page table and ``length_info`` as above.

Slots no kept token occupies (tails of last pages, the evicted gap between sinks and window,
spare pages) are NaN, as in the canonical problem, so a stray read shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from conformance.problem import Problem


@dataclass(frozen=True)
class TvmPagedKV:
    pages: np.ndarray
    page_indptr: np.ndarray
    page_values: np.ndarray
    length_info: np.ndarray
    sliding_window: bool


def page_list_positions(n: int, window: int | None, sinks: int, page_size: int
                        ) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Tokens a sequence keeps, their page-list positions, and (offset, sink size)."""
    if window is None or n <= window + sinks:
        tokens = np.arange(n)
        return tokens, tokens, 0, 0
    slid = n - (window + sinks)
    sink_pages = math.ceil(sinks / page_size)
    raw = sinks + slid
    offset = raw if raw // page_size <= sink_pages else sink_pages * page_size + raw % page_size
    tokens = np.concatenate([np.arange(sinks), np.arange(n - window, n)])
    positions = np.concatenate([np.arange(sinks), offset + np.arange(window)])
    return tokens, positions, offset, sinks


def tvm_layout(problem: Problem, seed: int = 0) -> TvmPagedKV:
    """Lay the problem's kept tokens out as TVM's cache would hold them, pages shuffled."""
    page_size = problem.page_size
    sliding = problem.window is not None
    rows = []
    for b in range(problem.batch):
        n = int(problem.context_lens[b])
        tokens, positions, offset, sink_size = page_list_positions(n, problem.window,
                                                                   problem.sinks, page_size)
        stored = int(positions[-1]) + 1 if len(positions) else 0
        num_pages = math.ceil(stored / page_size)
        last_len = stored - (num_pages - 1) * page_size if num_pages else 0
        rows.append((tokens, positions, num_pages, (last_len, offset, sink_size)))
    total = sum(r[2] for r in rows)
    pool = total + 2
    physical = np.random.default_rng(seed).permutation(pool)[:total].astype(np.int32)
    mla = problem.kind == "mla"
    shape = (pool, page_size, problem.head_dim) if mla else (
        pool, 2, problem.num_kv_heads, page_size, problem.head_dim)
    pages = np.full(shape, np.nan, dtype=problem.dtype)
    indptr = np.zeros(problem.batch + 1, dtype=np.int32)
    info = np.zeros((3, problem.batch), dtype=np.int32)
    used = 0
    for b, (tokens, positions, num_pages, lengths) in enumerate(rows):
        mine = physical[used:used + num_pages]
        used += num_pages
        indptr[b + 1] = used
        info[:, b] = lengths
        source_pages, source_slots = problem.slots(b, tokens)
        target_pages = mine[positions // page_size]
        target_slots = positions % page_size
        if mla:  # (tokens, 1, latent + rope) -> pages[page, slot, latent + rope]
            pages[target_pages, target_slots] = problem.k_pages[source_pages, source_slots, 0]
            continue
        # (tokens, kv_heads, dim) -> pages[page, 0 or 1, head, slot, dim]
        pages[target_pages, 0, :, target_slots] = problem.k_pages[source_pages, source_slots]
        pages[target_pages, 1, :, target_slots] = problem.v_pages[source_pages, source_slots]
    return TvmPagedKV(pages=pages, page_indptr=indptr, page_values=physical.copy(),
                      length_info=info if sliding else info[0].copy(), sliding_window=sliding)
