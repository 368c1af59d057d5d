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

import copy
import math
from dataclasses import dataclass, replace

import numpy as np

from conformance.bulk import seal_tiling
from conformance.dtypes import numpy_dtype
from conformance.garbage import unread_pages
from conformance.problem import Problem
from conformance.references import kept_tokens
from conformance.spec import Case
from conformance.variants import (
    SPREAD,
    Quantization,
    draft_masks,
    quantize_case,
    score_modifiers,
    separate_drafts,
    stored,
)


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
        kept = [kept_tokens(n, self.window, self.sinks, query_len, t,
                            None if masks is None else masks[t]) for t in range(query_len)]
        if len(kept) == 1:  # ascending already; sorting 70000 positions per layout showed
            return kept[0].astype(np.int64, copy=False)
        return np.unique(np.concatenate(kept)).astype(np.int64)

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
        k_pages, v_pages = unread_pages(masked, rng, shape, self.keys[0].dtype,
                                        self.sm_scale, quant)
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
        written = table[table >= 0]  # the only pages that are not the garbage as filled
        seal_tiling(k_pages, written)
        seal_tiling(v_pages, written)
        if self.kv_lora_rank is not None:  # MLA: the values are the keys' latents, stored once
            v_pages = k_pages[..., :self.kv_lora_rank]
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



def logical_kv(case: Case, quantized: bool = True,
               drawn: tuple[LogicalKV, np.random.Generator] | None = None) -> LogicalKV:
    """The values of a case (``drawn_kv``, or ``drawn`` when already drawn) stored as the
    case stores them, or (``quantized=False``) in its query/output dtype, unquantized."""
    logical, rng = drawn or drawn_kv(case)
    dtype = numpy_dtype(case.dtype)
    if (case.kv_dtype is None and case.q_dtype is None) or not quantized:
        return stored(logical, dtype, dtype)
    return quantize_case(case, logical, copy.deepcopy(rng))  # ``drawn`` may serve again


def drawn_kv(case: Case) -> tuple[LogicalKV, np.random.Generator]:
    """Draw the values of a case from its seed, in the case's distribution, as floats; and
    the generator as the draws left it (a quantized case's scales come next)."""
    rng = np.random.default_rng(case.seed)
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
    return logical, rng



def canonical_layout_seed(case: Case) -> int:
    """Where the canonical problem's layout is drawn from (its values: ``case.seed``)."""
    return case.seed + 1


def materialise(case: Case, layout_seed: int | None = None, masked: str = "garbage",
                quantized: bool = True, logical: LogicalKV | None = None) -> Problem:
    """The canonical problem of a case, laid out from its seed (or another layout seed);
    ``logical``: its values, when already drawn."""
    seed = canonical_layout_seed(case) if layout_seed is None else layout_seed
    values = logical_kv(case, quantized) if logical is None else logical
    return values.lay_out(case.page_size, seed, case.table_padding, case.shared_pages, masked)


