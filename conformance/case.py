"""What a case is: one decode problem before its arrays exist, and the names its fields take.

``conformance.spec`` expands the TOML into these; everything after (materialising, checks,
reports) reads them. The id is stable across runs and machines.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from conformance.dtypes import SHORT_NAMES, numpy_dtype

GARBAGE_CHUNK = 1 << 18  # elements of garbage a layout draws at most (conformance.materialise)

DISTRIBUTIONS = {
    "normal": "q, k, v standard normal",
    "peaked": "one key per KV head dominates by ~30 in score: near one-hot attention",
    "uniform": "q = 0: every score is 0, the output is the mean of V",
    "large": "scores of magnitude ~1e4: stresses the online-softmax rescale",
    "very-negative": "every score near -1e5, below any finite 'minus infinity' sentinel",
    "constant-v": "every value row of a KV head is the same vector: output must equal it",
    "flat-positive": "q = 0 and every value in [32, 64): the un-normalised sum of a long row "
                     "(or of one split of it) passes float16's 65504; the output is a mean",
}


# How a quantized cache's scales are drawn from the values they quantize.
KV_SCALINGS = {
    "fit": "each scale maps its largest value to 80-100% of the format's maximum (never a "
           "power of two on purpose)",
    "spread": "KV head h's keys and values grow by 1000^(h/(heads-1)) (the query shrinks to "
              "match, so scores stay): per-head scales 1000x apart",
    "saturate": "scales a quarter of the fit: the largest values saturate at the format's "
                "maximum",
    "subnormal": "scales so large that the values land on the format's subnormal codes",
}


# Learned per-query-head sink logits (gpt-oss): a term exp(sink) in the softmax denominator
# that is not a token. Named draws, or an explicit list of one float per query head.
SINK_LOGITS = {
    "normal": "each query head's sink logit standard normal, times 2: comparable to the scores",
    "large": "each about 12: the sink takes nearly all the weight and the output shrinks "
             "~1e4-fold (still a normal float16)",
    "minus-inf": "every sink logit -inf: the softmax as without a sink",
}


# Which drafts a query token sees, with several query tokens per sequence (``query_lens``).
DRAFT_MASKS = {
    "causal": "draft t sees the context and drafts 0..t; the kernel is given no matrix",
    "tree": "a random draft tree per sequence (drawn from the seed): draft t sees itself and "
            "its ancestors, given as a visibility matrix",
    "chain": "the visibility matrix of a chain (draft t's parent is t-1): causal, given as a "
             "matrix",
    "all": "every draft sees every draft of its sequence, later ones too, given as a matrix",
}
MAX_QUERY_LEN = 64

# The kinds of problem the spec holds: which attention a case asks for.
KINDS = {
    "gqa": "grouped-query attention: query head h reads KV head h // group, keys and values "
           "of head_dim each",
    "mla": "multi-head latent attention with absorbed weights (DeepSeek-V2/V3): every token "
           "stores one latent (kv_lora_rank wide) and one rotary key part (rope_dim), shared "
           "by all query heads; the key is [latent | rope], the value the latent",
}
# Distributions that draw values apart from keys: an MLA value is its key's latent.
MLA_DISTINCT_VALUES = ("constant-v", "flat-positive")
# What an MLA case cannot combine with yet (docs/design.md §3), with the reason.
MLA_REFUSED = {
    "kv_dtypes": "an fp8 latent cache is not modelled yet",
    "q_dtypes": "an fp8 query is not modelled yet for MLA",
    "soft_cap": "no MLA model caps its scores",
    "sink_logits": "no MLA model has sink logits",
    "alibi": "no MLA model uses ALiBi",
    "query_lens": "several query tokens per sequence are not modelled yet for MLA",
}



@dataclass(frozen=True)
class Case:
    """One decode problem, before its arrays exist; ``id`` is stable across runs and machines."""

    family: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    context_lens: tuple[int, ...]
    distribution: str = "normal"
    window: int | None = None
    sinks: int = 0
    sm_scale: float | None = None
    num_splits: int | None = None
    shared_pages: int = 0
    table_padding: int = 3
    pool_pages: int = 0  # the pool holds at least this many pages, the case's at its end
    kv_dtype: str | None = None  # an fp8 format: K and V stored as codes with scales
    kv_scale: str = "per-tensor"  # with kv_dtype: the scales' layout (SCALE_MODES)
    kv_scaling: str = "fit"  # with kv_dtype: how the scales are drawn (KV_SCALINGS)
    q_dtype: str | None = None  # an fp8 format: the query stored as codes with a q_scale
    soft_cap: float | None = None  # scores become cap * tanh(score / cap) (Gemma 2)
    sink_logits: str | tuple[float, ...] | None = None  # SINK_LOGITS, or one per query head
    alibi: bool | tuple[float, ...] = False  # True: the standard slopes; or one per query head
    query_lens: tuple[int, ...] | None = None  # query tokens per sequence (its last positions)
    mask: str = "causal"  # with query_lens: which drafts each query token sees (DRAFT_MASKS)
    # An MLA case: the latent's width; head_dim is kv_lora_rank + rope_dim (the key), the
    # value and the output kv_lora_rank wide, one KV head (the latent) shared by every head.
    kv_lora_rank: int | None = None
    tag: str = ""
    fixed_seed: int | None = None  # the spec's `seed`: draw the values from it, not the id
    batch_label: str = field(default="", compare=False)

    @property
    def kind(self) -> str:
        """Which attention the case asks for (``KINDS``)."""
        return "gqa" if self.kv_lora_rank is None else "mla"

    @property
    def rope_dim(self) -> int:
        """An MLA case's rotary key part (0 for GQA)."""
        return 0 if self.kv_lora_rank is None else self.head_dim - self.kv_lora_rank

    @property
    def head_dim_v(self) -> int:
        """The width of a value and of the output: the latent's for MLA."""
        return self.head_dim if self.kv_lora_rank is None else self.kv_lora_rank

    @property
    def id(self) -> str:
        heads = (f"q{self.num_qo_heads}kv{self.num_kv_heads}-d{self.head_dim}"
                 if self.kv_lora_rank is None else
                 f"h{self.num_qo_heads}-r{self.kv_lora_rank}-rope{self.rope_dim}")
        shape = f"{heads}-ps{self.page_size}-{SHORT_NAMES[self.dtype]}"
        if self.q_dtype is not None:
            shape += f"-q-{SHORT_NAMES[self.q_dtype]}"
        if self.kv_dtype is not None:
            shape += f"-kv-{SHORT_NAMES[self.kv_dtype]}-{self.kv_scale}"
            if self.kv_scaling != Case.kv_scaling:
                shape += f"-{self.kv_scaling}"
        ctx = self.batch_label or "[" + ",".join(map(str, self.context_lens)) + "]"
        detail = f"ctx{ctx}"
        if self.query_lens is not None:
            same = len(set(self.query_lens)) == 1 and self.batch_label
            detail += f"-qlen{self.query_lens[0]}" if same else \
                "-qlen[" + ",".join(map(str, self.query_lens)) + "]"
            if self.mask != Case.mask:
                detail += f"-{self.mask}"
        if self.window is not None:
            detail += f"-window{self.window}"
            if self.sinks:
                detail += f"+sink{self.sinks}"
        detail += f"-{self.distribution}"
        if self.sm_scale is not None:
            detail += f"-scale{self.sm_scale:g}"
        if self.soft_cap is not None:
            detail += f"-softcap{self.soft_cap:g}"
        if self.sink_logits is not None:
            detail += "-sinklogits" + (
                "" if self.sink_logits == "normal" else f"-{self.sink_logits}"
                if isinstance(self.sink_logits, str) else _listed(self.sink_logits))
        if self.alibi:
            detail += "-alibi" + ("" if self.alibi is True else _listed(self.alibi))
        if self.num_splits is not None:
            detail += f"-splits{self.num_splits}"
        if self.shared_pages:
            detail += f"-shared{self.shared_pages}"
        if self.table_padding != Case.table_padding:
            detail += f"-pad{self.table_padding}"
        if self.pool_pages:
            detail += f"-pool{self.pool_pages}"
        if self.fixed_seed is not None:
            detail += f"-seed{self.fixed_seed}"
        return "/".join(part for part in (self.family, self.tag, shape, detail) if part)

    @property
    def seed(self) -> int:
        """Where the values and the layout are drawn from: the spec's ``seed`` if it gives
        one (a saved explore finding replays what was drawn), else the id's checksum."""
        return self.fixed_seed if self.fixed_seed is not None else zlib.crc32(self.id.encode())

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def tokens(self) -> int:
        """Query tokens over the batch: one per sequence unless ``query_lens`` says more."""
        return sum(self.query_lens) if self.query_lens is not None else self.batch

    @property
    def scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def problem_bytes(self) -> int:
        """About what materialising the case takes: every array it allocates. The page pool
        (K and V, with its spare pages), the logical keys and values it is drawn from, the
        query, the outputs and LSEs of the poisoned runs, the block table, and the float64
        copies the oracle works in (the kept keys and values per query head among them)."""
        pages = sum(-(-n // self.page_size) for n in self.context_lens)
        tokens = max(pages + max(2, pages // 2) + 1, self.pool_pages) * self.page_size
        item = np.dtype(numpy_dtype(self.dtype)).itemsize
        stored = 1 if self.kv_dtype is not None else item
        # the pool three times (the problem, the worker's copy, a re-laid problem), and the
        # garbage drawn for it (at most a chunk, in float64); per-token scales beside it
        elements = tokens * self.num_kv_heads * self.head_dim
        pool = 2 * (3 * elements * stored + 8 * min(elements, GARBAGE_CHUNK))
        if self.kv_dtype is not None and self.kv_scale == "per-token":
            pool += 2 * 3 * 4 * tokens * self.num_kv_heads
        logical = 2 * sum(self.context_lens) * self.num_kv_heads * self.head_dim * (4 + item)
        # one KV head is broadcast to the query heads, not copied (MQA, MLA)
        copies = self.num_qo_heads if self.num_kv_heads > 1 else 1
        kept = 2 * sum(self.context_lens) * copies * self.head_dim * 8
        rows = self.tokens * self.num_qo_heads
        queries = rows * self.head_dim * (8 + item) * 4 + rows * 4 * 4  # q, outs; LSEs
        table = self.batch * (pages + self.table_padding) * 4
        return pool + logical + kept + queries + table

    @property
    def features(self) -> frozenset[str]:
        """Optional kernel features this case needs (names as in ``Capabilities.features``)."""
        needed = set()
        if self.window is not None:
            needed.add("sliding_window")
        if self.sinks:
            needed.add("sinks")
        for feature, present in (("soft_cap", self.soft_cap is not None),
                                 ("sink_logits", self.sink_logits is not None),
                                 ("alibi", bool(self.alibi)),
                                 ("multi_token", self.query_lens is not None),
                                 ("draft_mask", self.query_lens is not None
                                  and self.mask != "causal")):
            if present:
                needed.add(feature)
        return frozenset(needed)


def _listed(values: tuple[float, ...]) -> str:
    return "[" + ",".join(f"{v:g}" for v in values) + "]"

