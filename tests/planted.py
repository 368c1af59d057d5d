"""Planted-bug backends: the NumPy backend with one realistic kernel bug each.

Every check of the suite is proven by at least one of these: the check meant for the bug
must fail on it, while the correct NumPy backend passes the same run. ``PLANTED`` pairs each
bug with the check (a ``family/sub-check`` prefix) that must catch it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np

from conformance.backends.base import AttentionState, Conventions
from conformance.backends.numpy_splitk import F32, NumpySplitK


class EmptyRowsUnwritten(NumpySplitK):
    """Returns early on an empty context, leaving its output rows unwritten (seed 000's bug)."""

    name = "bug-empty-rows-unwritten"

    def decode(self, problem, out, lse, *, num_splits=None):
        empty = problem.context_lens[problem.row_sequence] == 0  # per query row
        kept_out, kept_lse = out[empty].copy(), lse[empty].copy()
        super().decode(problem, out, lse, num_splits=num_splits)
        out[empty], lse[empty] = kept_out, kept_lse


class ReadsPastPartialPage(NumpySplitK):
    """Masks with ``<=`` instead of ``<``: one token past the end of each split is read."""

    name = "bug-reads-past-partial-page"

    def valid_tokens(self, tokens, start, end, problem, context_len):
        return super().valid_tokens(tokens, start, end + 1, problem, context_len + 1)


class ModuloHeadMapping(NumpySplitK):
    """Maps query head ``h`` to KV head ``h % num_kv_heads`` instead of ``h // group``."""

    name = "bug-modulo-head-mapping"

    def kv_head_map(self, num_qo_heads, num_kv_heads):
        return np.arange(num_qo_heads) % num_kv_heads


class Base2Lse(NumpySplitK):
    """Writes a base-2 LSE while declaring natural log."""

    name = "bug-base2-lse"

    def combine(self, partials):
        out, lse = super().combine(partials)
        return out, (lse / F32(math.log(2))).astype(F32)


class MergeWithoutRescale(NumpySplitK):
    """Adds the two outputs without weighting them by exp(lse_x - lse)."""

    name = "bug-merge-without-rescale"

    def merge(self, a, b):
        merged = super().merge(a, b)
        out = a.out.astype(F32) + b.out.astype(F32)
        return AttentionState(out=out.astype(a.out.dtype), lse=merged.lse)


class WindowOffByOne(NumpySplitK):
    """Keeps ``window - 1`` tokens: ``>`` where ``>=`` belongs."""

    name = "bug-window-off-by-one"

    def valid_tokens(self, tokens, start, end, problem, context_len):
        valid = super().valid_tokens(tokens, start, end, problem, context_len)
        if problem.window is not None:
            valid &= (tokens > context_len - problem.window) | (tokens < problem.sinks)
        return valid


class SinksIgnored(NumpySplitK):
    """Applies the sliding window but drops the attention sinks."""

    name = "bug-sinks-ignored"

    def valid_tokens(self, tokens, start, end, problem, context_len):
        valid = (tokens >= start) & (tokens < end)
        if problem.window is not None:
            valid &= tokens >= context_len - problem.window
        return valid


class MutatesInput(NumpySplitK):
    """Pre-scales q by sm_scale in place, changing the caller's array."""

    name = "bug-mutates-input"

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        problem.q[...] = (problem.q.astype(F32) * F32(problem.sm_scale)).astype(problem.q.dtype)


class MinusOneAsPageZero(NumpySplitK):
    """Reads a ``-1`` block-table entry as physical page 0, unmasked, and relies on the
    window's zero weights there: exact with finite garbage in page 0, NaN with NaN."""

    name = "bug-minus-one-as-page-zero"

    def load_page(self, problem, block, valid):
        if block >= 0:
            return super().load_page(problem, block, valid)
        return self.page(problem, 0)


class SplitsAveraged(NumpySplitK):
    """Combines split results with a plain average instead of an LSE-weighted merge."""

    name = "bug-splits-averaged"

    def combine(self, partials):
        live = [(m, total, acc) for m, total, acc in partials if np.isfinite(m).all()]
        if len(live) < 2:
            return super().combine(partials)
        out = np.mean([acc / total[..., None] for _, total, acc in live], axis=0)
        lse = np.mean([m + np.log(total) for m, total, _ in live], axis=0)
        return out.astype(F32), lse.astype(F32)


class Nondeterministic(NumpySplitK):
    """Perturbs the LSE by one ulp at random, like an unordered atomic reduction."""

    name = "bug-nondeterministic"

    def __init__(self):
        self.rng = np.random.default_rng()

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        direction = np.where(self.rng.random(lse.shape) < 0.5, -np.inf, np.inf).astype(F32)
        lse[...] = np.where(np.isfinite(lse), np.nextafter(lse, direction), lse)


class StalePageCache(NumpySplitK):
    """Caches upcast pages by physical page id across calls: stale once the pool changes."""

    name = "bug-stale-page-cache"

    def __init__(self):
        self.cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def load_page(self, problem, block, valid):
        if block < 0:
            return None
        key = (problem.k_pages.shape, problem.k_pages.dtype.str, block)
        if key not in self.cache:
            self.cache[key] = self.page(problem, block)
        keys, values = self.cache[key]
        mask = valid[:, None, None]
        return np.where(mask, keys, F32(0)), np.where(mask, values, F32(0))


class BothEmptyMergeNaN(NumpySplitK):
    """Merges without guarding -inf - -inf: two empty states give NaN."""

    name = "bug-both-empty-merge-nan"

    def merge(self, a, b):
        top = np.maximum(a.lse, b.lse)
        with np.errstate(invalid="ignore"):
            w_a, w_b = np.exp(a.lse - top), np.exp(b.lse - top)
            out = (w_a[..., None] * a.out.astype(F32) + w_b[..., None] * b.out.astype(F32)) \
                / (w_a + w_b)[..., None]
            lse = top + np.log(w_a + w_b)
        return AttentionState(out=out.astype(a.out.dtype), lse=lse.astype(F32))


class NaiveExpMerge(NumpySplitK):
    """Merges with exp(lse) directly, without subtracting the max: overflows past LSE ~88."""

    name = "bug-naive-exp-merge"

    def merge(self, a, b):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            e_a, e_b = np.exp(a.lse.astype(F32)), np.exp(b.lse.astype(F32))
            out = (e_a[..., None] * a.out.astype(F32) + e_b[..., None] * b.out.astype(F32)) \
                / (e_a + e_b)[..., None]
            out = np.where(((e_a + e_b) == 0)[..., None], F32(0), out)
            lse = np.log(e_a + e_b)
        return AttentionState(out=out.astype(a.out.dtype), lse=lse.astype(F32))


class AttendsToOneMaskedSlot(NumpySplitK):
    """Lets the slot just past the end of each context in (where it lies in a live page)."""

    name = "bug-attends-to-one-masked-slot"

    def valid_tokens(self, tokens, start, end, problem, context_len):
        valid = super().valid_tokens(tokens, start, end, problem, context_len)
        if end == context_len:
            valid |= tokens == context_len
        return valid


class MasksByZeroWeight(NumpySplitK):
    """Loads masked slots as they are and relies on a zero softmax weight: 0 x NaN is NaN.

    Exact with finite values there, so only ``poison/masked-nan`` may catch it."""

    name = "bug-masks-by-zero-weight"

    def load_page(self, problem, block, valid):
        if block < 0:
            return None
        return self.page(problem, block)


class LastRowRoundedToHalf(NumpySplitK):
    """Writes the last row of the batch through float16 (a tail-tile store of the wrong
    width): correct wherever the row moves out of the last place."""

    name = "bug-last-row-rounded-to-half"

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        out[-1] = out[-1].astype(np.float16).astype(out.dtype)
        lse[-1] = lse[-1].astype(np.float16).astype(np.float32)


class BatchWideMaxShift(NumpySplitK):
    """Shifts every row's exponentials by the largest score of the whole batch, not the row's
    own: a row far below its neighbours underflows to nothing."""

    name = "bug-batch-wide-max-shift"

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        live = np.isfinite(lse)
        if live.sum() > 1:
            top = lse[live].max()
            underflow = (lse - top) < -80  # exp(-80) is below float32's smallest normal
            out[underflow & live] = 0
            lse[underflow & live] = -np.inf


class LargePagesDropLastToken(NumpySplitK):
    """With pages of 32 tokens or more, skips the last slot of every page."""

    name = "bug-large-pages-drop-last-token"

    def valid_tokens(self, tokens, start, end, problem, context_len):
        valid = super().valid_tokens(tokens, start, end, problem, context_len)
        if problem.page_size >= 32:
            valid &= (tokens % problem.page_size) != problem.page_size - 1
        return valid


class WideTableRowsShifted(NumpySplitK):
    """With a block table of 32 columns or more, reads each row's pages from the next row's
    table entry (a stride taken from the wrong width)."""

    name = "bug-wide-table-rows-shifted"

    def decode(self, problem, out, lse, *, num_splits=None):
        from dataclasses import replace

        if problem.block_table.shape[1] >= 32 and problem.batch > 1:
            problem = replace(problem, block_table=np.roll(problem.block_table, 1, axis=0))
        super().decode(problem, out, lse, num_splits=num_splits)


class MergeEmptyAsZeroLse(NumpySplitK):
    """Merges an empty state (LSE -inf) as if its LSE were 0: it dilutes the other."""

    name = "bug-merge-empty-as-zero-lse"

    def merge(self, a, b):
        a = AttentionState(a.out, np.where(np.isneginf(a.lse), F32(0), a.lse).astype(F32))
        b = AttentionState(b.out, np.where(np.isneginf(b.lse), F32(0), b.lse).astype(F32))
        return super().merge(a, b)


class MergeFirstInHalf(NumpySplitK):
    """Accumulates the first state's output in float16, the second's in float32."""

    name = "bug-merge-first-in-half"

    def merge(self, a, b):
        rounded = AttentionState(a.out.astype(np.float16).astype(a.out.dtype), a.lse)
        return super().merge(rounded, b)


class MergeLseIsMax(NumpySplitK):
    """Weights the outputs right but returns max(lse_a, lse_b) as the merged LSE."""

    name = "bug-merge-lse-is-max"

    def merge(self, a, b):
        merged = super().merge(a, b)
        return AttentionState(merged.out, np.maximum(a.lse, b.lse).astype(F32))


# (bug, the check that must catch it). A check is "family/sub-check" or a prefix of one.
class SplitPartialsInHalf(NumpySplitK):
    """Writes each split's un-normalised partial output to a float16 scratch buffer on float16
    cases, as a kernel that sizes its scratch by the query dtype: a long row of large same-sign
    values overflows it (65504), though every final output is small."""

    name = "bug-split-partials-in-half"

    def split_state(self, problem, b, q, start, end, context_len, heads):
        m, total, acc = super().split_state(problem, b, q, start, end, context_len, heads)
        if problem.dtype == np.float16:
            with np.errstate(over="ignore"):
                acc = acc.astype(np.float16).astype(F32)
        return m, total, acc


class TruncatesOutput(NumpySplitK):
    """Converts its float32 result to float16/bfloat16 by truncation (toward zero), not to
    nearest even: never more than one ulp off, inside every budget."""

    name = "bug-truncates-output"

    def store(self, row, dtype):
        rounded = row.astype(dtype)
        away = np.abs(rounded.astype(F32)) > np.abs(row)  # rounded away from zero: step back
        if np.dtype(dtype) == np.float16:
            return np.where(away, np.nextafter(rounded, np.float16(0)), rounded)
        if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
            return (row.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
        return rounded


class ScoresHeldInDtype(NumpySplitK):
    """Holds the scores in the case's dtype before the softmax, as a kernel that keeps the
    ``q @ K^T`` tile in float16/bfloat16 (or a math path that never upcasts): at scores of
    -1e5 a bfloat16 score is off by up to 256. The oracle's low-precision model made the same
    mistake until issue 17, so its budget (4.0) admitted this kernel, and zeros."""

    name = "bug-scores-held-in-dtype"

    def held_scores(self, scores, problem):
        return scores.astype(problem.dtype).astype(F32)


class PageIdsInInt16(NumpySplitK):
    """Holds block-table entries in int16: page 40000 becomes -25536 (skipped as unallocated),
    page 140000 becomes 8928 (another sequence's page, or garbage)."""

    name = "bug-page-ids-in-int16"

    def load_page(self, problem, block, valid):
        return super().load_page(problem, int(np.array(block).astype(np.int16)), valid)


class ContextLensInInt16(NumpySplitK):
    """Holds context lengths in int16: 40000 tokens become -25536 (an empty row), 70000 become
    4464."""

    name = "bug-context-lens-in-int16"

    def decode(self, problem, out, lse, *, num_splits=None):
        wrapped = np.maximum(problem.context_lens.astype(np.int16), 0).astype(np.int32)
        super().decode(replace(problem, context_lens=wrapped), out, lse, num_splits=num_splits)


class FlatOffsetInInt32(NumpySplitK):
    """Computes a page's flat element offset ``block * page_stride`` in int32: past 2^31
    elements it wraps, and the page read is another one."""

    name = "bug-flat-offset-in-int32"

    def load_page(self, problem, block, valid):
        if block >= 0:
            stride = problem.page_size * problem.num_kv_heads * problem.head_dim
            offset = (block * stride + 2**31) % 2**32 - 2**31  # what int32 arithmetic gives
            block = (offset % problem.k_pages.size) // stride
        return super().load_page(problem, block, valid)


class VScaleIgnored(NumpySplitK):
    """Dequantizes K with its scales and reads V codes as they are: v_scale never applied."""

    name = "bug-v-scale-ignored"

    def page(self, problem, block):
        keys, values = self.codes(problem, block)
        if problem.k_scale is not None:
            keys = keys * self.page_scales(problem.k_scale, block)[..., None]
        return keys, values


class KScaleForV(NumpySplitK):
    """Dequantizes V with K's scales (one scale argument passed for both)."""

    name = "bug-k-scale-for-v"

    def decode(self, problem, out, lse, *, num_splits=None):
        if problem.k_scale is not None:
            problem = replace(problem, v_scale=problem.k_scale)
        super().decode(problem, out, lse, num_splits=num_splits)


class PerHeadScaleByQueryHead(NumpySplitK):
    """Indexes per-head scales by the group's first query head (``kv_head * group``, wrapped
    into the array) instead of by the KV head."""

    name = "bug-per-head-scale-by-query-head"

    def decode(self, problem, out, lse, *, num_splits=None):
        if problem.kv_scale == "per-head":
            heads = (np.arange(problem.num_kv_heads) * problem.group_size) % problem.num_kv_heads
            problem = replace(problem, k_scale=problem.k_scale[heads],
                              v_scale=problem.v_scale[heads])
        super().decode(problem, out, lse, num_splits=num_splits)


class PerTokenScaleOfFirstSlot(NumpySplitK):
    """Reads one scale per page, its first slot's, for every token of the page (a kernel
    written for per-block scales given per-token ones)."""

    name = "bug-per-token-scale-of-first-slot"

    def page_scales(self, scale, block):
        scales = super().page_scales(scale, block)
        return np.broadcast_to(scales[:1], scales.shape) if scale.ndim == 3 else scales


class E5m2ReadAsE4m3(NumpySplitK):
    """Reinterprets e5m2 codes as e4m3fn bytes (one fp8 dtype assumed for the cache)."""

    name = "bug-e5m2-read-as-e4m3"

    def codes(self, problem, block):
        keys, values = problem.k_pages[block], problem.v_pages[block]
        if keys.dtype == ml_dtypes.float8_e5m2:
            keys = keys.view(np.uint8).view(ml_dtypes.float8_e4m3fn)
            values = values.view(np.uint8).view(ml_dtypes.float8_e4m3fn)
        return keys.astype(F32), values.astype(F32)


class ScaleCompiledIn(NumpySplitK):
    """Keeps the per-tensor or per-head scales it first saw with a KV cache for as long as
    that cache holds the same codes (scales read once when the cache was registered, or baked
    into a captured graph): right on every fresh cache, stale once only the scales change."""

    name = "bug-scale-compiled-in"

    def __init__(self):
        self.scales: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def decode(self, problem, out, lse, *, num_splits=None):
        if problem.kv_scale in ("per-tensor", "per-head"):
            key = (problem.k_pages.shape, hash(problem.k_pages.tobytes()))
            k_scale, v_scale = self.scales.setdefault(key, (problem.k_scale.copy(),
                                                            problem.v_scale.copy()))
            problem = replace(problem, k_scale=k_scale, v_scale=v_scale)
        super().decode(problem, out, lse, num_splits=num_splits)


class QScaleIgnored(NumpySplitK):
    """Reads an fp8 query's codes without its scale."""

    name = "bug-q-scale-ignored"

    def query(self, problem, b):
        return problem.q[b].astype(F32) * F32(problem.sm_scale)


class SoftCapAfterSoftmax(NumpySplitK):
    """Applies the soft-cap to the probabilities, after the softmax, not to the scores: on
    values in [0, 1] a cap of 30 bends nothing, so the scores go uncapped."""

    name = "bug-soft-cap-after-softmax"

    def modified_scores(self, scores, tokens, problem, context_len, heads):
        return super().modified_scores(scores, tokens, replace(problem, soft_cap=None),
                                       context_len, heads)


class SoftCapOfUnscaledScores(NumpySplitK):
    """Caps ``q . k`` before the softmax scale: ``cap * tanh(q.k / cap) * sm_scale``."""

    name = "bug-soft-cap-of-unscaled-scores"

    def modified_scores(self, scores, tokens, problem, context_len, heads):
        if problem.soft_cap is None:
            return super().modified_scores(scores, tokens, problem, context_len, heads)
        cap, scale = F32(problem.soft_cap), F32(problem.sm_scale)
        capped = (cap * np.tanh(scores / scale / cap) * scale).astype(F32)
        return super().modified_scores(capped, tokens, replace(problem, soft_cap=None),
                                       context_len, heads)


class TanhThroughExp(NumpySplitK):
    """Computes the cap's tanh as ``(e^x - e^-x) / (e^x + e^-x)``: past |x| ~ 88 both exps
    overflow float32 and the score is inf / inf = NaN."""

    name = "bug-tanh-through-exp"

    def modified_scores(self, scores, tokens, problem, context_len, heads):
        if problem.soft_cap is None:
            return super().modified_scores(scores, tokens, problem, context_len, heads)
        cap = F32(problem.soft_cap)
        x = (scores / cap).astype(F32)
        tanh = (np.exp(x) - np.exp(-x)) / (np.exp(x) + np.exp(-x))
        return super().modified_scores((cap * tanh).astype(F32), tokens,
                                       replace(problem, soft_cap=None), context_len, heads)


class SinkPerSplit(NumpySplitK):
    """Adds the sink's ``exp(z)`` to every split's denominator, not once per row."""

    name = "bug-sink-per-split"

    def decode(self, problem, out, lse, *, num_splits=None):
        self.splits = num_splits or self.default_splits(problem)
        super().decode(problem, out, lse, num_splits=num_splits)

    def sink_state(self, problem, heads):
        state = super().sink_state(problem, heads)
        return None if state is None else (state[0], state[1] * F32(self.splits), state[2])


class SinkByKvHead(NumpySplitK):
    """Reads the sink logit of query head ``h`` at its KV head, ``h // group``."""

    name = "bug-sink-by-kv-head"

    def sink_state(self, problem, heads):
        if problem.sink_logits is None:
            return None
        by_kv = problem.sink_logits[np.arange(problem.num_qo_heads) // problem.group_size]
        return super().sink_state(replace(problem, sink_logits=by_kv), heads)


class SinkLogitsIgnored(NumpySplitK):
    """Takes the sink logits and drops them (what FlashInfer's fa2 decode does with
    ``run(sinks=)``: docs/findings/flashinfer-decode-sinks-ignored.md)."""

    name = "bug-sink-logits-ignored"

    def sink_state(self, problem, heads):
        return None


class AlibiSlopesReversed(NumpySplitK):
    """Gives query head ``h`` the slope of head ``num_qo_heads - 1 - h``."""

    name = "bug-alibi-slopes-reversed"

    def modified_scores(self, scores, tokens, problem, context_len, heads):
        if problem.alibi_slopes is not None:
            problem = replace(problem, alibi_slopes=problem.alibi_slopes[::-1].copy())
        return super().modified_scores(scores, tokens, problem, context_len, heads)


class AlibiFromFirstToken(NumpySplitK):
    """Biases by ``slope * key position`` (from the first token), not by the distance back
    from the query: the same shift of every score of a row, so only the LSE shows it."""

    name = "bug-alibi-from-first-token"

    def modified_scores(self, scores, tokens, problem, context_len, heads):
        return super().modified_scores(scores, tokens, problem, 1, heads)


class CausalOffByOne(NumpySplitK):
    """Draft t of a causal batch sees drafts 0..t+1: the mask compares with ``<=`` one token
    too far."""

    name = "bug-causal-off-by-one"

    def query_view(self, problem, row):
        end, context_len = super().query_view(problem, row)
        if problem.query_lens is None or problem.draft_mask is not None:
            return end, context_len
        b = int(problem.row_sequence[row])
        return min(end + 1, int(problem.context_lens[b])), context_len


class TreeMaskTransposed(NumpySplitK):
    """Reads the draft-visibility matrix by column: draft t sees the drafts that see it."""

    name = "bug-tree-mask-transposed"

    def drafts_seen(self, problem, row):
        if problem.draft_mask is None:
            return None
        b = int(problem.row_sequence[row])
        first = problem.rows_of([b])[0]
        query_len = int(problem.row_lens[b])
        return problem.draft_mask[first:first + query_len, row - first]


class MaskTakenAsCausal(NumpySplitK):
    """Ignores the visibility matrix and applies the causal mask (an upstream fp8 kernel with
    the causal mask compiled in): a full mask answers causal, a tree sees its siblings."""

    name = "bug-mask-taken-as-causal"

    def query_view(self, problem, row):
        return super().query_view(replace(problem, draft_mask=None), row)

    def drafts_seen(self, problem, row):
        return None


class LastTokenOnly(NumpySplitK):
    """Computes one row per sequence, its last query token's (which sees all its drafts), and
    writes it to every query row of the sequence: no causal mask (an upstream tensor-core
    decode with ``q_len_per_req > 1``)."""

    name = "bug-last-token-only"

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        last = np.cumsum(problem.row_lens) - 1
        out[...], lse[...] = out[last[problem.row_sequence]], lse[last[problem.row_sequence]]


class RaggedRowsSwapped(NumpySplitK):
    """Finds a sequence's query rows at ``b * max(query_lens)`` as if the queries were padded
    to the longest, though they are packed: with ragged lengths, sequences read their
    neighbours' query tokens (wrapping past the last row)."""

    name = "bug-ragged-rows-swapped"

    def query(self, problem, row):
        if problem.query_lens is None:
            return super().query(problem, row)
        b = int(problem.row_sequence[row])
        draft = row - problem.rows_of([b])[0]
        padded = (b * int(problem.query_lens.max()) + draft) % problem.tokens
        return super().query(problem, padded)


class SplitScratchShared(NumpySplitK):
    """Indexes the split-K scratch by sequence, not by query row: every query token of a
    sequence writes the same slots, and each one's combine reads what the last wrote. One
    split writes no scratch, so it is right there."""

    name = "bug-split-scratch-shared"

    def row_partials(self, problem, row, splits, heads):
        if problem.query_lens is not None and splits > 1:
            row = int(np.cumsum(problem.row_lens)[problem.row_sequence[row]] - 1)
        return super().row_partials(problem, row, splits, heads)


class MlaScaleWithoutLog2e(NumpySplitK):
    """An exp2 softmax whose scale lacks log2(e): MLA scores scaled by ln 2 (FlashInfer's and
    vLLM's MLA both shipped it once)."""

    name = "bug-mla-scale-without-log2e"

    def query(self, problem, row):
        q = super().query(problem, row)
        return q * F32(math.log(2)) if problem.kv_lora_rank is not None else q


class MlaPageStrideOne(NumpySplitK):
    """Addresses an MLA token as page + slot, the page stride taken as 1 token: right for
    pages of 1, wrong for every other size."""

    name = "bug-mla-page-stride-one"

    def codes(self, problem, block):
        if problem.kv_lora_rank is None:
            return super().codes(problem, block)
        flat = problem.k_pages.reshape(-1, *problem.k_pages.shape[2:])
        keys = flat[np.minimum(block + np.arange(problem.page_size), len(flat) - 1)].astype(F32)
        return keys, keys[..., :problem.kv_lora_rank]


class MlaRopeDropped(NumpySplitK):
    """Scores from the latent alone: ``q_nope . c``, the rotary part ``q_pe . k_pe`` lost."""

    name = "bug-mla-rope-dropped"

    def query(self, problem, row):
        q = super().query(problem, row)
        if problem.kv_lora_rank is not None:
            q = q.copy()
            q[..., problem.kv_lora_rank:] = 0
        return q


class MlaEmptyRowDividedByZero(NumpySplitK):
    """The MLA combine divides by the row's denominator unguarded: an empty row is 0/0 = NaN
    (a stage-2 bug that poisoned whole batches of padded rows)."""

    name = "bug-mla-empty-row-divided-by-zero"

    mla = False

    def combine(self, partials):
        out, lse = super().combine(partials)
        if self.mla:
            out = np.where(np.isfinite(lse)[..., None], out, F32(np.nan))  # 0 / 0
        return out, lse

    def decode(self, problem, out, lse, *, num_splits=None):
        self.mla = problem.kv_lora_rank is not None
        super().decode(problem, out, lse, num_splits=num_splits)


PLANTED: list[tuple[type[NumpySplitK], str]] = [
    (EmptyRowsUnwritten, "poison/unwritten"),
    (AttendsToOneMaskedSlot, "oracle/output"),
    (MasksByZeroWeight, "poison/masked-nan"),
    (ReadsPastPartialPage, "oracle/output"),
    (ModuloHeadMapping, "oracle/output"),
    (ModuloHeadMapping, "invariance/gqa-as-mha"),
    (Base2Lse, "oracle/lse"),
    (MergeWithoutRescale, "merge/segments-page"),
    (MergeWithoutRescale, "merge/segments-inside-page"),
    (MergeWithoutRescale, "merge/segments-empty-segments"),
    (WindowOffByOne, "oracle/output"),
    (SinksIgnored, "oracle/output"),
    (MutatesInput, "purity"),
    (MinusOneAsPageZero, "poison/masked-nan"),
    (SplitsAveraged, "oracle/output"),
    (SplitsAveraged, "invariance/split-count-1"),
    (SplitsAveraged, "invariance/split-count-3"),
    (SplitsAveraged, "invariance/split-count-8"),
    (Nondeterministic, "determinism"),
    (StalePageCache, "invariance/reshuffle"),
    (BothEmptyMergeNaN, "merge/both-empty"),
    (NaiveExpMerge, "merge/lse-gap"),
    (LastRowRoundedToHalf, "invariance/batch-order"),
    (BatchWideMaxShift, "invariance/neighbours"),
    (LargePagesDropLastToken, "invariance/page-size"),
    (WideTableRowsShifted, "invariance/wide-table"),
    (MergeEmptyAsZeroLse, "merge/identity"),
    (MergeFirstInHalf, "merge/commutative"),
    (MergeLseIsMax, "merge/associative"),
    (TruncatesOutput, "oracle/rounding"),
    (SplitPartialsInHalf, "oracle/output"),
    (ScoresHeldInDtype, "oracle/output"),
    (PageIdsInInt16, "oracle/output"),
    (ContextLensInInt16, "oracle/output"),
    (VScaleIgnored, "oracle/output"),
    (KScaleForV, "oracle/output"),
    (PerHeadScaleByQueryHead, "oracle/output"),
    (PerTokenScaleOfFirstSlot, "oracle/output"),
    (E5m2ReadAsE4m3, "oracle/output"),
    (ScaleCompiledIn, "invariance/kv-scale"),
    (QScaleIgnored, "oracle/output"),
    (SoftCapAfterSoftmax, "oracle/output"),
    (SoftCapOfUnscaledScores, "oracle/output"),
    (TanhThroughExp, "oracle/output"),
    (SinkPerSplit, "oracle/output"),
    (SinkByKvHead, "oracle/output"),
    (SinkLogitsIgnored, "oracle/output"),
    (AlibiSlopesReversed, "oracle/output"),
    (AlibiFromFirstToken, "oracle/lse"),
    (CausalOffByOne, "oracle/output"),
    (TreeMaskTransposed, "oracle/output"),
    (MaskTakenAsCausal, "oracle/output"),
    (LastTokenOnly, "oracle/output"),
    (LastTokenOnly, "invariance/drafts-alone"),
    (RaggedRowsSwapped, "oracle/output"),
    (RaggedRowsSwapped, "invariance/sub-batches"),
    (SplitScratchShared, "invariance/split-count-1"),
    (MlaScaleWithoutLog2e, "oracle/output"),
    (MlaPageStrideOne, "oracle/output"),
    (MlaRopeDropped, "oracle/output"),
    (MlaEmptyRowDividedByZero, "oracle/output"),
]


class RaisesOnWindows(NumpySplitK):
    """A backend fault, not a numeric bug: raises on every windowed case."""

    name = "fault-raises-on-windows"

    def decode(self, problem, out, lse, *, num_splits=None):
        if problem.window is not None:
            raise RuntimeError("kernel launch failed: window not compiled in")
        super().decode(problem, out, lse, num_splits=num_splits)


class Unavailable(NumpySplitK):
    """A backend whose availability probe says no."""

    name = "fault-unavailable"

    @classmethod
    def availability(cls):
        return "needs a GPU: none found"


class CrashesOnWindows(NumpySplitK):
    """A native crash: the process dies with SIGSEGV on every windowed case."""

    name = "fault-crashes-on-windows"

    def decode(self, problem, out, lse, *, num_splits=None):
        if problem.window is not None:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGSEGV)
        super().decode(problem, out, lse, num_splits=num_splits)


class HalfPrecisionAccumulator(NumpySplitK):
    """Keeps the running output in float16 on float16 cases: worse, yet inside the budget.

    Not a conformance failure but an accuracy regression: the drift check must catch it."""

    name = "bug-half-precision-accumulator"

    def accumulator(self, acc, problem):
        if problem.dtype == np.float16:
            return acc.astype(np.float16).astype(F32)
        return acc


class SlowedDown(NumpySplitK):
    """Correct, but every call does its work ten times: a performance regression."""

    name = "bug-slowed-down"

    def decode(self, problem, out, lse, *, num_splits=None):
        for _ in range(10):
            super().decode(problem, out, lse, num_splits=num_splits)


# Shape-only bugs: no case of the `ci` or `full` profile has the shape that triggers them
# (tests/test_explore.py checks that), so only `explore` can find them. Each pairs with the
# smallest shape explore must shrink it to.


class PageOffsetByBitmask(NumpySplitK):
    """Takes a token's offset in its page as ``t & (page_size - 1)``: right for powers of two
    only (every page size the spec lists is one)."""

    name = "bug-page-offset-by-bitmask"

    def valid_tokens(self, tokens, start, end, problem, context_len):
        ps = problem.page_size
        seen = (tokens // ps) * ps + (tokens & (ps - 1))
        return super().valid_tokens(seen, start, end, problem, context_len)


class HeadDimTailIgnored(NumpySplitK):
    """Computes scores in 32-wide vectors and drops the tail of a head_dim that is not a
    multiple of 32 (every head_dim the spec lists is one)."""

    name = "bug-head-dim-tail-ignored"

    def split_state(self, problem, b, q, start, end, context_len, heads):
        d = q.shape[-1]
        if d % 32:
            q = q.copy()
            q[..., d - d % 32:] = 0
        return super().split_state(problem, b, q, start, end, context_len, heads)


class DropsTokenOnPositiveKey(NumpySplitK):
    """Drops a row's last token when that token's key starts positive: a bug the drawn values
    trigger, not the shape, so a saved finding replays only if its values are drawn again."""

    name = "bug-data-dependent"

    def decode(self, problem, out, lse, *, num_splits=None):
        lens = problem.context_lens.copy()
        for b, n in enumerate(problem.context_lens.tolist()):
            if n > 1:
                page = problem.block_table[b, (n - 1) // problem.page_size]
                if problem.k_pages[page, (n - 1) % problem.page_size, 0, 0] > 0:
                    lens[b] = n - 1
        super().decode(replace(problem, context_lens=lens), out, lse,
                       num_splits=num_splits)


class OddKvHeadRemainder(NumpySplitK):
    """Walks KV heads in pairs; with an odd count above one, the query heads of the last KV
    head read KV head 0 (the spec lists 1, 2, 4, 8 and 32 KV heads)."""

    name = "bug-odd-kv-head-remainder"

    def kv_head_map(self, num_qo_heads, num_kv_heads):
        kv = super().kv_head_map(num_qo_heads, num_kv_heads)
        if num_kv_heads > 1 and num_kv_heads % 2:
            kv = np.where(kv == num_kv_heads - 1, 0, kv)
        return kv


class InstancedOddKvHeads(OddKvHeadRemainder):
    """The same fault in a backend with kernels for a few shapes only (``instances``, as an
    ahead-of-time build): explore must draw inside them and shrink to the smallest that
    fails, 5 KV heads (3 is not instantiated; 1, 2 and 4 do not fail)."""

    name = "bug-instanced-odd-kv-heads"
    capabilities = replace(OddKvHeadRemainder.capabilities, instances=frozenset(
        (kv * group, kv, head_dim, 16, dtype) for kv in (1, 2, 4, 5, 7)
        for group, head_dim, dtype in ((1, 64, "float32"), (3, 40, "float16"))))


class TwoShapeOnlyBugs(OddKvHeadRemainder):
    """Two faults no listed case triggers, seen by different checks: the odd-KV-head remainder
    (oracle) and, at a head_dim not a multiple of 32, q pre-scaled in place (purity). Explore
    stops at neither: it must report both."""

    name = "bug-two-shape-only-bugs"

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        if problem.head_dim % 32:
            problem.q[...] = (problem.q.astype(F32) * F32(problem.sm_scale)).astype(
                problem.q.dtype)


# (bug, the field of the case that triggers it, the value explore must shrink it to)
SHAPE_ONLY: list[tuple[type[NumpySplitK], str, int]] = [
    (PageOffsetByBitmask, "page_size", 3),
    (HeadDimTailIgnored, "head_dim", 8),
    (OddKvHeadRemainder, "num_kv_heads", 3),
]


class Float64Reference(NumpySplitK):
    """The float64 oracle itself as a backend: explore must find nothing wrong with it."""

    name = "reference-float64"

    def decode(self, problem, out, lse, *, num_splits=None):
        from conformance.references import decode_reference

        got_out, got_lse = decode_reference(
            problem.q, problem.k_pages, problem.v_pages, problem.block_table,
            problem.context_lens, sm_scale=problem.sm_scale, window=problem.window,
            sinks=problem.sinks, k_scale=problem.k_scale, v_scale=problem.v_scale,
            q_scale=problem.q_scale, soft_cap=problem.soft_cap,
            sink_logits=problem.sink_logits, alibi_slopes=problem.alibi_slopes,
            query_lens=problem.query_lens, draft_mask=problem.draft_mask)
        out[...] = got_out.astype(out.dtype)
        lse[...] = got_lse.astype(np.float32)

    def merge(self, a, b):
        from conformance.references import merge_reference

        got_out, got_lse = merge_reference(a.out, a.lse, b.out, b.lse)
        return AttentionState(out=got_out.astype(a.out.dtype), lse=got_lse.astype(np.float32))


class Base2WithSentinel(NumpySplitK):
    """Correct, in TVM's conventions: a base-2 native LSE and -5e4 for an empty context,
    declared, and converted to natural log on the way out; its merge takes the sentinel as
    empty. It must pass everything, so the conventions path runs in every CI."""

    name = "conventions-base2-sentinel"
    conventions = Conventions(lse_base=2.0, empty_lse=-5e4)
    SENTINEL = F32(-5e4 * math.log(2.0))  # the sentinel in natural log, as written

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        native = np.where(np.isneginf(lse), F32(-5e4), lse / F32(math.log(2.0)))
        lse[...] = (native * F32(math.log(2.0))).astype(F32)

    def merge(self, a, b):
        def natural(state):
            empty = np.isclose(state.lse, self.SENTINEL, rtol=1e-6, atol=0.0)
            return AttentionState(state.out, np.where(empty, F32(-np.inf), state.lse))

        merged = super().merge(natural(a), natural(b))
        return AttentionState(merged.out, np.where(np.isneginf(merged.lse), self.SENTINEL,
                                                   merged.lse).astype(F32))


class SentinelNotConverted(Base2WithSentinel):
    """Declares TVM's conventions but writes the base-2 sentinel unconverted (-5e4, not
    -5e4 * ln 2): every empty row's LSE is wrong."""

    name = "bug-sentinel-not-converted"

    def decode(self, problem, out, lse, *, num_splits=None):
        super().decode(problem, out, lse, num_splits=num_splits)
        lse[np.isclose(lse, self.SENTINEL, rtol=1e-6, atol=0.0)] = F32(-5e4)
