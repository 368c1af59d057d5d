"""The float64 decode oracle: one query token per sequence, or several (speculative
verification: causal or tree-masked drafts), over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conformance.dtypes import widened


def kept_tokens(context_len: int, window: int | None, sinks: int, query_len: int = 1,
                token: int = 0, drafts_seen: np.ndarray | None = None) -> np.ndarray:
    """Token positions that query token ``token`` of the last ``query_len`` attends to.

    The query tokens are the last ``query_len`` positions of the context (a context length
    counts its draft tokens); token ``t`` sits at ``p = context_len - query_len + t`` and sees
    every position up to ``p`` (causal), or, given ``drafts_seen`` (its row of the draft
    visibility matrix, ``(query_len,)`` booleans), the context before the drafts and the
    drafts it marks, later ones too. The window keeps the positions past ``p - window`` and
    ``sinks`` always keeps the first ``sinks``; without a window every visible position is
    kept. With one query token that is the whole context, windowed.
    """
    first_draft = context_len - query_len
    query_position = first_draft + token
    positions = np.arange(max(0, query_position + 1 if drafts_seen is None else context_len))
    keep = np.ones(positions.size, dtype=bool)
    if drafts_seen is not None:
        drafts = positions >= first_draft
        keep[drafts] = np.asarray(drafts_seen, dtype=bool)[positions[drafts] - first_draft]
    if window is not None:
        keep &= (positions > query_position - window) | (positions < sinks)
    return positions[keep]


def tree_visibility(parents: np.ndarray) -> np.ndarray:
    """``(n, n)`` booleans: draft ``i`` sees draft ``j`` when ``j`` is ``i`` or one of its
    ancestors. ``parents[i] < i`` is the parent of draft ``i`` (-1: a child of the context);
    a chain (``parents[i] = i - 1``) is the causal mask."""
    parents = np.asarray(parents)
    n = parents.size
    seen = np.eye(n, dtype=bool)
    for i in range(n):
        if not -1 <= parents[i] < i:
            raise ValueError(f"parents[{i}] = {parents[i]}: want -1 <= parent < {i}")
        if parents[i] >= 0:
            seen[i] |= seen[parents[i]]
    return seen


def gather_sequence(k_pages: np.ndarray, v_pages: np.ndarray, block_row: np.ndarray,
                    positions: np.ndarray, k_scale: np.ndarray | None = None,
                    v_scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """K and V of the given token positions of one sequence, shape (tokens, heads_kv, dim):
    as stored, or, for a quantized cache (scales given), the float64 values the codes denote.
    """
    page_size = k_pages.shape[1]
    pages = block_row[positions // page_size]
    if np.any(pages < 0):
        raise ValueError(f"block_table holds -1 for a token that must be read: positions "
                         f"{positions[pages < 0][:8].tolist()}")
    slots = positions % page_size
    keys, values = k_pages[pages, slots], v_pages[pages, slots]
    if k_scale is None:
        return keys, values
    return (dequantize(keys, token_scales(k_scale, pages, slots, keys.shape[1])),
            dequantize(values, token_scales(v_scale, pages, slots, keys.shape[1])))


def token_scales(scale: np.ndarray, pages: np.ndarray, slots: np.ndarray,
                 num_kv_heads: int) -> np.ndarray:
    """``(tokens, heads_kv)``: the scale of each gathered token and head. ``scale`` is
    ``(1,)`` (per tensor), ``(heads_kv,)`` (per head) or ``(pages, page_size, heads_kv)``
    (per token, paged like the pages)."""
    scale = np.asarray(scale, dtype=np.float64)
    if scale.ndim == 3:
        return scale[pages, slots]
    return np.broadcast_to(scale.reshape(1, -1), (len(pages), num_kv_heads))


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """What fp8 codes ``(tokens, heads, dim)`` denote: ``code * scale``, exactly, in float64."""
    return widened(codes, np.float64) * scales[..., None]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes (Press et al., as BLOOM and MPT compute them): for a power
    of two n, 2^(-8i/n) for i = 1..n; otherwise those of the power of two below, then every
    other slope of twice that."""
    def powers(n: int) -> list[float]:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    below = 1 << (num_heads.bit_length() - 1)
    slopes = powers(below) + powers(2 * below)[0::2][:num_heads - below]
    return np.asarray(slopes, dtype=np.float64)


def decode_reference(q: np.ndarray, k_pages: np.ndarray, v_pages: np.ndarray,
                     block_table: np.ndarray, context_lens: np.ndarray, *,
                     sm_scale: float, window: int | None = None, sinks: int = 0,
                     k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None,
                     q_scale: np.ndarray | None = None, soft_cap: float | None = None,
                     sink_logits: np.ndarray | None = None,
                     alibi_slopes: np.ndarray | None = None, lse_includes_sink: bool = True,
                     query_lens: np.ndarray | None = None,
                     draft_mask: np.ndarray | None = None,
                     precision: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Attention output ``(tokens, heads_qo, dim_v)`` and natural-log LSE ``(tokens, heads_qo)``.

    The values may be narrower than the keys (``dim_v`` is ``v_pages``'s last axis): multi-head
    latent attention passes the latent cache as ``k_pages`` (one head, [latent | rope]) and
    its latent part as ``v_pages``.

    ``q`` holds the query tokens packed sequence by sequence: ``query_lens[b]`` (one each when
    None) rows for sequence ``b``, the last positions of its context, so that ``tokens`` is
    the batch for one-token decode. ``draft_mask`` ``(tokens, max query_len)`` says which
    drafts of its sequence each query row sees (its first ``query_len`` entries: a row of
    ``tree_visibility``), None for causal; see ``kept_tokens``.

    A quantized cache (fp8 codes in the pages, ``k_scale``/``v_scale`` as in
    ``token_scales``) and an fp8 query (``q_scale``, shape ``(1,)``) are read as the values
    they denote, ``code * scale``: the oracle is exact for them as for any other input.

    The score of key position ``j`` is ``s = q.k * sm_scale``, then ``soft_cap * tanh(s /
    soft_cap)`` with a cap, then plus ``slope_h * (j - (context_len - 1))`` with ALiBi (the
    query sits at the last position). A sink logit ``z_h`` adds ``exp(z_h)`` to the softmax
    denominator and nothing to the numerator; the LSE includes it unless
    ``lse_includes_sink`` is off. An empty context gives output 0 and LSE -inf (with a sink
    logit included: ``z_h``).

    ``precision`` other than float64 recomputes the same formula as a careful kernel in that
    precision would: inputs in ``precision``; scores, their maximum, exponentials and sums
    held in float32 (float64 for float64), as every flash-style kernel keeps them in
    registers; the probabilities rounded to ``precision`` for the ``P @ V`` product, and the
    output stored in it. The error-ratio tolerance rule uses it to learn how much error the
    case's own precision costs.
    """
    num_qo_heads = q.shape[1]
    num_kv_heads = k_pages.shape[2]
    if q_scale is not None:
        q = q.astype(np.float64) * float(np.asarray(q_scale).reshape(-1)[0])
    group = num_qo_heads // num_kv_heads

    accumulate = np.float64 if precision == np.float64 else np.float32

    def rounded(x: np.ndarray) -> np.ndarray:
        return np.asarray(x).astype(precision, copy=False).astype(accumulate, copy=False)

    modifiers = Modifiers(accumulate, sm_scale, soft_cap, sink_logits, alibi_slopes,
                          lse_includes_sink)
    batch = len(context_lens)
    query_lens = np.ones(batch, dtype=np.int64) if query_lens is None else query_lens
    out = np.zeros((len(q), num_qo_heads, v_pages.shape[3]), dtype=np.float64)
    lse = np.full((len(q), num_qo_heads), -np.inf, dtype=np.float64)
    row = 0
    for b in range(batch):
        n, query_len = int(context_lens[b]), int(query_lens[b])
        for t in range(query_len):
            positions = kept_tokens(n, window, sinks, query_len, t,
                                    None if draft_mask is None else draft_mask[row, :query_len])
            if positions.size == 0:
                lse[row] = modifiers.empty_lse(num_qo_heads)
            else:
                keys, values = gather_sequence(k_pages, v_pages, block_table[b], positions,
                                               k_scale, v_scale)
                with np.errstate(over="ignore", invalid="ignore"):  # rounded once, not per head
                    keys, values = rounded(keys), rounded(values)
                offsets = positions - (n - query_len + t)
                for h in range(num_qo_heads):
                    out[row, h], lse[row, h] = _attend(
                        q[row, h], keys[:, h // group], values[:, h // group], rounded,
                        modifiers, h, offsets)
            row += 1
    return out, lse


@dataclass(frozen=True)
class Modifiers:
    """What a model does to the scores (soft-cap, ALiBi) and to the softmax (sink logits)."""

    accumulate: type
    sm_scale: float
    soft_cap: float | None = None
    sink_logits: np.ndarray | None = None
    alibi_slopes: np.ndarray | None = None
    lse_includes_sink: bool = True

    def scores(self, raw: np.ndarray, h: int, offsets: np.ndarray) -> np.ndarray:
        """Scaled, capped and biased scores of head ``h``; ``offsets`` = key position minus
        query position."""
        scores = raw * self.accumulate(self.sm_scale)
        if self.soft_cap is not None:
            cap = self.accumulate(self.soft_cap)
            scores = cap * np.tanh(scores / cap)
        if self.alibi_slopes is not None:
            scores = scores + self.accumulate(self.alibi_slopes[h]) * offsets.astype(
                self.accumulate)
        return scores

    def sink(self, h: int) -> float | None:
        return None if self.sink_logits is None else self.accumulate(self.sink_logits[h])

    def empty_lse(self, num_heads: int) -> np.ndarray:
        if self.sink_logits is None or not self.lse_includes_sink:
            return np.full(num_heads, -np.inf)
        return np.asarray(self.sink_logits, dtype=np.float64)


def _attend(q: np.ndarray, kh: np.ndarray, vh: np.ndarray, rounded,
            modifiers: Modifiers, h: int, offsets: np.ndarray) -> tuple[np.ndarray, float]:
    """Softmax attention of one query head over its tokens (keys and values already
    ``rounded``); low precision may overflow, which is its measured error, not a fault.

    Scores stay in the accumulation precision: rounding a score of -1e5 to bfloat16 (spacing
    512) would make the model itself answer noise and the budget admit any output."""
    with np.errstate(over="ignore", invalid="ignore"):
        qh = rounded(q)
        scores = modifiers.scores(kh @ qh, h, offsets)
        sink = modifiers.sink(h)
        top = scores.max() if sink is None or sink == -np.inf else max(scores.max(), sink)
        weights = np.exp(scores - top)
        tokens = weights.sum()
        total = tokens if sink is None else tokens + np.exp(sink - top)
        lse = top + np.log(total if modifiers.lse_includes_sink else tokens)
        return rounded((rounded(weights) @ vh) / total), lse
