"""Error measures and per-dtype budgets.

A budget has two sources, shown side by side: a fixed table per dtype, and the error-ratio
rule (a backend may be at most ``RATIO`` times as wrong as the oracle recomputed in the
case's own precision). The larger applies, so the table is a floor and the ratio rule
widens it only where the case is hard for that precision (long sums, huge scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TABLE = {"float32": 1e-5, "tf32": 1e-3, "float16": 1e-3, "bfloat16": 1e-2}
# A backend may be this many times as wrong as the oracle recomputed in the case's precision.
RATIO = 4.0
UNIT_ROUNDOFF_F32 = 2.0 ** -24  # kernels accumulate scores in float32 at best
ROUNDING_MARGIN = 4.0  # over the sqrt(d) probabilistic bound of a float32 dot product
# ``oracle/rounding``: of the elements well past a rounding midpoint, the share a kernel may
# round the wrong way (truncation: all of them; a float32-accumulating kernel: none), and the
# fewest such elements that make a verdict.
ROUNDING_SHARE = 0.9
ROUNDING_SAMPLE = 16


@dataclass(frozen=True)
class Budget:
    table: float
    ratio: float  # RATIO x the low-precision oracle's error; nan when that oracle failed

    @property
    def value(self) -> float:
        return max(self.table, self.ratio if math.isfinite(self.ratio) else 0.0)

    def scaled(self, factor: float) -> Budget:
        return Budget(self.table * factor, self.ratio * factor)


def merge_rounding(lses: list[np.ndarray], merges: int) -> float:
    """Relative output error a correct merge may make because LSEs are float32: each merged
    LSE is rounded by up to half an ulp of its magnitude (2^-24 |lse|), which moves the
    weights of the next merge by as much, relatively, and its output by that times
    ``|out_a - out_b| <= 2 max|out|``. Negligible at ordinary LSEs (2e-6 at |lse| = 10 over
    two merges); at the -1e5 of very negative scores it is 2e-2, and a float32 LSE cannot do
    better (explore met it on the NumPy backend and the float64 oracle alike)."""
    finite = [np.abs(x[np.isfinite(x)]).max(initial=0.0) for x in lses]
    return 2.0 * merges * 2.0 ** -24 * float(max(finite, default=0.0))


def table_budget(dtype: str, float32_matmul: str = "ieee") -> float:
    return TABLE["tf32" if dtype == "float32" and float32_matmul == "tf32" else dtype]


def output_error(got: np.ndarray, want: np.ndarray) -> float:
    """Max absolute difference over the largest reference magnitude; NaN or inf gives inf."""
    return float(output_errors(got, want).max(initial=0.0))


def output_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``output_error`` of every element: its absolute difference over the largest reference
    magnitude, inf where ``got`` is not finite."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    scale = float(np.abs(want).max(initial=0.0)) or 1.0
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(got), np.abs(got - want) / scale, math.inf)


def lse_error(got: np.ndarray, want: np.ndarray, empty_value: float = -math.inf) -> float:
    """Absolute error over max(1, |want|); where ``want`` is empty (-inf), ``got`` must be
    exactly the empty value the backend declared, else the error is inf."""
    return float(lse_errors(got, want, empty_value).max(initial=0.0))


def lse_errors(got: np.ndarray, want: np.ndarray, empty_value: float = -math.inf
               ) -> np.ndarray:
    """``lse_error`` of every element: 0 or inf where ``want`` is empty, inf where ``got``
    is NaN or not finite where ``want`` is."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if math.isinf(empty_value):
        empty = np.isneginf(want)
        empty_ok = np.isneginf(got)
    else:  # a finite sentinel, possibly rounded to float32 on the way
        empty = np.isneginf(want) | np.isclose(want, empty_value, rtol=1e-6, atol=0.0)
        empty_ok = np.isclose(got, empty_value, rtol=1e-6, atol=0.0)
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - want) / np.maximum(1.0, np.abs(np.where(empty, 0.0, want)))
    errors = np.where(empty, np.where(empty_ok, 0.0, math.inf),
                      np.where(np.isfinite(diff), diff, math.inf))
    return np.where(np.isnan(got), math.inf, errors)


def wrong_rows_heads(errors: np.ndarray, budget: float) -> tuple[str, str]:
    """Which query rows and heads of a ``(rows, heads[, dim])`` error array are past the
    budget (``[1] of 3``, ``all 8``; empty when none): the pattern one cause leaves (a wrong
    head mapping: every other head; a bad row: one row). Failures group by the heads."""
    bad = errors > budget
    if not bad.any():
        return "", ""
    axes = tuple(range(2, bad.ndim))
    per_row_head = bad.any(axis=axes) if axes else bad
    return (_listed(np.flatnonzero(per_row_head.any(axis=1)), bad.shape[0]),
            _listed(np.flatnonzero(per_row_head.any(axis=0)), bad.shape[1]))


def _listed(indices: np.ndarray, total: int) -> str:
    if len(indices) == total:
        return f"all {total}"
    shown = ", ".join(map(str, indices[:8].tolist())) + (", ..." if len(indices) > 8 else "")
    return f"[{shown}] of {total}"


def score_errors(q: np.ndarray, keys_per_row: list[np.ndarray], sm_scale: float,
                 scores_per_row: list[np.ndarray], soft_cap: float | None = None
                 ) -> list[np.ndarray]:
    """Per row, ``(num_qo_heads, n)``: how far float32 arithmetic alone may move each score
    the softmax sees (``scores_per_row``: capped and biased). Two parts: the dot product's
    accumulation, ``ROUNDING_MARGIN * sqrt(d) * u * sum_i |q_i k_ji| * sm_scale`` (times the
    cap's slope ``1 - tanh^2`` under a soft-cap), and holding the score in float32 (one
    spacing at its size).

    One model for both floors (``lse_rounding``, ``output_rounding``). The ratio rule's
    low-precision oracle can be lucky in its summation order where a kernel is not: scores of
    ~1e4 from terms of ~1e6 at head_dim 144, and scores of ~-1e5 at head_dim 16 where the
    accumulation moves a score by 12 spacings (both found by ``explore``).
    """
    d = q.shape[-1]
    errors = []
    for b, (keys, scores) in enumerate(zip(keys_per_row, scores_per_row, strict=True)):
        magnitude = head_dots(np.abs(q[b]), np.abs(keys)) * sm_scale
        accumulated = ROUNDING_MARGIN * math.sqrt(d) * UNIT_ROUNDOFF_F32 * magnitude
        if soft_cap is not None:
            raw = head_dots(q[b], keys) * sm_scale
            accumulated = accumulated * (1.0 - np.tanh(raw / soft_cap) ** 2)
        held = np.spacing(np.abs(scores).astype(np.float32)).astype(np.float64)
        errors.append(accumulated + held)
    return errors


def head_dots(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``(heads, n)``: each query head of ``q`` ``(heads, d)`` against the keys of its KV
    head, ``keys`` ``(n, kv_heads, d)`` (query head h reads KV head ``h // group``).

    The keys are never copied per query head: 128 query heads over 8192 tokens made a
    gigabyte per row, most of a served-model case's host time."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    group = heads // kv_heads
    if group == 1:
        return np.einsum("hd,nhd->hn", q, keys)
    if kv_heads == 1:  # MQA, an MLA latent: one matrix product
        return q @ keys[:, 0].T
    return np.einsum("kgd,nkd->kgn", q.reshape(kv_heads, group, -1), keys).reshape(heads, -1)


CHUNK_ELEMENTS = 1 << 24  # a per-head temporary of at most this many float64s at a time


def softmax_weights(scores: np.ndarray, sink: np.ndarray | None) -> np.ndarray:
    """``(heads, n)`` softmax weights of one row's scores, a sink logit per head counted in
    the denominator."""
    with np.errstate(invalid="ignore"):
        top = scores.max(axis=1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, np.asarray(sink, np.float64)[:, None])
        weights = np.exp(scores - top)
        total = weights.sum(axis=1, keepdims=True)
        if sink is not None:
            total = total + np.exp(np.asarray(sink, np.float64)[:, None] - top)
    return weights / total


def score_rounding(errors: list[np.ndarray], num_qo_heads: int) -> np.ndarray:
    """``(batch, num_qo_heads)``: the largest score error of each row (0 for an empty row)."""
    bound = np.zeros((len(errors), num_qo_heads))
    for b, row in enumerate(errors):
        if row.shape[1]:
            bound[b] = row.max(axis=1)
    return bound


def lse_rounding(score_error: np.ndarray, lse: np.ndarray) -> float:
    """The LSE floor, in the measure of ``lse_error``: a row's LSE moves by at most its
    scores' error."""
    live = np.isfinite(lse)
    if not live.any():
        return 0.0
    return float((score_error[live] / np.maximum(1.0, np.abs(lse[live]))).max())


def score_error_bound(errors: list[np.ndarray], scores_per_row: list[np.ndarray],
                      values_per_row: list[np.ndarray], out: np.ndarray,
                      sink: np.ndarray | None = None) -> np.ndarray:
    """``(batch, num_qo_heads)``: how far the score errors (``score_errors``) alone may move
    each row's output, to first order: ``sum_j w_j err_j max_d |v_jd - out_d|``. Negligible
    for ordinary scores; where scores are ~1e4-1e5 and some lie within their own rounding
    of one another (``very-negative``, or ``large`` over an fp8 cache's few key values) it
    is the accuracy no float32 kernel can beat."""
    bound = np.zeros(out.shape[:2])
    for b, (scores, values) in enumerate(zip(scores_per_row, values_per_row, strict=True)):
        if scores.shape[1] == 0:
            continue
        weights = softmax_weights(scores, sink)
        spread = np.empty(scores.shape)  # (heads, n), a few heads at a time
        kv_head = np.arange(spread.shape[0]) // (spread.shape[0] // values.shape[1])
        step = max(1, CHUNK_ELEMENTS // values[:, 0].size)
        for h in range(0, spread.shape[0], step):
            spread[h:h + step] = np.abs(values[:, kv_head[h:h + step]] - out[b][None, h:h + step]
                                        ).max(axis=2).T
        bound[b] = (weights * errors[b] * spread).sum(axis=1)
    return bound


def output_rounding(score_bound: np.ndarray, out: np.ndarray, dtype: type) -> float:
    """The output floor, in the measure of ``output_error``: the score errors' effect
    (``score_error_bound``) and the output's own storage in the case's dtype (half a spacing
    at its size)."""
    scale = float(np.abs(out).max(initial=0.0)) or 1.0
    stored = float((np.spacing(np.abs(out).astype(dtype)).astype(np.float64) / 2).max(initial=0))
    return (float(score_bound.max(initial=0.0)) + stored) / scale


def trivial_answers(scores_per_row: list[np.ndarray], values_per_row: list[np.ndarray],
                    out: np.ndarray, sink: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Answers a broken kernel gives without attending properly: zeros, the plain mean of
    the kept values, and the output without each row's heaviest token. A budget that admits
    one of them where it is wrong cannot judge the case."""
    mean, dropped = np.zeros_like(out), np.array(out, dtype=np.float64)
    for b, (scores, values) in enumerate(zip(scores_per_row, values_per_row, strict=True)):
        n = scores.shape[1]
        if n == 0:
            continue
        group = out.shape[1] // values.shape[1]
        mean[b] = np.repeat(values.mean(axis=0), group, axis=0)
        if n == 1 and sink is None:
            dropped[b] = 0.0
            continue
        weights = softmax_weights(scores, sink)
        heaviest = weights.argmax(axis=1)
        heads = np.arange(weights.shape[0])
        w = weights[heads, heaviest][:, None]
        v = values[heaviest, heads // group]  # (heads, d)
        with np.errstate(over="ignore", invalid="ignore"):
            dropped[b] = (out[b] - w * v) / np.maximum(1.0 - w, np.finfo(np.float64).tiny)
    return {"zeros": np.zeros_like(out), "mean of V": mean, "one token dropped": dropped}


def admitted_answers(budget: float, floor: float, trivial: dict[str, np.ndarray],
                     out: np.ndarray) -> dict[str, float]:
    """The trivial answers that are wrong (further than ``floor`` from the oracle) and yet
    within ``budget``, with their errors."""
    errors = {name: output_error(answer, out) for name, answer in trivial.items()}
    return {name: e for name, e in errors.items() if floor < e <= budget}
