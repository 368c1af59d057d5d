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
from references import alibi_slopes, kept_tokens, tree_visibility

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

    q: np.ndarray  # (tokens, num_qo_heads, head_dim), case dtype: tokens = batch unless
    # query_lens says more
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
    # Several query tokens per sequence: q packs query_lens[b] rows for sequence b, its last
    # positions (a context length counts its drafts). draft_mask (tokens, max query_len) bool:
    # row r sees draft j of its sequence; None: causal (draft t sees drafts 0..t).
    query_lens: np.ndarray | None = None
    draft_mask: np.ndarray | None = None
    # Multi-head latent attention (``kv_lora_rank`` set): one KV head, the latent cache. Each
    # token's key is [latent (kv_lora_rank) | rotary part (rope_dim)] in k_pages and its value
    # is its latent, stored once: v_pages is the view k_pages[..., :kv_lora_rank].
    kv_lora_rank: int | None = None

    def __getstate__(self) -> dict:
        """An MLA problem travels without its value view (it is rebuilt from k_pages)."""
        state = dict(self.__dict__)
        if self.kv_lora_rank is not None:
            state["v_pages"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        if state.get("kv_lora_rank") is not None and state["v_pages"] is None:
            state["v_pages"] = state["k_pages"][..., :state["kv_lora_rank"]]
        self.__dict__.update(state)

    @property
    def kind(self) -> str:
        """``gqa`` or ``mla`` (conformance.spec.KINDS)."""
        return "gqa" if self.kv_lora_rank is None else "mla"

    @property
    def head_dim_v(self) -> int:
        """The width of a value and of the output (the latent's, for MLA)."""
        return self.v_pages.shape[3]

    @property
    def rope_dim(self) -> int:
        """An MLA problem's rotary key part: ``head_dim - kv_lora_rank`` (0 for GQA)."""
        return self.head_dim - self.head_dim_v

    @property
    def ckv_pages(self) -> np.ndarray:
        """``(num_pages, page_size, kv_lora_rank)``: the latent cache of an MLA problem."""
        return self.k_pages[:, :, 0, :self.head_dim_v]

    @property
    def kpe_pages(self) -> np.ndarray:
        """``(num_pages, page_size, rope_dim)``: the rotary key cache of an MLA problem."""
        return self.k_pages[:, :, 0, self.head_dim_v:]

    @property
    def q_nope(self) -> np.ndarray:
        """``(tokens, num_qo_heads, kv_lora_rank)``: the absorbed query against the latent."""
        return self.q[..., :self.head_dim_v]

    @property
    def q_pe(self) -> np.ndarray:
        """``(tokens, num_qo_heads, rope_dim)``: the query's rotary part."""
        return self.q[..., self.head_dim_v:]

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    @property
    def tokens(self) -> int:
        """Query tokens (rows of q, of the output and of the LSE)."""
        return self.q.shape[0]

    @property
    def row_lens(self) -> np.ndarray:
        """Query tokens per sequence (ones for one-token decode)."""
        if self.query_lens is None:
            return np.ones(self.batch, dtype=np.int64)
        return self.query_lens.astype(np.int64)

    @property
    def row_sequence(self) -> np.ndarray:
        """``(tokens,)``: the sequence of each query row."""
        return np.repeat(np.arange(self.batch), self.row_lens)

    @property
    def query_positions(self) -> np.ndarray:
        """``(tokens,)``: the context position of each query row."""
        lens = self.row_lens
        draft = np.arange(self.tokens) - np.repeat(self.query_start[:-1], lens)
        return np.repeat(self.context_lens.astype(np.int64) - lens, lens) + draft

    @property
    def query_start(self) -> np.ndarray:
        """``(batch + 1,)`` int32: sequence b's query rows are ``query_start[b]`` up to
        ``query_start[b + 1]`` (the index pointer of the packed layout)."""
        return np.concatenate([[0], np.cumsum(self.row_lens)]).astype(np.int32)

    def padded_rows(self) -> np.ndarray:
        """``(batch, longest query_len)``: the packed row of each sequence's draft t, -1
        past its length (for adapters whose kernel takes queries padded per sequence)."""
        lens = self.row_lens
        draft = np.arange(int(lens.max(initial=1)))
        rows = self.query_start[:-1, None] + draft[None, :]
        return np.where(draft[None, :] < lens[:, None], rows, -1)

    def rows_of(self, sequences: list[int]) -> list[int]:
        """The query rows of the given sequences, in their order."""
        starts = self.query_start
        return [row for b in sequences for row in range(int(starts[b]), int(starts[b + 1]))]

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
        """Positions that query row ``row`` attends to."""
        b = int(self.row_sequence[row])
        query_len = int(self.row_lens[b])
        draft = row - int(self.query_start[b])
        seen = None if self.draft_mask is None else self.draft_mask[row, :query_len]
        return kept_tokens(int(self.context_lens[b]), self.window, self.sinks, query_len, draft,
                           seen)

    def arrays(self) -> dict[str, np.ndarray]:
        arrays = {"q": self.q, "k_pages": self.k_pages, "v_pages": self.v_pages,
                  "block_table": self.block_table, "context_lens": self.context_lens}
        if self.kv_lora_rank is not None:
            del arrays["v_pages"]  # a view of k_pages
        for name in ("k_scale", "v_scale", "q_scale", "sink_logits", "alibi_slopes",
                     "query_lens", "draft_mask"):
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

    q: np.ndarray  # (tokens, num_qo_heads, head_dim): the case dtype, or fp8 codes
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
    # Several query tokens per sequence, as in Problem: q packs query_lens[b] rows for
    # sequence b; draft_masks[b] its (query_len, query_len) visibility, or None (causal).
    query_lens: tuple[int, ...] | None = None
    draft_masks: tuple[np.ndarray, ...] | None = None
    # MLA: keys are [latent | rotary part], one head; values are the latent views of the keys
    kv_lora_rank: int | None = None

    @property
    def context_lens(self) -> list[int]:
        return [k.shape[0] for k in self.keys]

    @property
    def row_lens(self) -> list[int]:
        return list(self.query_lens) if self.query_lens is not None else [1] * len(self.keys)

    def query_rows(self, b: int) -> slice:
        """Sequence ``b``'s rows of ``q``."""
        lens = self.row_lens
        start = sum(lens[:b])
        return slice(start, start + lens[b])

    def attended(self, b: int) -> np.ndarray:
        """The positions of sequence ``b`` that any of its query tokens attends to."""
        n, query_len = self.context_lens[b], self.row_lens[b]
        masks = self.draft_masks[b] if self.draft_masks is not None else None
        return np.unique(np.concatenate([kept_tokens(
            n, self.window, self.sinks, query_len, t, None if masks is None else masks[t])
            for t in range(query_len)])).astype(np.int64)

    def per_token(self, lengths: list[int] | None = None) -> LogicalKV:
        """One sequence per query row, holding the first ``lengths[r]`` tokens (all by
        default) of row ``r``'s sequence: one-token decode of each draft."""
        if self.query_lens is None and lengths is None:
            return self
        sequence = [b for b, n in enumerate(self.row_lens) for _ in range(n)]
        lengths = lengths or [self.context_lens[b] for b in sequence]
        return replace(self, query_lens=None, draft_masks=None, **self._per_sequence(
            lambda entries: tuple(entries[b][:n] for b, n in zip(sequence, lengths,
                                                                 strict=True))))

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
        for b, n in enumerate(lens):
            used = np.zeros(math.ceil(n / page_size), dtype=bool)
            used[self.attended(b) // page_size] = True
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
        if self.kv_lora_rank is not None:  # MLA: the values are the keys' latents, stored once
            v_pages = k_pages[..., :self.kv_lora_rank]
        k_scale = v_scale = None
        if quant is not None and quant.mode == "per-token":
            k_scale = np.empty(shape[:3], np.float32)
            v_scale = np.empty(shape[:3], np.float32)
            k_scale[...] = np.nan if masked == "nan" else quant.k_fill
            v_scale[...] = np.nan if masked == "nan" else quant.v_fill
        elif quant is not None:
            k_scale = quant.k_head[:1 if quant.mode == "per-tensor" else None].copy()
            v_scale = quant.v_head[:1 if quant.mode == "per-tensor" else None].copy()
        for b in range(len(lens)):
            positions = self.attended(b)
            pages, slots = table[b, positions // page_size], positions % page_size
            k_pages[pages, slots] = self.keys[b][positions]
            if self.kv_lora_rank is None:
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
                       sink_logits=_copy(self.sink_logits), alibi_slopes=_copy(self.alibi_slopes),
                       kv_lora_rank=self.kv_lora_rank, **self._query_arrays())

    def _query_arrays(self) -> dict:
        """``query_lens`` and ``draft_mask`` as the problem holds them."""
        if self.query_lens is None:
            return {}
        arrays = {"query_lens": np.asarray(self.query_lens, dtype=np.int32)}
        if self.draft_masks is not None:
            mask = np.zeros((sum(self.query_lens), max(self.query_lens)), dtype=bool)
            row = 0
            for seen in self.draft_masks:
                mask[row:row + len(seen), :len(seen)] = seen
                row += len(seen)
            arrays["draft_mask"] = mask
        return arrays

    def _per_sequence(self, pick) -> dict:
        """The per-sequence fields, each sequence's entry replaced by ``pick(entries)``."""
        fields = {"keys": self.keys, "values": self.values}
        if self.quantization is not None:
            fields |= {"k_scales": self.k_scales, "v_scales": self.v_scales}
        return {name: pick(entries) for name, entries in fields.items()}

    def select(self, rows: list[int]) -> LogicalKV:
        """The same sequences in another order or subset (with their query rows)."""
        queries = {}
        if self.query_lens is not None:
            queries["query_lens"] = tuple(self.query_lens[r] for r in rows)
        if self.draft_masks is not None:
            queries["draft_masks"] = tuple(self.draft_masks[r] for r in rows)
        q = np.concatenate([self.q[self.query_rows(r)] for r in rows]) if rows else self.q[:0]
        return replace(self, q=q, **queries,
                       **self._per_sequence(lambda entries: tuple(entries[r] for r in rows)))

    def take(self, tokens: list[np.ndarray]) -> LogicalKV:
        """Of each sequence, only the given token positions (scales travel with them); one
        query token per sequence (``per_token`` first)."""
        if self.query_lens is not None:
            raise ValueError("take: several query tokens per sequence; per_token() first")
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
        n = max(n, 1) if self.query_lens is not None else n  # a query token is a position
        keys = rng.standard_normal((n, *self.keys[0].shape[1:]))
        values = rng.standard_normal((n, *self.values[0].shape[1:]))
        queries = {"query_lens": None if self.query_lens is None else (1,),
                   "draft_masks": None if self.draft_masks is None else (np.ones((1, 1), bool),)}
        return stored(replace(self, q=q[None], keys=(keys,), values=(values,), **queries),
                      self.keys[0].dtype, self.q.dtype)

    @classmethod
    def concat(cls, parts: list[LogicalKV]) -> LogicalKV:
        """Sequences of several logical caches stored alike, one batch."""
        first = parts[0]
        queries = {}
        if any(p.query_lens is not None for p in parts):
            queries["query_lens"] = tuple(n for p in parts for n in p.row_lens)
        if any(p.draft_masks is not None for p in parts):
            queries["draft_masks"] = tuple(
                m for p in parts for m in (p.draft_masks if p.draft_masks is not None else
                                           [np.tri(n, dtype=bool) for n in p.row_lens]))
        return replace(first, q=np.concatenate([p.q for p in parts]), **queries, **{
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
    q = rng.standard_normal((case.tokens, hq, d))
    rows = np.repeat(np.arange(case.batch), case.query_lens or 1)  # each query row's sequence
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
        grouped = np.repeat(direction, g, axis=1)[rows]  # (tokens, hq, d)
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
    if case.query_lens is not None and case.distribution == "normal":
        q = separate_drafts(case, q, keys, values, rows)
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
                        window=case.window, sinks=case.sinks, kv_lora_rank=case.kv_lora_rank,
                        pool_elements=case.pool_pages * case.page_size * hkv * d,
                        **score_modifiers(case), **draft_masks(case))
    if (case.kv_dtype is None and case.q_dtype is None) or not quantized:
        return stored(logical, dtype, dtype)
    return quantize_case(case, logical, rng)


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
    out = np.full((*problem.q.shape[:2], problem.head_dim_v), poison, dtype=problem.dtype)
    lse = np.full(problem.q.shape[:2], poison, dtype=np.float32)
    return out, lse
