"""Two saved reports of the same backends, compared: how a user gates a library upgrade.

``python -m conformance compare OLD NEW`` lists, per (backend, case, check), what newly fails,
what newly passes, what changed claims (supported <-> unsupported), and the measured errors
that grew past a factor while still passing; it exits 1 when anything newly fails. A result
counts as failing when it did not pass, whatever the manifest said of it: an upgrade that
turns a pass into a listed failure is still a regression to look at.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.accuracy import NOISE_FLOOR
from conformance.status import Status

PASSING = {Status.PASSED, Status.UNEXPECTED_PASS}
FAILING = {Status.FAILED, Status.ERROR, Status.KNOWN_FAILURE}

Key = tuple[str, str, str]  # (backend, case, check)


@dataclass(frozen=True)
class Change:
    key: Key
    before: str
    after: str
    detail: str = ""

    def line(self) -> str:
        backend, case, check = self.key
        return f"  {backend} {check} {case}: {self.before} -> {self.after}" + (
            f" ({self.detail})" if self.detail else "")


def _indexed(report: dict) -> dict[Key, dict]:
    return {(r["backend"], r["case"], r["check"]): r for r in report["results"]}


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def different_runs(old: dict, new: dict) -> str:
    """What makes two reports runs of different things (profile, spec, backends, cases), or
    '' when they ran the same."""
    for key in ("profile", "spec"):
        if old.get(key) != new.get(key):
            return f"{key} {old.get(key)!r} and {new.get(key)!r}"
    names = [sorted(b["name"] for b in report["backends"]) for report in (old, new)]
    if names[0] != names[1]:
        return f"backends {', '.join(names[0])} and {', '.join(names[1])}"
    cases = [{r["case"] for r in report["results"]} for report in (old, new)]
    if cases[0] != cases[1]:
        return (f"{len(cases[0])} and {len(cases[1])} cases, {len(cases[0] ^ cases[1])} in "
                f"only one of them")
    return ""


def compare(old: dict, new: dict, factor: float = 2.0) -> dict[str, list[Change]]:
    """The changes from ``old`` to ``new``, by kind."""
    before, after = _indexed(old), _indexed(new)
    changes: dict[str, list[Change]] = {"newly failing": [], "newly passing": [],
                                        "claims changed": [], "judgement changed": [],
                                        "errors grown": []}
    for key in sorted(before.keys() & after.keys()):
        was, now = before[key], after[key]
        a, b = was["status"], now["status"]
        if a in PASSING and b in FAILING:
            changes["newly failing"].append(Change(key, a, b, now["message"][:200]))
        elif a in FAILING and b in PASSING:
            changes["newly passing"].append(Change(key, a, b))
        elif (a == Status.UNSUPPORTED) != (b == Status.UNSUPPORTED):
            changes["claims changed"].append(Change(key, a, b, now["message"][:120]))
        elif (a == Status.CANNOT_JUDGE) != (b == Status.CANNOT_JUDGE):
            changes["judgement changed"].append(Change(key, a, b, now["message"][:120]))
        elif a in PASSING and b in PASSING:
            e_old, e_new, budget = (_number(was["error"]), _number(now["error"]),
                                    _number(now["budget"]))
            if e_old is None or e_new is None or not budget:
                continue
            floor = NOISE_FLOOR * budget
            if e_new > floor and e_new / max(e_old, floor) > factor:
                changes["errors grown"].append(Change(
                    key, a, b, f"error {e_old:.3g} -> {e_new:.3g}, budget {budget:.3g}"))
    missing = sorted(before.keys() - after.keys())
    changes["not run in the new report"] = [Change(k, before[k]["status"], "absent")
                                            for k in missing]
    return changes


def render(changes: dict[str, list[Change]], limit: int = 40) -> str:
    lines = []
    for kind, items in changes.items():
        lines.append(f"{kind}: {len(items)}")
        lines += [item.line() for item in items[:limit]]
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more")
    return "\n".join(lines) + "\n"
