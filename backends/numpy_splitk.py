"""A NumPy decode backend written like a split-K kernel, not like a second oracle.

It walks the block table page by page, keeps per-split partial states (running max ``m``,
denominator ``l``, accumulator ``acc``) in float32, packs the query heads of a GQA group
into one tile, and combines the splits with a log-sum-exp merge; an fp8 cache is dequantized
page by page on load. Its seams (``kv_head_map``, ``valid_tokens``, ``load_page``, ``page``,
``codes``, ``page_scales``, ``query``, ``query_view``, ``drafts_seen``, ``held_scores``,
``accumulator``, ``combine``, ``store``) are where the suite's planted bugs go.

Several query tokens per sequence are decoded row by row: each query row walks the tokens it
may see (to its own position, or to the end of its sequence under a draft mask), with
windows and ALiBi counted from its own position.
"""

from __future__ import annotations

import math

import numpy as np

from conformance.backends.base import AttentionState, Backend, Capabilities
from conformance.dtypes import FP8_DTYPES, SCALE_MODES, widened
from conformance.problem import Problem

F32 = np.float32


class NumpySplitK(Backend):
    name = "numpy"
    description = "split-K paged decode in NumPy: float32 partial states, GQA-packed, LSE merge"
    capabilities = Capabilities(features=frozenset({"lse", "merge", "split_k", "sliding_window",
                                                    "sinks", "soft_cap", "sink_logits",
                                                    "alibi", "multi_token", "draft_mask"}),
                                split_counts=(1, 3, 8), kv_dtypes=frozenset(FP8_DTYPES),
                                kv_scales=frozenset(SCALE_MODES), q_dtypes=frozenset(FP8_DTYPES),
                                kinds=frozenset({"gqa", "mla"}))

    def default_splits(self, problem: Problem) -> int:
        longest = int(problem.context_lens.max(initial=0))
        return max(1, min(8, math.ceil(longest / 128)))

    def kv_head_map(self, num_qo_heads: int, num_kv_heads: int) -> np.ndarray:
        """The KV head of each query head."""
        return np.arange(num_qo_heads) // (num_qo_heads // num_kv_heads)

    def valid_tokens(self, tokens: np.ndarray, start: int, end: int, problem: Problem,
                     context_len: int) -> np.ndarray:
        """Which of ``tokens`` this split attends to: inside the split and kept by the window."""
        valid = (tokens >= start) & (tokens < end)
        if problem.window is not None:
            valid &= (tokens >= context_len - problem.window) | (tokens < problem.sinks)
        return valid

    def load_page(self, problem: Problem, block: int,
                  valid: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """K and V of one page as float32, masked to ``valid``; None skips an unallocated page."""
        if block < 0:
            return None
        keys, values = self.page(problem, block)
        if valid.all():  # a whole page: nothing to mask (most pages of a long context)
            return keys, values
        return (np.where(valid[:, None, None], keys, F32(0)),
                np.where(valid[:, None, None], values, F32(0)))

    def page(self, problem: Problem, block: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of physical page ``block`` as float32, every slot: a quantized page
        dequantized on load, as a GPU kernel would (codes times ``page_scales``)."""
        keys, values = self.codes(problem, block)
        if problem.k_scale is not None:
            keys = keys * self.page_scales(problem.k_scale, block)[..., None]
            values = values * self.page_scales(problem.v_scale, block)[..., None]
        return keys, values

    def codes(self, problem: Problem, block: int) -> tuple[np.ndarray, np.ndarray]:
        """What page ``block`` stores, as float32 (an fp8 code's value is exact there). An
        MLA page's values are the view of its keys' latents (``Problem.v_pages``)."""
        return widened(problem.k_pages[block], F32), widened(problem.v_pages[block], F32)

    def page_scales(self, scale: np.ndarray, block: int) -> np.ndarray:
        """``(page_size or 1, kv_heads or 1)`` float32 scales of one page's tokens."""
        return scale[block] if scale.ndim == 3 else scale.reshape(1, -1)

    def query(self, problem: Problem, row: int) -> np.ndarray:
        """Query row ``row``'s heads as float32, times sm_scale (and an fp8 query's scale)."""
        scale = F32(problem.sm_scale)
        if problem.q_scale is not None:
            scale = scale * problem.q_scale.astype(F32)[0]
        return problem.q[row].astype(F32) * scale

    def query_view(self, problem: Problem, row: int) -> tuple[int, int]:
        """``(end, context_len)`` of query row ``row``: it walks tokens ``[0, end)``, and its
        window and ALiBi count from ``context_len - 1``, its own position (one-token decode:
        both the sequence's length)."""
        b = int(problem.row_sequence[row])
        position = int(problem.query_positions[row])
        end = int(problem.context_lens[b]) if problem.draft_mask is not None else position + 1
        return end, position + 1

    def drafts_seen(self, problem: Problem, row: int) -> np.ndarray | None:
        """Which drafts of its sequence row ``row`` sees, ``(query_len,)``; None: all it
        walks (causal, or one query token)."""
        if problem.draft_mask is None:
            return None
        return problem.draft_mask[row, :int(problem.row_lens[problem.row_sequence[row]])]

    def held_scores(self, scores: np.ndarray, problem: Problem) -> np.ndarray:
        """A page's scores as the softmax sees them: float32, as computed."""
        return scores

    def modified_scores(self, scores: np.ndarray, tokens: np.ndarray, problem: Problem,
                        context_len: int, heads: np.ndarray) -> np.ndarray:
        """Scaled scores ``(kv_heads, group, tokens)`` capped and biased as the model says;
        ``heads`` ``(kv_heads, group)`` are the query heads of the tile."""
        if problem.soft_cap is not None:
            cap = F32(problem.soft_cap)
            scores = cap * np.tanh(scores / cap)
        if problem.alibi_slopes is not None:
            offsets = (tokens - (context_len - 1)).astype(F32)
            scores = scores + problem.alibi_slopes[heads][..., None] * offsets
        return scores.astype(F32)

    def sink_state(self, problem: Problem, heads: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The sink logits as one more partial state (m = z, l = 1, acc = 0) for the combine,
        or None without them: the sink joins once, however many splits."""
        if problem.sink_logits is None:
            return None
        m = problem.sink_logits[heads].astype(F32)
        return m, np.ones_like(m), np.zeros((*m.shape, problem.head_dim_v), F32)

    def accumulator(self, acc: np.ndarray, problem: Problem) -> np.ndarray:
        """The running output accumulator after a page: float32, kept as it is."""
        return acc

    def combine(self, partials: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
                ) -> tuple[np.ndarray, np.ndarray]:
        """Merge the per-split states (m, l, acc) into the output and the natural-log LSE."""
        with np.errstate(over="ignore", invalid="ignore"):
            return self._combine(partials)

    def _combine(self, partials: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
                 ) -> tuple[np.ndarray, np.ndarray]:
        m = np.stack([p[0] for p in partials])
        l_split = np.stack([p[1] for p in partials])
        acc = np.stack([p[2] for p in partials])
        top = m.max(axis=0)
        finite = np.isfinite(top)
        weight = np.where(np.isfinite(m), np.exp(m - np.where(finite, top, F32(0))), F32(0))
        total = (weight * l_split).sum(axis=0)
        out = (weight[..., None] * acc).sum(axis=0) / np.where(finite, total, F32(1))[..., None]
        lse = np.where(finite, top + np.log(np.where(finite, total, F32(1))), F32(-np.inf))
        return out.astype(F32), lse.astype(F32)

    def decode(self, problem: Problem, out: np.ndarray, lse: np.ndarray, *,
               num_splits: int | None = None) -> None:
        splits = num_splits or self.default_splits(problem)
        hq, hkv, d = problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_v
        order = np.argsort(self.kv_head_map(hq, hkv), kind="stable")
        heads = order.reshape(hkv, -1)  # the query heads of each KV head's tile
        for b in range(problem.tokens):  # query rows: one per sequence in one-token decode
            partials = self.row_partials(problem, b, splits, heads)
            sink = self.sink_state(problem, heads)
            merged_out, merged_lse = self.combine(partials + ([sink] if sink else []))
            row = np.empty((hq, d), dtype=F32)
            row[order] = merged_out.reshape(hq, d)
            row_lse = np.empty(hq, dtype=F32)
            row_lse[order] = merged_lse.reshape(hq)
            out[b] = self.store(row, out.dtype)
            lse[b] = row_lse

    def row_partials(self, problem: Problem, row: int, splits: int, heads: np.ndarray
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The partial states (m, l, acc) of query row ``row``'s splits, as a kernel's
        split scratch holds them; ``heads`` ``(kv_heads, group)`` orders the tile."""
        n, context_len = self.query_view(problem, row)
        q = self.query(problem, row)[heads.reshape(-1)].reshape(*heads.shape, -1)
        split_len = math.ceil(n / splits)
        return [self.split_state(problem, row, q, s * split_len, min(n, (s + 1) * split_len),
                                 context_len, heads) for s in range(splits)]

    def store(self, row: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The float32 result in the output dtype: rounded to nearest even, as a GPU kernel's
        conversion does."""
        return row.astype(dtype)

    def split_state(self, problem: Problem, b: int, q: np.ndarray, start: int, end: int,
                    context_len: int, heads: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Online softmax of query row ``b`` over the pages of one split: returns (m, l,
        acc)."""
        with np.errstate(over="ignore", invalid="ignore"):  # a kernel raises no FP traps
            return self._online_softmax(problem, b, q, start, end, context_len, heads)

    def _online_softmax(self, problem: Problem, b: int, q: np.ndarray, start: int, end: int,
                        context_len: int, heads: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ps = problem.page_size
        sequence = int(problem.row_sequence[b])
        seen = self.drafts_seen(problem, b)
        first_draft = int(problem.context_lens[sequence]) - int(problem.row_lens[sequence])
        m = np.full(q.shape[:2], -np.inf, dtype=F32)
        total = np.zeros(q.shape[:2], dtype=F32)
        acc = np.zeros((*q.shape[:2], problem.head_dim_v), dtype=F32)
        for page in range(start // ps, math.ceil(end / ps) if end > start else start // ps):
            tokens = page * ps + np.arange(ps)
            valid = self.valid_tokens(tokens, start, end, problem, context_len)
            if seen is not None:
                drafts = tokens >= first_draft
                valid[drafts] &= seen[np.minimum(tokens[drafts] - first_draft, seen.size - 1)]
            loaded = self.load_page(problem, int(problem.block_table[sequence, page]), valid)
            if loaded is None:
                continue
            keys, values = loaded
            scores = self.held_scores(np.einsum("hgd,thd->hgt", q, keys), problem)
            scores = self.modified_scores(scores, tokens, problem, context_len, heads)
            scores = np.where(valid, scores, F32(-np.inf))
            m_new = np.maximum(m, scores.max(axis=-1))
            live = np.isfinite(m_new)
            base = np.where(live, m_new, F32(0))
            alpha = np.where(np.isfinite(m), np.exp(m - base), F32(0))
            p = np.where(live[..., None], np.exp(scores - base[..., None]), F32(0))
            total = total * alpha + p.sum(axis=-1)
            acc = self.accumulator(acc * alpha[..., None] + np.einsum("hgt,thd->hgd", p, values),
                                   problem)
            m = m_new
        return m, total, acc

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        lse_a, lse_b = a.lse.astype(F32), b.lse.astype(F32)
        top = np.maximum(lse_a, lse_b)
        finite = np.isfinite(top)
        base = np.where(finite, top, F32(0))
        w_a = np.where(np.isfinite(lse_a), np.exp(lse_a - base), F32(0))
        w_b = np.where(np.isfinite(lse_b), np.exp(lse_b - base), F32(0))
        total = np.where(finite, w_a + w_b, F32(1))
        out = (w_a[..., None] * a.out.astype(F32) + w_b[..., None] * b.out.astype(F32)) \
            / total[..., None]
        lse = np.where(finite, base + np.log(total), F32(-np.inf))
        return AttentionState(out=out.astype(a.out.dtype), lse=lse.astype(F32))
