"""The inputs of the variants a case may carry, drawn from its seed: an fp8 cache's codes
and scales, several query tokens with their draft masks, and the score modifiers.

Each draws from a stream of its own, so adding a variant to a case changes no other value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from conformance.dtypes import dtype_name, fp8_max, fp8_smallest_normal, numpy_dtype, quantize
from conformance.references import alibi_slopes, tree_visibility
from conformance.spec import Case

if TYPE_CHECKING:
    from conformance.materialise import LogicalKV

GARBAGE_SCALE = 16.0  # a per-token scale where nothing is read: 16x its head's own
SPREAD = 1000.0  # kv_scaling "spread": the last KV head's values are this much the first's


@dataclass(frozen=True)
class Quantization:
    """How a cache is stored: fp8 codes in ``dtype``, scales laid out as ``mode``.

    ``k_head``/``v_head`` ``(num_kv_heads,)`` are the tensor's scales (all equal per-tensor,
    one per head per-head) and, per-token, each head's fit: what new tokens are quantized
    with. ``k_fill``/``v_fill`` are the scales garbage is quantized at (per-token: also the
    scale of a slot nothing reads, ``GARBAGE_SCALE`` times the head's); they stay when the
    scales are rescaled, so that a rescaled cache holds the very same codes."""

    dtype: str
    mode: str
    scaling: str
    k_head: np.ndarray
    v_head: np.ndarray
    jitter: float  # where in [0.8, 1) of the format's maximum a fit scale maps the largest
    k_fill: np.ndarray
    v_fill: np.ndarray

    def scales(self, values: np.ndarray, head: np.ndarray) -> np.ndarray:
        """``(n, num_kv_heads)`` scales for values ``(n, num_kv_heads, d)``: per-token, each
        token's own fit; else the head's."""
        if self.mode != "per-token":
            return np.broadcast_to(head, values.shape[:2]).astype(np.float32)
        return fit_scales(np.abs(values).max(axis=2), self.dtype, self.scaling, self.jitter)

    def store(self, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
        return quantize(values, scales[..., None], self.dtype)

    def repeated(self, g: int) -> Quantization:
        return replace(self, k_head=np.repeat(self.k_head, g), v_head=np.repeat(self.v_head, g),
                       k_fill=np.repeat(self.k_fill, g), v_fill=np.repeat(self.v_fill, g))


def fit_scales(amax: np.ndarray, kv_dtype: str, scaling: str, jitter: float) -> np.ndarray:
    """Scales that map ``amax`` to ``jitter`` of the format's maximum (``fit``); a quarter of
    that (``saturate``); or to ``jitter`` of the smallest normal (``subnormal``)."""
    amax = np.where(amax > 0, amax, 1.0).astype(np.float64)
    if scaling == "subnormal":
        scales = amax / (jitter * fp8_smallest_normal(kv_dtype))
    else:
        scales = amax / (jitter * fp8_max(kv_dtype))
        if scaling == "saturate":
            scales = scales / 4.0
    return scales.astype(np.float32)




def stored(logical: LogicalKV, kv_dtype: np.dtype, q_dtype: np.dtype) -> LogicalKV:
    """Float values of a logical cache in the dtypes it stores: cast, or quantized with its
    quantization's scales (and the query with its ``q_scale``)."""
    quant = logical.quantization
    if logical.q_scale is not None:
        q = quantize(logical.q, logical.q_scale, dtype_name(q_dtype))
    else:
        q = logical.q.astype(q_dtype)
    if logical.kv_lora_rank is not None:  # MLA: the values are the stored keys' latents
        keys = tuple(k.astype(kv_dtype) for k in logical.keys)
        return replace(logical, q=q, keys=keys,
                       values=tuple(k[..., :logical.kv_lora_rank] for k in keys))
    if quant is None:
        return replace(logical, q=q, keys=tuple(k.astype(kv_dtype) for k in logical.keys),
                       values=tuple(v.astype(kv_dtype) for v in logical.values))
    k_scales = tuple(quant.scales(k, quant.k_head) for k in logical.keys)
    v_scales = tuple(quant.scales(v, quant.v_head) for v in logical.values)
    return replace(logical, q=q, k_scales=k_scales, v_scales=v_scales,
                   keys=tuple(quant.store(k, s) for k, s in zip(logical.keys, k_scales,
                                                                  strict=True)),
                   values=tuple(quant.store(v, s) for v, s in zip(logical.values, v_scales,
                                                                  strict=True)))



DRAFT_SCORE = 6.0  # the scaled score every query token of a sequence gives its drafts
DRAFT_VALUE = 3.0  # magnitude of a draft's value entries (signs drawn per draft)


def separate_drafts(case: Case, q: np.ndarray, keys: list[np.ndarray],
                    values: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Inputs that tell draft masks apart: every query token of a sequence scores each of
    its drafts about ``DRAFT_SCORE`` (a shared direction per KV head in the queries and the
    draft keys) and each draft's value is a vector of +-``DRAFT_VALUE`` of its own, so a
    query token that attends a draft its mask forbids (or misses one it may see) moves its
    output by ~1, far past every budget; the context keeps ~a fifth of the weight, so a
    wrong context is seen too. Drawn from a stream of their own; returns the new queries."""
    rng = np.random.default_rng([case.seed, 21])
    hkv, d, g = case.num_kv_heads, case.head_dim, case.group_size
    direction = rng.standard_normal((case.batch, hkv, d))
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    along = math.sqrt(d) / 2
    q = q + along * np.repeat(direction, g, axis=1)[rows]
    for b, (n, query_len) in enumerate(zip(case.context_lens, case.query_lens, strict=True)):
        first = n - query_len
        noise = 0.3 * rng.standard_normal((query_len, hkv, d))
        keys[b][first:] = DRAFT_SCORE / (along * case.scale) * direction[b] + noise
        signs = np.where(rng.random((query_len, hkv, d)) < 0.5, -1.0, 1.0)
        values[b][first:] = DRAFT_VALUE * signs
    return q


def draft_masks(case: Case) -> dict:
    """The case's query lengths and, for masks given as matrices, each sequence's draft
    visibility (a tree's parents drawn from a stream of their own)."""
    if case.query_lens is None:
        return {}
    if case.mask == "causal":
        return {"query_lens": case.query_lens}
    rng = np.random.default_rng([case.seed, 20])
    masks = []
    for n in case.query_lens:
        if case.mask == "all":
            masks.append(np.ones((n, n), dtype=bool))
            continue
        parents = np.arange(n) - 1 if case.mask == "chain" else np.array(
            [int(rng.integers(-1, i)) if i else -1 for i in range(n)])
        masks.append(tree_visibility(parents))
    return {"query_lens": case.query_lens, "draft_masks": tuple(masks)}


def score_modifiers(case: Case) -> dict:
    """The case's soft-cap, sink logits and ALiBi slopes, as the problem holds them; drawn
    sink logits come from a stream of their own, so they change no other value of a case."""
    hq = case.num_qo_heads
    sink_logits = None
    if isinstance(case.sink_logits, tuple):
        sink_logits = np.asarray(case.sink_logits)
    elif case.sink_logits == "minus-inf":
        sink_logits = np.full(hq, -np.inf)
    elif case.sink_logits is not None:
        draw = np.random.default_rng([case.seed, 19]).standard_normal(hq)
        sink_logits = 2.0 * draw if case.sink_logits == "normal" else 12.0 + 0.5 * draw
    slopes = None
    if case.alibi:
        slopes = alibi_slopes(hq) if case.alibi is True else np.asarray(case.alibi)
    return {"soft_cap": case.soft_cap,
            "sink_logits": None if sink_logits is None else sink_logits.astype(np.float32),
            "alibi_slopes": None if slopes is None else slopes.astype(np.float32)}


def quantize_case(case: Case, logical: LogicalKV, rng: np.random.Generator) -> LogicalKV:
    """The case's float values stored as its fp8 codes, with scales drawn as it says; the
    draws come after every value, so quantizing changes no value the case holds."""
    quantization, q_scale = None, None
    if case.kv_dtype is not None:
        jitter = float(rng.uniform(0.8, 1.0))

        def head_scale(parts: list[np.ndarray]) -> np.ndarray:
            """Each head's fit (per-tensor: the tensor's); per-token, what stands for it."""
            drawn = [np.abs(p).max(axis=(0, 2)) for p in parts if p.size]
            amax = np.max(drawn, axis=0) if drawn else np.ones(case.num_kv_heads)
            if case.kv_scale == "per-tensor":
                amax = np.full_like(amax, amax.max())
            return fit_scales(amax, case.kv_dtype, case.kv_scaling, jitter)

        k_head, v_head = head_scale(list(logical.keys)), head_scale(list(logical.values))
        fill = np.float32(GARBAGE_SCALE if case.kv_scale == "per-token" else 1.0)
        quantization = Quantization(case.kv_dtype, case.kv_scale, case.kv_scaling, k_head,
                                    v_head, jitter, fill * k_head, fill * v_head)
    if case.q_dtype is not None:
        q_scale = fit_scales(np.abs(logical.q).max(initial=0.0), case.q_dtype, "fit",
                             float(rng.uniform(0.8, 1.0))).reshape(1)
    out_dtype = numpy_dtype(case.dtype) if case.q_dtype is not None else None
    return stored(replace(logical, quantization=quantization, q_scale=q_scale,
                          out_dtype=out_dtype),
                  np.dtype(numpy_dtype(case.kv_dtype or case.dtype)),
                  np.dtype(numpy_dtype(case.q_dtype or case.dtype)))

