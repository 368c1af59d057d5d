"""Materialising a case into canonical NumPy arrays, laid out adversarially.

Logical values (what each sequence holds) are drawn from the case's seed; the layout (which
physical page holds what) from a separate layout seed, so the checks can lay the same values
out again and expect the same answer. Every slot a kernel must not read holds finite garbage
chosen to change the answer far beyond any budget if it is attended to (large scores, values
of +-1000); the ``poison/masked-nan`` check lays the same problem out with NaN there instead,
so a kernel that reads masked slots and zeroes their weight (0 x NaN) is one finding, not a
failure of every check.

A quantized cache (``kv_dtype``) stores fp8 codes with scales; the harness quantizes, and the
oracle reads exactly what the codes and scales denote (``code * scale``), so a correct kernel
is held to the budget of the query/output dtype, not to a quantization tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from conformance.dtypes import (
    dtype_name,
    fp8_max,
    fp8_smallest_normal,
    numpy_dtype,
    quantize,
)
from conformance.spec import GARBAGE_CHUNK, Case  # at most this many garbage elements drawn
from references import alibi_slopes, kept_tokens

# Output poisons: a first run sees NaN, a second run a finite value no real output takes.
POISONS = (float("nan"), -12288.0)
# What fills the slots a kernel must not read: "garbage" (finite, adversarial) or "nan".
MASKED_FILLS = ("garbage", "nan")
GARBAGE_SCORE = 20.0  # standard deviation of a garbage key's score against a normal query
GARBAGE_VALUE = 1000.0  # magnitude of a garbage value (an fp8 cache saturates it)
GARBAGE_SCALE = 16.0  # a per-token scale where nothing is read: 16x its head's own
SPREAD = 1000.0  # kv_scaling "spread": the last KV head's values are this much the first's


@dataclass(frozen=True)
class Problem:
    """The canonical decode problem every adapter receives (docs/design.md §3)."""

    q: np.ndarray  # (batch, num_qo_heads, head_dim), case dtype
    k_pages: np.ndarray  # (num_pages, page_size, num_kv_heads, head_dim), case dtype
    v_pages: np.ndarray  # same shape as k_pages
    block_table: np.ndarray  # (batch, max_blocks) int32, -1 where unallocated
    context_lens: np.ndarray  # (batch,) int32
    sm_scale: float
    window: int | None = None
    sinks: int = 0
    # A quantized cache: k_pages and v_pages hold fp8 codes (ml_dtypes) read as code * scale,
    # the scales float32 in the layout of ``kv_scale`` (conformance.dtypes.SCALE_MODES).
    kv_scale: str | None = None
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None
    # An fp8 query: q holds codes read as q * q_scale (shape (1,)); the output is out_dtype.
    q_scale: np.ndarray | None = None
    out_dtype: type | None = None
    # What the model does to the scores: scaled scores s become soft_cap * tanh(s / soft_cap),
    # plus alibi_slopes[h] * (key position - (context_len - 1)); a sink logit z_h adds
    # exp(z_h) to the softmax denominator. Slopes and sink logits: (num_qo_heads,) float32.
    soft_cap: float | None = None
    sink_logits: np.ndarray | None = None
    alibi_slopes: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def num_qo_heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def dtype(self) -> np.dtype:
        """The output's dtype: the query's, unless the query is quantized."""
        return np.dtype(self.out_dtype) if self.out_dtype is not None else self.q.dtype

    def kept(self, row: int) -> np.ndarray:
        """Positions of row ``row`` that take part in attention."""
        return kept_tokens(int(self.context_lens[row]), self.window, self.sinks)

    def arrays(self) -> dict[str, np.ndarray]:
        arrays = {"q": self.q, "k_pages": self.k_pages, "v_pages": self.v_pages,
                  "block_table": self.block_table, "context_lens": self.context_lens}
        for name in ("k_scale", "v_scale", "q_scale", "sink_logits", "alibi_slopes"):
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)
        return arrays


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


@dataclass(frozen=True)
class LogicalKV:
    """What each sequence holds, independent of paging: the values a layout places."""

    q: np.ndarray  # (batch, num_qo_heads, head_dim): the case dtype, or fp8 codes
    keys: tuple[np.ndarray, ...]  # per sequence (context_len, num_kv_heads, head_dim), stored
    values: tuple[np.ndarray, ...]
    sm_scale: float
    window: int | None = None
    sinks: int = 0
    # A quantized cache: how, and per sequence the (context_len, num_kv_heads) float32 scale
    # of every stored token, which travels with it through every re-layout.
    quantization: Quantization | None = None
    k_scales: tuple[np.ndarray, ...] = ()
    v_scales: tuple[np.ndarray, ...] = ()
    q_scale: np.ndarray | None = None  # an fp8 query's (1,) scale
    out_dtype: type | None = None  # with an fp8 query: the output's dtype
    soft_cap: float | None = None  # the score modifiers, as in Problem
    sink_logits: np.ndarray | None = None
    alibi_slopes: np.ndarray | None = None
    # Every layout's pool holds at least this many elements (the case's ``pool_pages`` at its
    # own page geometry): the page count follows the layout's page size and heads, so flat
    # offsets past an index width stay past it and no re-layout grows the memory.
    pool_elements: int = 0

    @property
    def context_lens(self) -> list[int]:
        return [k.shape[0] for k in self.keys]

    def lay_out(self, page_size: int, layout_seed: int, table_padding: int = 3,
                shared_pages: int = 0, masked: str = "garbage") -> Problem:
        """Page the sequences into a shuffled pool larger than needed.

        Physical page 0 is never used (a ``-1`` read as page 0 meets garbage); pages that the
        window evicts entirely are ``-1`` in the table; the first ``shared_pages`` pages of
        every long-enough sequence are the first sequence's physical pages. Every slot no
        sequence reads holds ``masked``: garbage or NaN; the layout is the same for both. With
        ``pool_elements`` past what the sequences need, the pool is that large and the
        sequences' pages (with the usual spares between them) are its last ones: every page id
        they read lies within their own span of the pool's end.
        """
        rng = np.random.default_rng(layout_seed)
        lens = self.context_lens
        num_kv_heads, head_dim = self.keys[0].shape[1], self.q.shape[2]
        logical_pages = [math.ceil(n / page_size) for n in lens]
        max_blocks = max(logical_pages, default=0) + table_padding
        table = np.full((len(lens), max(max_blocks, 1)), -1, dtype=np.int32)
        needed: list[list[bool]] = []
        for n in lens:
            used = np.zeros(math.ceil(n / page_size), dtype=bool)
            used[kept_tokens(n, self.window, self.sinks) // page_size] = True
            needed.append(used.tolist())
        sharing = shared_pages if len(lens) > 1 and lens[0] >= shared_pages * page_size else 0
        owners: list[tuple[int, int]] = []
        for b, used in enumerate(needed):
            for j, is_used in enumerate(used):
                shared = sharing and b > 0 and j < sharing and lens[b] >= sharing * page_size
                if is_used and not (shared and needed[0][j]):
                    owners.append((b, j))
        num_pages = len(owners) + max(2, len(owners) // 2) + 1
        first = 1  # the first page the sequences may take
        pool_pages = -(-self.pool_elements // (page_size * num_kv_heads * head_dim))
        if pool_pages > num_pages:
            first, num_pages = pool_pages - num_pages + 1, pool_pages
        physical = rng.permutation(np.arange(first, num_pages))[: len(owners)]
        for (b, j), page in zip(owners, physical, strict=True):
            table[b, j] = page
        for b in range(1, len(lens)):
            if sharing and lens[b] >= sharing * page_size:
                for j in range(sharing):
                    if needed[b][j] and needed[0][j]:
                        table[b, j] = table[0, j]
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        quant = self.quantization
        if masked not in MASKED_FILLS:
            raise ValueError(f"masked fill {masked!r}; known: {', '.join(MASKED_FILLS)}")
        if masked == "nan":
            k_pages, v_pages = _nan_pages(shape, self.keys[0].dtype)
        else:
            k_pages, v_pages = _garbage(rng, shape, self.keys[0].dtype,
                                        GARBAGE_SCORE / (math.sqrt(head_dim) * self.sm_scale),
                                        quant)
        k_scale = v_scale = None
        if quant is not None and quant.mode == "per-token":
            k_scale = np.empty(shape[:3], np.float32)
            v_scale = np.empty(shape[:3], np.float32)
            k_scale[...] = np.nan if masked == "nan" else quant.k_fill
            v_scale[...] = np.nan if masked == "nan" else quant.v_fill
        elif quant is not None:
            k_scale = quant.k_head[:1 if quant.mode == "per-tensor" else None].copy()
            v_scale = quant.v_head[:1 if quant.mode == "per-tensor" else None].copy()
        for b, n in enumerate(lens):
            positions = kept_tokens(n, self.window, self.sinks)
            pages, slots = table[b, positions // page_size], positions % page_size
            k_pages[pages, slots] = self.keys[b][positions]
            v_pages[pages, slots] = self.values[b][positions]
            if quant is not None and quant.mode == "per-token":
                k_scale[pages, slots] = self.k_scales[b][positions]
                v_scale[pages, slots] = self.v_scales[b][positions]
        return Problem(q=self.q.copy(), k_pages=k_pages, v_pages=v_pages, block_table=table,
                       context_lens=np.asarray(lens, dtype=np.int32), sm_scale=self.sm_scale,
                       window=self.window, sinks=self.sinks,
                       kv_scale=quant.mode if quant is not None else None, k_scale=k_scale,
                       v_scale=v_scale,
                       q_scale=None if self.q_scale is None else self.q_scale.copy(),
                       out_dtype=self.out_dtype, soft_cap=self.soft_cap,
                       sink_logits=_copy(self.sink_logits), alibi_slopes=_copy(self.alibi_slopes))

    def _per_sequence(self, pick) -> dict:
        """The per-sequence fields, each sequence's entry replaced by ``pick(entries)``."""
        fields = {"keys": self.keys, "values": self.values}
        if self.quantization is not None:
            fields |= {"k_scales": self.k_scales, "v_scales": self.v_scales}
        return {name: pick(entries) for name, entries in fields.items()}

    def select(self, rows: list[int]) -> LogicalKV:
        """The same sequences in another order or subset."""
        return replace(self, q=self.q[rows],
                       **self._per_sequence(lambda entries: tuple(entries[r] for r in rows)))

    def take(self, tokens: list[np.ndarray]) -> LogicalKV:
        """Of each sequence, only the given token positions (scales travel with them)."""
        return replace(self, **self._per_sequence(lambda entries: tuple(
            entry[t] for entry, t in zip(entries, tokens, strict=True))))

    def repeat_heads(self, g: int) -> LogicalKV:
        """Every KV head repeated ``g`` times: GQA as MHA, with the same scales per copy."""
        return replace(self, quantization=None if self.quantization is None else
                       self.quantization.repeated(g),
                       **self._per_sequence(lambda entries: tuple(
                           np.repeat(entry, g, axis=1) for entry in entries)))

    def rescaled(self, k_factor: float, v_factor: float) -> LogicalKV:
        """The same codes read with every K scale times ``k_factor`` and V scale times
        ``v_factor``, and the query divided by ``k_factor`` (its scale, if it has one): the
        scores stay and the output is ``v_factor`` times the old. Powers of two keep all of
        it exact (a 16-bit query short of its subnormals)."""
        quant = self.quantization
        if quant is None:
            raise ValueError("rescaled: the cache is not quantized")
        k, v = np.float32(k_factor), np.float32(v_factor)
        if self.q_scale is not None:
            query = {"q_scale": self.q_scale / k}
        else:
            query = {"q": (self.q.astype(np.float64) / k_factor).astype(self.q.dtype)}
        return replace(self, **query,
                       quantization=replace(quant, k_head=quant.k_head * k,
                                            v_head=quant.v_head * v),
                       k_scales=tuple(s * k for s in self.k_scales),
                       v_scales=tuple(s * v for s in self.v_scales))

    def fresh(self, rng: np.random.Generator, n: int) -> LogicalKV:
        """One new sequence of ``n`` standard-normal tokens (and query), stored as this one
        stores its own: in its dtype, or quantized with its scales."""
        q = rng.standard_normal(self.q.shape[1:])
        keys = rng.standard_normal((n, *self.keys[0].shape[1:]))
        values = rng.standard_normal((n, *self.keys[0].shape[1:]))
        return stored(replace(self, q=q[None], keys=(keys,), values=(values,)),
                      self.keys[0].dtype, self.q.dtype)

    @classmethod
    def concat(cls, parts: list[LogicalKV]) -> LogicalKV:
        """Sequences of several logical caches stored alike, one batch."""
        first = parts[0]
        return replace(first, q=np.concatenate([p.q for p in parts]), **{
            name: tuple(e for p in parts for e in p._per_sequence(lambda x: x)[name])
            for name in first._per_sequence(lambda x: x)})


def _copy(array: np.ndarray | None) -> np.ndarray | None:
    return None if array is None else array.copy()


def stored(logical: LogicalKV, kv_dtype: np.dtype, q_dtype: np.dtype) -> LogicalKV:
    """Float values of a logical cache in the dtypes it stores: cast, or quantized with its
    quantization's scales (and the query with its ``q_scale``)."""
    quant = logical.quantization
    if logical.q_scale is not None:
        q = quantize(logical.q, logical.q_scale, dtype_name(q_dtype))
    else:
        q = logical.q.astype(q_dtype)
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


def _nan_pages(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Pages of NaN; an e5m2 cache's keys hold +inf instead (the format has one, e4m3fn not)."""
    k_pages = np.full(shape, np.inf if dtype_name(dtype) == "float8_e5m2" else np.nan,
                      dtype=dtype)
    return k_pages, np.full(shape, np.nan, dtype=dtype)


def _garbage(rng: np.random.Generator, shape: tuple[int, ...], dtype: type, key_scale: float,
             quant: Quantization | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Garbage K (normal, scores of ~``GARBAGE_SCORE``) and V (+-``GARBAGE_VALUE``) pages;
    in a quantized cache, codes for them at the scale of a slot nothing reads (saturating).

    At most ``GARBAGE_CHUNK`` elements of each are drawn; a larger pool repeats them (a
    pool of 2^32 elements would take minutes to draw, and garbage needs no more variety than
    a wrong page meeting values far off the answer)."""
    pages = max(1, min(shape[0], GARBAGE_CHUNK // max(1, math.prod(shape[1:]))))
    drawn = (pages, *shape[1:])
    k_block = rng.standard_normal(drawn, dtype=np.float32) * np.float32(key_scale)
    v_block = np.where(rng.random(drawn) < 0.5, -1.0, 1.0) * GARBAGE_VALUE
    if quant is None:
        k_block, v_block = k_block.astype(dtype), v_block.astype(dtype)
    else:
        k_block = quantize(k_block, quant.k_fill[:, None], quant.dtype)
        v_block = quantize(v_block, quant.v_fill[:, None], quant.dtype)
    k_pages, v_pages = np.empty(shape, dtype=dtype), np.empty(shape, dtype=dtype)
    for start in range(0, shape[0], pages):
        rows = min(pages, shape[0] - start)
        k_pages[start:start + rows] = k_block[:rows]
        v_pages[start:start + rows] = v_block[:rows]
    return k_pages, v_pages


def logical_kv(case: Case, quantized: bool = True) -> LogicalKV:
    """Draw the values of a case from its seed, in the case's distribution; stored as the
    case stores them, or (``quantized=False``) in its query/output dtype, unquantized."""
    rng = np.random.default_rng(case.seed)
    dtype = numpy_dtype(case.dtype)
    hq, hkv, d, g = case.num_qo_heads, case.num_kv_heads, case.head_dim, case.group_size
    q = rng.standard_normal((case.batch, hq, d))
    keys = [rng.standard_normal((n, hkv, d), dtype=np.float32) for n in case.context_lens]
    values = [rng.standard_normal((n, hkv, d), dtype=np.float32) for n in case.context_lens]
    if case.distribution == "uniform":
        q[:] = 0.0
    elif case.distribution == "large":
        q *= 100.0  # |scores| ~ 1e4 at the default scale
        keys = [k * 100.0 for k in keys]
    elif case.distribution == "flat-positive":
        q[:] = 0.0
        values = [32.0 + 32.0 * rng.random((n, hkv, d), dtype=np.float32)
                  for n in case.context_lens]
    elif case.distribution == "constant-v":
        values = [np.broadcast_to(rng.standard_normal((1, hkv, d)), v.shape).copy()
                  for v in values]
    elif case.distribution in ("peaked", "very-negative"):
        direction = rng.standard_normal((case.batch, hkv, d))
        direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
        grouped = np.repeat(direction, g, axis=1)  # (batch, hq, d)
        if case.distribution == "peaked":
            q = grouped * math.sqrt(d) + 0.3 * q
            for b, n in enumerate(case.context_lens):
                kept = kept_tokens(n, case.window, case.sinks)
                if kept.size:
                    star = rng.choice(kept, size=hkv)
                    keys[b][star, np.arange(hkv)] = 30.0 / case.scale / math.sqrt(d) * \
                        direction[b]
        else:
            magnitude = math.sqrt(1e5 / case.scale)  # scores ~ -1e5
            q = magnitude * grouped + q
            keys = [-magnitude * direction[b] + k for b, k in enumerate(keys)]
    if case.shared_pages and case.context_lens[0] >= case.shared_pages * case.page_size:
        prefix = case.shared_pages * case.page_size
        for b in range(1, case.batch):
            if case.context_lens[b] >= prefix:
                keys[b][:prefix] = keys[0][:prefix]
                values[b][:prefix] = values[0][:prefix]
    if case.kv_dtype is not None and case.kv_scaling == "spread":
        # KV head h grows by SPREAD^(h/(heads-1)); its query heads shrink alike: scores stay
        growth = SPREAD ** (np.arange(hkv) / (hkv - 1))
        keys = [k * growth[:, None].astype(np.float32) for k in keys]
        values = [v * growth[:, None].astype(np.float32) for v in values]
        q = q / np.repeat(growth, g)[:, None]
    logical = LogicalKV(q=q, keys=tuple(keys), values=tuple(values), sm_scale=case.scale,
                        window=case.window, sinks=case.sinks,
                        pool_elements=case.pool_pages * case.page_size * hkv * d,
                        **score_modifiers(case))
    if (case.kv_dtype is None and case.q_dtype is None) or not quantized:
        return stored(logical, dtype, dtype)
    return quantize_case(case, logical, rng)


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


def canonical_layout_seed(case: Case) -> int:
    """Where the canonical problem's layout is drawn from (its values: ``case.seed``)."""
    return case.seed + 1


def materialise(case: Case, layout_seed: int | None = None, masked: str = "garbage",
                quantized: bool = True) -> Problem:
    """The canonical problem of a case, laid out from its seed (or another layout seed)."""
    seed = canonical_layout_seed(case) if layout_seed is None else layout_seed
    return logical_kv(case, quantized).lay_out(case.page_size, seed, case.table_padding,
                                               case.shared_pages, masked)


def poisoned_outputs(problem: Problem, poison: float) -> tuple[np.ndarray, np.ndarray]:
    """Output and LSE buffers pre-filled with a poison, for the backend to overwrite."""
    out = np.full(problem.q.shape, poison, dtype=problem.dtype)
    lse = np.full(problem.q.shape[:2], poison, dtype=np.float32)
    return out, lse
