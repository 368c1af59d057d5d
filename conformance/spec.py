"""The spec: a TOML file of problem families that expands deterministically into cases.

The TOML is the only place a case is defined. Each ``[[family]]`` names the edge case it
stands for, the profiles that run it, fields it sets, an optional grid of fields to cross and
a list of variants; every combination is crossed with the family's dtypes. A bad entry fails
at load with the family, the variant and the field named.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import tomllib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from conformance.dtypes import DTYPES, FP8_DTYPES, SCALE_MODES, SHORT_NAMES, numpy_dtype
from conformance.inputs import read_text

SPEC_PATH = Path(__file__).with_name("spec.toml")
GARBAGE_CHUNK = 1 << 24  # elements of garbage a layout draws at most (conformance.problem)
SCHEMA = 1  # the spec format this code reads


def _half_the_memory_mib() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**21
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return 8192


# A case whose arrays would be larger is refused at load: half this machine's memory.
DEFAULT_MAX_CASE_MIB = _half_the_memory_mib()

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


class SpecError(ValueError):
    """A spec entry that cannot become a case; the message names the entry and the field."""


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


@dataclass(frozen=True)
class Profile:
    name: str
    doc: str
    dtypes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    profiles: tuple[str, ...]
    cases: tuple[Case, ...]


@dataclass(frozen=True)
class Spec:
    profiles: Mapping[str, Profile]
    families: tuple[Family, ...]

    def cases(self, profile: str) -> list[Case]:
        """The cases of a profile, in spec order."""
        if profile not in self.profiles:
            raise SpecError(f"unknown profile {profile!r}; known: {', '.join(self.profiles)}")
        dtypes = self.profiles[profile].dtypes
        return [case for family in self.families if profile in family.profiles
                for case in family.cases if dtypes is None or case.dtype in dtypes]


# Fields a family's `set`, `grid` and `variants` may give, with their types.
_INT_FIELDS = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "window", "sinks",
               "num_splits", "shared_pages", "table_padding", "pool_pages", "seed",
               "kv_lora_rank", "rope_dim")
_CASE_FIELDS = ({f.name for f in fields(Case)} - {"family", "batch_label", "dtype",
                                                   "fixed_seed", "kv_dtype", "q_dtype"}) | {
    "seed", "rope_dim"}
_CROSSED = {"dtypes": ("dtype", DTYPES), "kv_dtypes": ("kv_dtype", FP8_DTYPES),
            "q_dtypes": ("q_dtype", FP8_DTYPES)}  # lists every case is crossed with
_NAMED = {"distribution": DISTRIBUTIONS, "kv_scale": SCALE_MODES, "kv_scaling": KV_SCALINGS,
          "mask": DRAFT_MASKS}
_PER_HEAD = ("sink_logits", "alibi")  # a name or a flag, or one float per query head
_FIELD_NAMES = sorted(_CASE_FIELDS | set(_CROSSED))
_FAMILY_KEYS = {"name", "doc", "profiles", "set", "grid", "variants"}


def _check_keys(where: str, table: Mapping[str, Any], allowed: set[str] | list[str]) -> None:
    for key in table:
        if key not in allowed:
            raise SpecError(f"{where}: unknown field {key!r} (known: {', '.join(sorted(allowed))})")


def _int(where: str, name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(f"{where}: field {name!r} must be >= {minimum}, got {value}")
    return value


def _context_lens(where: str, value: Any) -> tuple[tuple[int, ...], str]:
    """Explicit lengths, or a seeded draw from ``{batch, min, max}`` for large batches."""
    if isinstance(value, list):
        if not value:
            raise SpecError(f"{where}: field 'context_lens' must not be empty")
        return tuple(_int(where, "context_lens", n, 0) for n in value), ""
    if isinstance(value, dict):
        _check_keys(f"{where} context_lens", value, {"batch", "min", "max"})
        batch = _int(where, "context_lens.batch", value.get("batch"), 1)
        low = _int(where, "context_lens.min", value.get("min"), 0)
        high = _int(where, "context_lens.max", value.get("max"), low)
        draw = random.Random(f"{batch}:{low}:{high}")
        return tuple(draw.randint(low, high) for _ in range(batch)), f"{batch}x[{low}..{high}]"
    raise SpecError(f"{where}: field 'context_lens' must be a list of integers or a table "
                    f"{{batch, min, max}}, got {value!r}")


def _make_case(where: str, family: str, values: Mapping[str, Any], dtype: str,
               kv_dtype: str | None = None, q_dtype: str | None = None) -> Case:
    kwargs: dict[str, Any] = {"kv_dtype": kv_dtype, "q_dtype": q_dtype}
    for name, value in values.items():
        if name == "context_lens":
            kwargs["context_lens"], kwargs["batch_label"] = _context_lens(where, value)
        elif name == "seed":
            kwargs["fixed_seed"] = _int(where, name, value, 0)
        elif name in _INT_FIELDS:
            kwargs[name] = _int(where, name, value, 0 if name in (
                "sinks", "shared_pages", "table_padding", "pool_pages") else 1)
        elif name in ("sm_scale", "soft_cap"):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                    math.isfinite(value) and value > 0):
                raise SpecError(f"{where}: field {name!r} must be a finite positive number, "
                                f"got {value!r}")
            kwargs[name] = float(value)
        elif name in _PER_HEAD:
            kwargs[name] = _per_head(where, name, value)
        elif name == "query_lens":
            kwargs[name] = value  # checked against context_lens below
        elif name in ("tag", *_NAMED):
            if not isinstance(value, str):
                raise SpecError(f"{where}: field {name!r} must be a string, got {value!r}")
            if name in _NAMED and value not in _NAMED[name]:
                raise SpecError(f"{where}: field {name!r} is {value!r}; known: "
                                f"{', '.join(_NAMED[name])}")
            kwargs[name] = value
    if "kv_lora_rank" in kwargs or "rope_dim" in kwargs:
        _latent_shape(where, kwargs, values, kv_dtype, q_dtype)
    for required in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "context_lens"):
        if required not in kwargs:
            raise SpecError(f"{where}: field {required!r} is missing")
    if kwargs["num_qo_heads"] % kwargs["num_kv_heads"]:
        raise SpecError(f"{where}: num_qo_heads={kwargs['num_qo_heads']} is not a multiple of "
                        f"num_kv_heads={kwargs['num_kv_heads']}")
    for name in _PER_HEAD:
        value = kwargs.get(name)
        if isinstance(value, tuple) and len(value) != kwargs["num_qo_heads"]:
            raise SpecError(f"{where}: field {name!r} lists {len(value)} values for "
                            f"num_qo_heads={kwargs['num_qo_heads']}: one per query head")
    if "query_lens" in kwargs:
        kwargs["query_lens"] = _query_lens(where, kwargs["query_lens"], kwargs["context_lens"])
    elif "mask" in kwargs:
        raise SpecError(f"{where}: field 'mask' needs 'query_lens' (it says which drafts each "
                        f"of several query tokens sees)")
    for name in ("kv_scale", "kv_scaling"):
        if name in kwargs and kv_dtype is None:
            raise SpecError(f"{where}: field {name!r} needs 'kv_dtypes' (scales belong to a "
                            f"quantized cache)")
    if kwargs.get("kv_scaling") == "spread" and kwargs["num_kv_heads"] < 2:
        raise SpecError(f"{where}: field 'kv_scaling' = 'spread' needs num_kv_heads >= 2, got "
                        f"{kwargs['num_kv_heads']}")
    if kwargs.get("sinks") and "window" not in kwargs:
        raise SpecError(f"{where}: field 'sinks' needs a 'window' (sinks are the tokens a "
                        f"sliding window keeps)")
    if kwargs.get("shared_pages") and len(kwargs["context_lens"]) < 2:
        raise SpecError(f"{where}: field 'shared_pages' needs a batch of at least 2")
    return Case(family=family, dtype=dtype, **kwargs)


def _latent_shape(where: str, kwargs: dict[str, Any], values: Mapping[str, Any],
                  kv_dtype: str | None, q_dtype: str | None) -> None:
    """An MLA case: ``head_dim`` from ``kv_lora_rank`` and ``rope_dim``, one KV head (the
    latent); what MLA cannot combine with is refused with the reason."""
    for name in ("kv_lora_rank", "rope_dim"):
        if name not in kwargs:
            raise SpecError(f"{where}: field {name!r} is missing (an MLA case gives "
                            f"kv_lora_rank and rope_dim)")
    for name in ("head_dim", "num_kv_heads"):
        if name in values:
            raise SpecError(f"{where}: field {name!r} is set by an MLA case itself (head_dim = "
                            f"kv_lora_rank + rope_dim, one KV head: the latent); remove it")
    present = {"kv_dtypes": kv_dtype, "q_dtypes": q_dtype,
               **{name: kwargs.get(name) for name in MLA_REFUSED if name in kwargs}}
    for name, reason in MLA_REFUSED.items():
        if present.get(name) not in (None, False):
            raise SpecError(f"{where}: field {name!r} with kv_lora_rank: {reason}")
    if kwargs.get("distribution") in MLA_DISTINCT_VALUES:
        raise SpecError(f"{where}: field 'distribution' is {kwargs['distribution']!r}, which "
                        f"draws values apart from keys; an MLA value is its key's latent")
    kwargs["head_dim"] = kwargs["kv_lora_rank"] + kwargs.pop("rope_dim")
    kwargs["num_kv_heads"] = 1


def _query_lens(where: str, value: Any, context_lens: tuple[int, ...]) -> tuple[int, ...]:
    """One query length per sequence (an integer: the same for all), 1..MAX_QUERY_LEN, none
    longer than its context: a context counts its draft tokens."""
    lens = [value] * len(context_lens) if isinstance(value, int) and not isinstance(
        value, bool) else value
    if not isinstance(lens, list) or len(lens) != len(context_lens):
        raise SpecError(f"{where}: field 'query_lens' must be an integer or a list of one per "
                        f"sequence ({len(context_lens)}), got {value!r}")
    for b, (q, n) in enumerate(zip(lens, context_lens, strict=True)):
        _int(where, "query_lens", q, 1)
        if q > MAX_QUERY_LEN:
            raise SpecError(f"{where}: field 'query_lens' is {q} for sequence {b}; at most "
                            f"{MAX_QUERY_LEN}")
        if q > n:
            raise SpecError(f"{where}: field 'query_lens' is {q} for sequence {b}, longer than "
                            f"its context of {n} (a context length counts its drafts)")
    return tuple(lens)


def _per_head(where: str, name: str, value: Any) -> Any:
    """``sink_logits``: a SINK_LOGITS name or floats (-inf allowed); ``alibi``: a flag or
    finite floats."""
    if isinstance(value, list):
        if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                and not math.isnan(v) and (name == "sink_logits"
                                                           or math.isfinite(v))
                                for v in value):
            raise SpecError(f"{where}: field {name!r} must list one "
                            f"{'number' if name == 'sink_logits' else 'finite number'} per "
                            f"query head, got {value!r}")
        return tuple(float(v) for v in value)
    if name == "alibi":
        if not isinstance(value, bool):
            raise SpecError(f"{where}: field 'alibi' must be true, false or a list of slopes "
                            f"(one per query head), got {value!r}")
        return value
    if not isinstance(value, str) or value not in SINK_LOGITS:
        raise SpecError(f"{where}: field 'sink_logits' is {value!r}; known: "
                        f"{', '.join(SINK_LOGITS)}, or a list of one number per query head")
    return value


def _dtypes(where: str, value: Any, field_name: str = "dtypes") -> list[str]:
    known = _CROSSED[field_name][1]
    if not isinstance(value, list) or not value:
        raise SpecError(f"{where}: field {field_name!r} must be a non-empty list, got {value!r}")
    for name in value:
        if name not in known:
            raise SpecError(f"{where}: field {field_name!r} names {name!r}; known: "
                            f"{', '.join(known)}")
    return value


def _table(where: str, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: field {name!r} must be a table, got {value!r}")
    return value


def _expand_family(entry: Mapping[str, Any], index: int, defaults: Mapping[str, Any],
                   profiles: Mapping[str, Profile], source: str) -> Family:
    where = f"{source}: family #{index + 1}"
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: field 'name' must be a non-empty string, got {name!r}")
    where = f"{source}: family {name!r}"
    _check_keys(where, entry, _FAMILY_KEYS)
    doc = entry.get("doc", "")
    family_profiles = entry.get("profiles")
    if not isinstance(family_profiles, list) or not family_profiles:
        raise SpecError(f"{where}: field 'profiles' must be a non-empty list")
    for profile in family_profiles:
        if profile not in profiles:
            raise SpecError(f"{where}: field 'profiles' names {profile!r}; known: "
                            f"{', '.join(profiles)}")
    base = _table(where, "set", entry.get("set", {}))
    grid = _table(where, "grid", entry.get("grid", {}))
    variants = entry.get("variants", [{}])
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise SpecError(f"{where}: field 'variants' must be a list of tables")
    _check_keys(f"{where} set", base, _FIELD_NAMES)
    _check_keys(f"{where} grid", grid, _FIELD_NAMES)
    for axis, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{where} grid: field {axis!r} must be a non-empty list")
    cases: dict[str, Case] = {}
    for number, variant in enumerate(variants, start=1):
        variant_where = f"{where} variant {number}"
        _check_keys(variant_where, variant, _FIELD_NAMES)
        for combo in itertools.product(*grid.values()):
            given = {**base, **dict(zip(grid, combo, strict=True)), **variant}
            inherited = {name: value for name, value in defaults.items() if not (
                "kv_lora_rank" in given and name in ("head_dim", "num_kv_heads"))}
            values = {**inherited, **given}
            dtypes = _dtypes(variant_where, values.pop("dtypes", list(DTYPES)))
            kv_dtypes = _dtypes(variant_where, values.pop("kv_dtypes"), "kv_dtypes") \
                if "kv_dtypes" in values else [None]
            q_dtypes = _dtypes(variant_where, values.pop("q_dtypes"), "q_dtypes") \
                if "q_dtypes" in values else [None]
            for dtype, kv_dtype, q_dtype in itertools.product(dtypes, kv_dtypes, q_dtypes):
                case = _make_case(variant_where, name, values, dtype, kv_dtype, q_dtype)
                cases.setdefault(case.id, case)
    return Family(name=name, doc=doc, profiles=tuple(family_profiles), cases=tuple(cases.values()))


def parse_spec(data: Mapping[str, Any], source: str = "spec") -> Spec:
    """Validate and expand a parsed spec document."""
    _check_keys(source, data, {"schema", "defaults", "profiles", "family"})
    schema = data.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise SpecError(f"{source}: field 'schema' is {schema!r}; this version reads schema "
                        f"{SCHEMA}")
    defaults = _table(source, "defaults", data.get("defaults", {}))
    _check_keys(f"{source}: defaults", defaults, _FIELD_NAMES)
    profiles: dict[str, Profile] = {}
    for name, entry in _table(source, "profiles", data.get("profiles", {})).items():
        where = f"{source}: profile {name!r}"
        _check_keys(where, _table(where, name, entry), {"doc", "dtypes"})
        dtypes = tuple(_dtypes(where, entry["dtypes"])) if "dtypes" in entry else None
        profiles[name] = Profile(name=name, doc=entry.get("doc", ""), dtypes=dtypes)
    if not profiles:
        raise SpecError(f"{source}: no [profiles.NAME] table")
    families = data.get("family", [])
    if not isinstance(families, list):
        raise SpecError(f"{source}: 'family' must be an array of tables ([[family]])")
    expanded = tuple(_expand_family(entry, i, defaults, profiles, source)
                     for i, entry in enumerate(families))
    seen: dict[str, int] = {}
    for family in expanded:
        seen[family.name] = seen.get(family.name, 0) + 1
        if seen[family.name] > 1:
            raise SpecError(f"{source}: family {family.name!r} is defined twice")
    return Spec(profiles=profiles, families=expanded)


def load_spec(path: str | Path | None = None) -> Spec:
    """Load and expand a spec file (the built-in one by default)."""
    path = Path(path) if path is not None else SPEC_PATH
    try:
        data = tomllib.loads(read_text(path, "spec"))
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"spec {str(path)!r}: not valid TOML: {exc}") from None
    return parse_spec(data, source=path.name)


@cache
def default_spec() -> Spec:
    return load_spec()


def check_sizes(cases: list[Case], max_mib: float = DEFAULT_MAX_CASE_MIB) -> None:
    """Refuse, before any backend runs, a case too large to materialise on this machine."""
    for case in cases:
        mib = case.problem_bytes / 2**20
        if mib > max_mib:
            raise SpecError(f"case {case.id}: its arrays would take about {mib:,.0f} MiB, over "
                            f"the cap of {max_mib:g} MiB (--max-case-mib)")


def with_changes(case: Case, **changes: Any) -> Case:
    """A copy of a case with some fields changed (the id follows the fields)."""
    if "context_lens" in changes:
        changes.setdefault("batch_label", "")
    return replace(case, **changes)
