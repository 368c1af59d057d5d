"""Materialising a case into canonical NumPy arrays, laid out adversarially.

Logical values (what each sequence holds) are drawn from the case's seed; the layout (which
physical page holds what) from a separate layout seed, so the checks can lay the same values
out again and expect the same answer. Every slot a kernel must not read holds finite garbage
chosen to change the answer far beyond any budget if it is attended to (large scores, values
of +-1000); the ``poison/masked-nan`` check lays the same problem out with NaN there instead,
so a kernel that reads masked slots and zeroes their weight (0 x NaN) is one finding, not a
failure of every check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from conformance.dtypes import numpy_dtype
from conformance.spec import GARBAGE_CHUNK, Case  # at most this many garbage elements drawn
from references import kept_tokens

# Output poisons: a first run sees NaN, a second run a finite value no real output takes.
POISONS = (float("nan"), -12288.0)
# What fills the slots a kernel must not read: "garbage" (finite, adversarial) or "nan".
MASKED_FILLS = ("garbage", "nan")
GARBAGE_SCORE = 20.0  # standard deviation of a garbage key's score against a normal query
GARBAGE_VALUE = 1000.0  # magnitude of a garbage value


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
        return self.q.dtype

    def kept(self, row: int) -> np.ndarray:
        """Positions of row ``row`` that take part in attention."""
        return kept_tokens(int(self.context_lens[row]), self.window, self.sinks)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"q": self.q, "k_pages": self.k_pages, "v_pages": self.v_pages,
                "block_table": self.block_table, "context_lens": self.context_lens}


@dataclass(frozen=True)
class LogicalKV:
    """What each sequence holds, independent of paging: the values a layout places."""

    q: np.ndarray  # (batch, num_qo_heads, head_dim)
    keys: tuple[np.ndarray, ...]  # per sequence (context_len, num_kv_heads, head_dim)
    values: tuple[np.ndarray, ...]
    sm_scale: float
    window: int | None = None
    sinks: int = 0
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
        dtype = self.q.dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        if masked == "nan":
            k_pages = np.full(shape, np.nan, dtype=dtype)
            v_pages = np.full_like(k_pages, np.nan)
        elif masked == "garbage":
            k_pages, v_pages = _garbage(rng, shape, dtype,
                                        GARBAGE_SCORE / (math.sqrt(head_dim) * self.sm_scale))
        else:
            raise ValueError(f"masked fill {masked!r}; known: {', '.join(MASKED_FILLS)}")
        for b, n in enumerate(lens):
            positions = kept_tokens(n, self.window, self.sinks)
            pages = table[b, positions // page_size]
            k_pages[pages, positions % page_size] = self.keys[b][positions]
            v_pages[pages, positions % page_size] = self.values[b][positions]
        return Problem(q=self.q.copy(), k_pages=k_pages, v_pages=v_pages, block_table=table,
                       context_lens=np.asarray(lens, dtype=np.int32), sm_scale=self.sm_scale,
                       window=self.window, sinks=self.sinks)

    def select(self, rows: list[int]) -> LogicalKV:
        """The same sequences in another order or subset."""
        return replace(self, q=self.q[rows], keys=tuple(self.keys[r] for r in rows),
                       values=tuple(self.values[r] for r in rows))


def _garbage(rng: np.random.Generator, shape: tuple[int, ...], dtype: type, key_scale: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """Garbage K (normal, scores of ~``GARBAGE_SCORE``) and V (+-``GARBAGE_VALUE``) pages.

    At most ``GARBAGE_CHUNK`` elements of each are drawn; a larger pool repeats them (a
    pool of 2^32 elements would take minutes to draw, and garbage needs no more variety than
    a wrong page meeting values far off the answer)."""
    pages = max(1, min(shape[0], GARBAGE_CHUNK // max(1, math.prod(shape[1:]))))
    drawn = (pages, *shape[1:])
    k_block = (rng.standard_normal(drawn, dtype=np.float32) * np.float32(key_scale)).astype(dtype)
    v_block = (np.where(rng.random(drawn) < 0.5, -1.0, 1.0) * GARBAGE_VALUE).astype(dtype)
    k_pages, v_pages = np.empty(shape, dtype=dtype), np.empty(shape, dtype=dtype)
    for start in range(0, shape[0], pages):
        rows = min(pages, shape[0] - start)
        k_pages[start:start + rows] = k_block[:rows]
        v_pages[start:start + rows] = v_block[:rows]
    return k_pages, v_pages


def logical_kv(case: Case) -> LogicalKV:
    """Draw the values of a case from its seed, in the case's distribution."""
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
    return LogicalKV(q=q.astype(dtype), keys=tuple(k.astype(dtype) for k in keys),
                     values=tuple(v.astype(dtype) for v in values), sm_scale=case.scale,
                     window=case.window, sinks=case.sinks,
                     pool_elements=case.pool_pages * case.page_size * hkv * d)


def materialise(case: Case, layout_seed: int | None = None, masked: str = "garbage") -> Problem:
    """The canonical problem of a case, laid out from its seed (or another layout seed)."""
    seed = case.seed + 1 if layout_seed is None else layout_seed
    return logical_kv(case).lay_out(case.page_size, seed, case.table_padding, case.shared_pages,
                                    masked)


def poisoned_outputs(problem: Problem, poison: float) -> tuple[np.ndarray, np.ndarray]:
    """Output and LSE buffers pre-filled with a poison, for the backend to overwrite."""
    out = np.full(problem.q.shape, poison, dtype=problem.dtype)
    lse = np.full(problem.q.shape[:2], poison, dtype=np.float32)
    return out, lse
