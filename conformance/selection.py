"""Which cases a run takes: a profile's, narrowed by id patterns or exact ids."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from conformance.case import Case
from conformance.manifest import glob_match
from conformance.spec import Spec, SpecError


def pattern_matcher(pattern: str) -> Callable[[str], bool]:
    """Substring match; ``*`` and ``?`` are wildcards (brackets in ids are literal)."""
    return lambda text: glob_match(f"*{pattern}*", text)


def select_cases(spec: Spec, profile: str, patterns: Iterable[str] = (),
                 case_ids: Iterable[str] = ()) -> list[Case]:
    cases = spec.cases(profile)
    wanted = set(case_ids)
    if wanted:
        by_id = {c.id: c for spec_profile in spec.profiles for c in spec.cases(spec_profile)}
        missing = wanted - set(by_id)
        if missing:
            raise SpecError(f"unknown case id(s): {', '.join(sorted(missing))}")
        cases = [by_id[i] for i in by_id if i in wanted]
    matchers = [pattern_matcher(p) for p in patterns]
    return [c for c in cases if all(m(c.id) for m in matchers)]

