"""The canonical problem: the arrays every backend receives, and the buffers it fills.

What each field holds and in which layout is docs/design.md §3; ``conformance.materialise``
draws a case's values and lays them out into one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conformance.references import kept_tokens

# Output poisons: a first run sees NaN, a second run a finite value no real output takes.
POISONS = (float("nan"), -12288.0)
# What fills the slots a kernel must not read: "garbage" (finite, adversarial) or "nan".



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
        if self.query_lens is None:  # one row a sequence (asked per row by kernels' loops)
            return np.arange(self.batch)
        return np.repeat(np.arange(self.batch), self.row_lens)

    @property
    def query_positions(self) -> np.ndarray:
        """``(tokens,)``: the context position of each query row."""
        if self.query_lens is None:
            return self.context_lens.astype(np.int64) - 1
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

    def slots(self, sequence: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where the given positions of a sequence are stored: ``(pages, slots)`` into the
        pools; a page is -1 where the table holds none (a block the window evicted)."""
        return (self.block_table[sequence, positions // self.page_size],
                positions % self.page_size)

    def gather(self, sequence: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V of the given positions of a sequence as stored (codes, for an fp8 cache),
        ``(tokens, kv_heads, dim)`` each: what an adapter reads to build another layout. The
        oracle gathers on its own (``conformance.references``), so that it shares no code
        with what it judges."""
        pages, slots = self.slots(sequence, positions)
        return self.k_pages[pages, slots], self.v_pages[pages, slots]

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


def poisoned_outputs(problem: Problem, poison: float) -> tuple[np.ndarray, np.ndarray]:
    """Output and LSE buffers pre-filled with a poison, for the backend to overwrite."""
    out = np.full((*problem.q.shape[:2], problem.head_dim_v), poison, dtype=problem.dtype)
    lse = np.full(problem.q.shape[:2], poison, dtype=np.float32)
    return out, lse
