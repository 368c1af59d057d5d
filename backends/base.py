"""The adapter contract: the one thing a new backend writes.

A backend is a small class: a name, what it supports (``Capabilities``), how it reports
(``Conventions``), why it might be unavailable, and two operations. ``decode`` writes into
buffers the harness allocated and poisoned; ``merge`` combines two attention states. The
adapter converts layouts and conventions; it knows nothing of the checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from conformance.case import KINDS
from conformance.dtypes import DTYPES, FP8_DTYPES, SCALE_MODES

if TYPE_CHECKING:
    from conformance.problem import Problem
    from conformance.spec import Case

FEATURES = {
    "lse": "writes the log-sum-exp of the scaled scores",
    "merge": "has a kernel that merges two attention states",
    "split_k": "takes a split count (decode's num_splits)",
    "sliding_window": "keeps only the last `window` tokens",
    "sinks": "always keeps the first `sinks` tokens next to a window",
    "soft_cap": "caps scaled scores as soft_cap * tanh(score / soft_cap)",
    "sink_logits": "adds exp(sink_logits[h]) to each query head's softmax denominator",
    "alibi": "adds alibi_slopes[h] * (key position - query position) to the scores",
    "multi_token": "several query tokens per sequence (query_lens), causal among its drafts",
    "draft_mask": "an explicit draft visibility matrix (draft_mask: trees, all-see-all)",
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend claims; a case outside it is *unsupported*, never passed.

    ``None`` for a set of sizes means any size. ``instances`` narrows the claim to the
    ``(num_qo_heads, num_kv_heads, head_dim, page_size, dtype)`` combinations a backend has
    kernels for, when it has them for only some (templates instantiated ahead of time);
    ``None`` claims every combination the other fields allow. ``float32_matmul`` is
    ``"ieee"`` or ``"tf32"`` (budgeted like tf32 for float32 cases). ``split_counts`` are the
    counts the split-count invariance check tries; ``deterministic=False`` relaxes the
    same-bits check. ``kv_dtypes`` are the fp8 formats the backend reads a quantized cache in
    and ``kv_scales`` the scale layouts it takes (``SCALE_MODES``); ``q_dtypes`` the fp8
    formats it takes a query in. Empty (the default): K, V and q in the case's dtype only.
    ``kinds`` are the problem kinds it decodes (``gqa``, ``mla``: docs/design.md §3); for
    MLA, ``latent_dims`` the ``(kv_lora_rank, rope_dim)`` pairs it has kernels for (None:
    any), while ``head_dims`` then counts the key's whole width.
    """

    dtypes: frozenset[str] = frozenset({"float32", "float16", "bfloat16"})
    head_dims: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None
    group_sizes: frozenset[int] | None = None
    max_group_size: int | None = None
    features: frozenset[str] = frozenset()
    devices: tuple[str, ...] = ("cpu",)
    float32_matmul: str = "ieee"
    split_counts: tuple[int, ...] = ()
    deterministic: bool = True
    instances: frozenset[Instance] | None = None
    kv_dtypes: frozenset[str] = frozenset()
    kv_scales: frozenset[str] = frozenset()
    q_dtypes: frozenset[str] = frozenset()
    kinds: frozenset[str] = frozenset({"gqa"})
    latent_dims: frozenset[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        # a typo here would claim nothing and pass everything as unsupported: refuse it
        for name in ("dtypes", "features", "kv_dtypes", "kv_scales", "q_dtypes", "kinds"):
            if isinstance(getattr(self, name), str) or not all(
                    isinstance(v, str) for v in getattr(self, name)):
                raise ValueError(f"Capabilities.{name} must be a set of names, got "
                                 f"{getattr(self, name)!r}")
        unknown_dtypes = set(self.dtypes) - set(DTYPES)
        if unknown_dtypes:
            raise ValueError(f"Capabilities.dtypes: unknown {sorted(unknown_dtypes)}; known: "
                             f"{', '.join(DTYPES)}")
        for name in ("head_dims", "page_sizes", "group_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)):
                raise ValueError(f"Capabilities.{name} must be None (any) or positive integers, "
                                 f"got {sorted(sizes, key=str)!r}")
        for name, known in (("kv_dtypes", FP8_DTYPES), ("kv_scales", SCALE_MODES),
                            ("q_dtypes", FP8_DTYPES), ("kinds", tuple(KINDS))):
            unknown_names = set(getattr(self, name)) - set(known)
            if unknown_names:
                raise ValueError(f"Capabilities.{name}: unknown {sorted(unknown_names)}; "
                                 f"known: {', '.join(known)}")
        if not self.kinds:
            raise ValueError("Capabilities.kinds must name at least one problem kind "
                             f"({', '.join(KINDS)})")
        if self.latent_dims is not None and (not self.latent_dims or not all(
                isinstance(p, tuple) and len(p) == 2 and _positive_ints(p)
                for p in self.latent_dims)):
            raise ValueError(f"Capabilities.latent_dims must be None (any) or (kv_lora_rank, "
                             f"rope_dim) pairs of positive integers, got "
                             f"{sorted(self.latent_dims or (), key=str)!r}")
        if bool(self.kv_dtypes) != bool(self.kv_scales):
            raise ValueError(f"Capabilities.kv_dtypes {sorted(self.kv_dtypes)} and kv_scales "
                             f"{sorted(self.kv_scales)}: a quantized cache needs both")
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"Capabilities.features: unknown {sorted(unknown)}; known: "
                             f"{', '.join(FEATURES)}")
        if self.instances is not None and (not self.instances or not all(
                _is_instance(i) for i in self.instances)):
            raise ValueError("Capabilities.instances must be None (any) or tuples of "
                             "(num_qo_heads, num_kv_heads, head_dim, page_size, dtype), got "
                             f"{sorted(self.instances or (), key=str)[:3]!r}")
        if self.float32_matmul not in ("ieee", "tf32"):
            raise ValueError(f"Capabilities.float32_matmul must be 'ieee' or 'tf32', got "
                             f"{self.float32_matmul!r}")
        if not _positive_ints(self.split_counts):
            raise ValueError(f"Capabilities.split_counts must be positive integers, got "
                             f"{self.split_counts!r}")
        if self.max_group_size is not None and not _positive_ints((self.max_group_size,)):
            raise ValueError(f"Capabilities.max_group_size must be None (any) or a positive "
                             f"integer, got {self.max_group_size!r}")
        if isinstance(self.devices, str) or not self.devices or not set(self.devices) <= set(
                DEVICES):
            raise ValueError(f"Capabilities.devices must name some of {', '.join(DEVICES)}, "
                             f"got {self.devices!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"Capabilities.deterministic must be True or False, got "
                             f"{self.deterministic!r}")

    def unsupported_reason(self, case: Case) -> str | None:
        """Why this backend does not claim ``case``, or None when it does."""
        if case.kind not in self.kinds:
            return (f"problem kind {case.kind} not in capabilities ({_names(self.kinds)} "
                    f"only)")
        if (case.kind == "mla" and self.latent_dims is not None
                and (case.kv_lora_rank, case.rope_dim) not in self.latent_dims):
            return (f"kv_lora_rank {case.kv_lora_rank}, rope_dim {case.rope_dim} not in "
                    f"capabilities ({_names(self.latent_dims)})")
        if case.dtype not in self.dtypes:
            return f"dtype {case.dtype} not in capabilities ({_names(self.dtypes)})"
        if self.head_dims is not None and case.head_dim not in self.head_dims:
            return f"head_dim {case.head_dim} not in capabilities ({_names(self.head_dims)})"
        if self.page_sizes is not None and case.page_size not in self.page_sizes:
            return f"page_size {case.page_size} not in capabilities ({_names(self.page_sizes)})"
        if self.group_sizes is not None and case.group_size not in self.group_sizes:
            return f"group size {case.group_size} not in capabilities ({_names(self.group_sizes)})"
        if self.max_group_size is not None and case.group_size > self.max_group_size:
            return f"group size {case.group_size} above max_group_size {self.max_group_size}"
        if case.kv_dtype is not None and case.kv_dtype not in self.kv_dtypes:
            return (f"kv dtype {case.kv_dtype} not in capabilities "
                    f"({_names(self.kv_dtypes) or 'none: K and V in the case dtype only'})")
        if case.kv_dtype is not None and case.kv_scale not in self.kv_scales:
            return f"kv scale {case.kv_scale} not in capabilities ({_names(self.kv_scales)})"
        if case.q_dtype is not None and case.q_dtype not in self.q_dtypes:
            return (f"query dtype {case.q_dtype} not in capabilities "
                    f"({_names(self.q_dtypes) or 'none: the query in the case dtype only'})")
        missing = case.features - self.features
        if missing:
            return f"feature {', '.join(sorted(missing))} not in capabilities"
        if self.instances is not None and instance_of(case) not in self.instances:
            return (f"no kernel instance for {case.num_qo_heads}/{case.num_kv_heads} heads, "
                    f"head_dim {case.head_dim}, page_size {case.page_size}, {case.dtype} "
                    f"({len(self.instances)} instances claimed)")
        return None

    def describe(self) -> dict[str, object]:
        def listed(values: Iterable | None) -> object:
            return "any" if values is None else sorted(values)
        return {"dtypes": listed(self.dtypes), "head_dims": listed(self.head_dims),
                "page_sizes": listed(self.page_sizes), "group_sizes": listed(self.group_sizes),
                "max_group_size": self.max_group_size or "any",
                "features": sorted(self.features), "devices": list(self.devices),
                "float32_matmul": self.float32_matmul, "split_counts": list(self.split_counts),
                "deterministic": self.deterministic,
                "instances": "any" if self.instances is None else len(self.instances),
                "kv_dtypes": sorted(self.kv_dtypes), "kv_scales": sorted(self.kv_scales),
                "q_dtypes": sorted(self.q_dtypes), "kinds": sorted(self.kinds),
                "latent_dims": listed(self.latent_dims)}

    def summary(self) -> str:
        """The claims a run's "claims nothing here" message names, in one line."""
        claims = self.describe()
        line = (f"kinds {claims['kinds']}, dtypes {claims['dtypes']}, head_dims "
                f"{claims['head_dims']}, page_sizes {claims['page_sizes']}, features "
                f"{claims['features']}")
        if self.kv_dtypes or self.q_dtypes:
            line += f", kv_dtypes {claims['kv_dtypes']}, q_dtypes {claims['q_dtypes']}"
        return line

    def as_data(self) -> dict[str, object]:
        """Plain data (lists), the form a worker sends; ``from_data`` reads it back."""
        def listed(values: Iterable | None) -> list | None:
            return None if values is None else sorted(values, key=str)
        return {"dtypes": listed(self.dtypes), "head_dims": listed(self.head_dims),
                "page_sizes": listed(self.page_sizes), "group_sizes": listed(self.group_sizes),
                "max_group_size": self.max_group_size, "features": listed(self.features),
                "devices": list(self.devices), "float32_matmul": self.float32_matmul,
                "split_counts": list(self.split_counts), "deterministic": self.deterministic,
                "instances": None if self.instances is None else
                [list(i) for i in sorted(self.instances, key=str)],
                "kv_dtypes": listed(self.kv_dtypes), "kv_scales": listed(self.kv_scales),
                "q_dtypes": listed(self.q_dtypes), "kinds": listed(self.kinds),
                "latent_dims": None if self.latent_dims is None else
                [list(p) for p in sorted(self.latent_dims)]}

    @classmethod
    def from_data(cls, data: object) -> Capabilities:
        """The capabilities ``as_data`` wrote; anything else is refused naming the field."""
        names = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"capabilities {str(data)[:200]} do not have the fields "
                             f"{sorted(names)}")

        def values(name: str, kind: type) -> object:
            value = data[name]
            if value is None and name not in ("dtypes", "features", "devices", "split_counts",
                                              "kv_dtypes", "kv_scales", "q_dtypes",
                                              "kinds"):
                return None
            if not isinstance(value, list):
                raise ValueError(f"Capabilities.{name} must be a list, got {value!r}")
            return kind(tuple(v) if isinstance(v, list) else v for v in value)

        return cls(dtypes=values("dtypes", frozenset), head_dims=values("head_dims", frozenset),
                   page_sizes=values("page_sizes", frozenset),
                   group_sizes=values("group_sizes", frozenset),
                   max_group_size=data["max_group_size"],
                   features=values("features", frozenset), devices=values("devices", tuple),
                   float32_matmul=data["float32_matmul"],
                   split_counts=values("split_counts", tuple),
                   deterministic=data["deterministic"],
                   instances=values("instances", frozenset),
                   kv_dtypes=values("kv_dtypes", frozenset),
                   kv_scales=values("kv_scales", frozenset),
                   q_dtypes=values("q_dtypes", frozenset), kinds=values("kinds", frozenset),
                   latent_dims=values("latent_dims", frozenset))


DEVICES = ("cpu", "cuda", "cpu-interpreter")  # the last: Triton's interpreter on a CPU


def _positive_ints(values: Iterable) -> bool:
    return all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in values)


#: (num_qo_heads, num_kv_heads, head_dim, page_size, dtype): one instantiated kernel shape
Instance = tuple[int, int, int, int, str]


def instance_of(case: Case) -> Instance:
    return (case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, case.dtype)


def _is_instance(value: object) -> bool:
    return (isinstance(value, tuple) and len(value) == 5 and value[4] in DTYPES
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                    for n in value[:4]))


def _names(values: Iterable) -> str:
    return ", ".join(str(v) for v in sorted(values))


@dataclass(frozen=True)
class Conventions:
    """How a backend reports, in its own native terms.

    ``lse_base`` is the base of the backend's native LSE; the adapter converts it to natural
    log before writing. ``empty_lse`` is the native LSE of an empty context: -inf, or the
    finite sentinel the kernel uses (TVM: -5e4 in base 2). The harness then accepts exactly
    ``empty_lse * ln(lse_base)`` for empty rows. ``lse_includes_sink``: whether the LSE of a
    case with sink logits counts the sink's ``exp(z_h)`` (the canonical LSE does; a backend
    whose LSE leaves it out says so, and is compared with an oracle LSE that leaves it out).
    """

    lse_base: float = math.e
    empty_lse: float = -math.inf
    lse_includes_sink: bool = True

    def __post_init__(self) -> None:
        base, empty = self.lse_base, self.empty_lse
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not (
                math.isfinite(base) and base > 1):
            raise ValueError(f"Conventions.lse_base must be a finite number above 1 (e, 2), "
                             f"got {base!r}")
        if isinstance(empty, bool) or not isinstance(empty, (int, float)) or math.isnan(
                empty) or empty == math.inf:
            raise ValueError(f"Conventions.empty_lse must be -inf or a finite number, got "
                             f"{empty!r}")
        if not isinstance(self.lse_includes_sink, bool):
            raise ValueError(f"Conventions.lse_includes_sink must be True or False, got "
                             f"{self.lse_includes_sink!r}")

    def as_data(self) -> dict[str, object]:
        return {"lse_base": self.lse_base, "empty_lse": self.empty_lse,
                "lse_includes_sink": self.lse_includes_sink}

    @classmethod
    def from_data(cls, data: object) -> Conventions:
        names = {"lse_base", "empty_lse", "lse_includes_sink"}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"conventions {str(data)[:200]} do not have the fields "
                             f"{sorted(names)}")
        return cls(data["lse_base"], data["empty_lse"], data["lse_includes_sink"])

    @property
    def empty_lse_natural(self) -> float:
        return self.empty_lse * math.log(self.lse_base)

    def describe(self) -> dict[str, object]:
        base = "e" if self.lse_base == math.e else self.lse_base
        return {"lse_base": base, "empty_lse": self.empty_lse,
                "empty_lse_natural": self.empty_lse_natural,
                "lse_includes_sink": self.lse_includes_sink}


@dataclass
class AttentionState:
    """A partial attention result: output ``(batch, heads, dim)`` and natural-log LSE
    ``(batch, heads)`` float32."""

    out: np.ndarray
    lse: np.ndarray
    meta: dict = field(default_factory=dict)


class Backend:
    """Subclass this; set ``name``, ``capabilities``, ``conventions``; write ``decode``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    conventions: ClassVar[Conventions] = Conventions()

    @classmethod
    def availability(cls) -> str | None:
        """None when the backend can run here, else why not (missing package, no GPU...)."""
        return None

    @classmethod
    def preload(cls) -> None:
        """Import what a worker needs before its first answer, touching no device and
        starting no thread: run once in the process its workers are forked from
        (``conformance.zygote``), so that each does not import it again. Optional.

        May be a generator: each ``yield`` ends a stage, each later stage runs in a fork,
        and the workers are forked after the last stage that left the process safe to
        fork from (``conformance.preload``): put what might start the CUDA driver last."""

    def unsupported_reason(self, case: Case) -> str | None:
        """Why a case is not claimed; override to add limits the capabilities can't say."""
        return self.capabilities.unsupported_reason(case)

    def decode(self, problem: Problem, out: np.ndarray, lse: np.ndarray, *,
               num_splits: int | None = None) -> None:
        """Write attention output into ``out`` and natural-log LSE into ``lse``.

        Both buffers arrive poisoned and must be fully written; the inputs must not change.
        ``num_splits`` is a hint for backends with the ``split_k`` feature.
        """
        raise NotImplementedError

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        """Combine two states over disjoint KV sets with the backend's own merge kernel."""
        raise NotImplementedError(f"backend {self.name!r} has no merge")

    def prepare(self, problem: Problem, out: np.ndarray, lse: np.ndarray, *,
                num_splits: int | None = None) -> Callable[[], None]:
        """The call a benchmark times: override to do layout conversion and uploads once
        and return only the kernel launch."""
        return lambda: self.decode(problem, out, lse, num_splits=num_splits)

    def timing_device(self) -> str:
        """``"cuda"`` when ``prepare``'s call runs asynchronously on a GPU, else ``"cpu"``."""
        return "cpu"

    #: whether ``prepare``'s call can be captured in a CUDA graph for timing
    capturable: ClassVar[bool] = True

    def notes(self) -> list[str]:
        """Lines for the report about this run (compile time, cache hits...)."""
        return []
