"""Expectation manifests: known deviations of a backend, each with a reason.

``expectations/<backend>.toml`` holds ``[[expect]]`` entries with ``case`` and ``check``
patterns (``*`` and ``?`` wildcards, whole-string), a ``reason`` and an optional
``link``, an optional ``except`` (case patterns the entry leaves out) and an optional
``device`` ("cpu" or "cuda": the entry holds only where the
backend runs there, for kernels whose behaviour differs by device). A listed failure is a
``known-failure``; a listed check that passes is an ``unexpected-pass`` and fails the run
until the entry is removed; an entry that matches nothing is *stale*.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from conformance import expectations
from conformance.inputs import read_text
from conformance.status import BROKEN, Status

EXPECTATIONS_DIR = Path(expectations.__file__).resolve().parent  # shipped in the wheel too
_KEYS = {"case", "check", "reason", "link", "device", "except"}
DEVICES = ("cpu", "cuda")


class ManifestError(ValueError):
    """A manifest entry that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class Expectation:
    case: str
    check: str
    reason: str
    link: str = ""
    line: int = 0
    device: str = ""  # "" for every device
    excluded: tuple[str, ...] = ()  # case patterns the entry leaves out

    def matches(self, case_id: str, check: str, device: str | None = None) -> bool:
        if self.device and device is not None and self.device != device:
            return False
        if any(glob_match(pattern, case_id) for pattern in self.excluded):
            return False
        return glob_match(self.case, case_id) and (
            glob_match(self.check, check) or glob_match(self.check, check.split("/", 1)[0]))


def glob_match(pattern: str, text: str) -> bool:
    """Whole-string match where ``*`` and ``?`` are wildcards; brackets are literal, as
    case ids hold them (``ctx[0,17]``)."""
    regex = re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".")
    return re.fullmatch(regex, text) is not None


@dataclass
class Manifest:
    backend: str
    entries: list[Expectation] = field(default_factory=list)
    path: Path | None = None

    def lookup(self, case_id: str, check: str, device: str | None = None) -> Expectation | None:
        return next((e for e in self.entries if e.matches(case_id, check, device)), None)

    def stale(self, checked: list[tuple[str, str]], device: str | None = None
              ) -> list[Expectation]:
        """Entries that match none of the (case id, check) pairs a run produced."""
        return [e for e in self.entries
                if not any(e.matches(case_id, check, device) for case_id, check in checked)]

    def placeholders(self) -> list[Expectation]:
        return [e for e in self.entries if e.reason == PLACEHOLDER]


def _entry_lines(text: str) -> list[int]:
    return [number for number, line in enumerate(text.splitlines(), start=1)
            if line.strip() == "[[expect]]"]


def load_manifest(backend: str, directory: Path | None = None) -> Manifest:
    """The manifest of a backend, or an empty one when it has no file."""
    path = (directory or EXPECTATIONS_DIR) / f"{backend}.toml"
    if not path.exists():
        return Manifest(backend)
    text = read_text(path, "expectation manifest")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"expect"}
    if unknown:
        raise ManifestError(f"{path}: unknown top-level key(s) {sorted(unknown)}; entries go in "
                            f"[[expect]] tables")
    listed = data.get("expect", [])
    if not isinstance(listed, list) or not all(isinstance(raw, dict) for raw in listed):
        raise ManifestError(f"{path}: 'expect' must be an array of tables ([[expect]], each "
                            f"with case, check and reason), got {str(listed)[:80]}")
    lines = _entry_lines(text)
    entries = []
    for index, raw in enumerate(listed):
        line = lines[index] if index < len(lines) else 0
        where = f"{path}:{line} (entry {index + 1})"
        bad = set(raw) - _KEYS
        if bad:
            raise ManifestError(f"{where}: unknown field(s) {sorted(bad)}; known: "
                                f"{', '.join(sorted(_KEYS))}")
        for key in ("case", "check", "reason"):
            value = raw.get(key)
            if not isinstance(value, str) or not value.strip():
                raise ManifestError(f"{where}: field {key!r} must be a non-empty string, "
                                    f"got {value!r}")
        device = raw.get("device", "")
        if device not in ("", *DEVICES):
            raise ManifestError(f"{where}: field 'device' must be one of {', '.join(DEVICES)}, "
                                f"got {device!r}")
        excluded = raw.get("except", [])
        if not isinstance(excluded, list) or not all(isinstance(p, str) and p for p in excluded):
            raise ManifestError(f"{where}: field 'except' must be a list of case patterns, got "
                                f"{excluded!r}")
        entries.append(Expectation(raw["case"], raw["check"], raw["reason"],
                                   raw.get("link", ""), line, device, tuple(excluded)))
    return Manifest(backend, entries, path)


def apply(manifest: Manifest, case_id: str, checks: list[tuple[str, str]],
          device: str | None = None) -> list[tuple[str, str]]:
    """Statuses after the manifest for one case's ``(check, status)`` pairs, with notes.

    An entry turns the failures it matches into ``known-failure``. If everything it matches
    in this group passed, those passes are ``unexpected-pass``: the entry is out of date.
    """
    entries = [manifest.lookup(case_id, check, device) for check, _ in checks]
    failing_entries = {id(entry) for entry, (_, status) in zip(entries, checks, strict=True)
                       if entry is not None and status in BROKEN}
    results = []
    for entry, (_, status) in zip(entries, checks, strict=True):
        if entry is None:
            results.append((status, ""))
        elif status in BROKEN:
            results.append((Status.KNOWN_FAILURE, entry.reason))
        elif status == Status.PASSED and id(entry) not in failing_entries:
            where = f"{manifest.path}:{entry.line}" if manifest.path else "the manifest"
            results.append((Status.UNEXPECTED_PASS, f"listed as known ({entry.reason}) but passed: "
                                               f"remove or narrow the entry at {where}"))
        else:
            results.append((status, ""))
    return results


PLACEHOLDER = "TODO: say why this fails, and link the upstream issue"


def append_entries(manifest: Manifest, failures: list[tuple[str, str]], directory: Path,
                   note: str) -> Path:
    """Append an entry per (case id, check) to the backend's manifest, with the placeholder
    reason; the entries are printed by the caller, and --strict-manifest fails until each
    placeholder is replaced."""
    path = manifest.path or directory / f"{manifest.backend}.toml"
    lines = [f"\n# {note}"]
    for case_id, check in failures:
        lines += ["[[expect]]", f"case = {_toml_string(case_id)}", f"check = {_toml_string(check)}",
                  f"reason = {_toml_string(PLACEHOLDER)}", ""]
    with path.open("a") as handle:
        handle.write("\n".join(lines))
    return path


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
