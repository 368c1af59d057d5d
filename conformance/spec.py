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
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

from conformance.case import (
    DISTRIBUTIONS,
    DRAFT_MASKS,
    KV_SCALINGS,
    MAX_QUERY_LEN,
    MLA_DISTINCT_VALUES,
    MLA_REFUSED,
    SINK_LOGITS,
    Case,
)
from conformance.dtypes import DTYPES, FP8_DTYPES, SCALE_MODES
from conformance.inputs import read_text

SPEC_PATH = Path(__file__).with_name("spec.toml")
SCHEMA = 1  # the spec format this code reads


def _half_the_memory_mib() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**21
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return 8192


# A case whose arrays would be larger is refused at load: half this machine's memory.
DEFAULT_MAX_CASE_MIB = _half_the_memory_mib()

class SpecError(ValueError):
    """A spec entry that cannot become a case; the message names the entry and the field."""



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
