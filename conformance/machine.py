"""What a run ran on: recorded with every report and accuracy baseline, compared when a
baseline is used (as pytest-benchmark does for its saved runs)."""

from __future__ import annotations

import platform
from importlib import metadata

# The distributions whose versions can change a kernel's numbers.
LIBRARIES = ("numpy", "ml_dtypes", "torch", "triton", "apache-tvm", "flashinfer-python")


def describe() -> dict[str, object]:
    """Platform, Python and the installed versions of the libraries (read from their
    metadata: nothing is imported)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "libraries": versions}


def differences(before: dict, now: dict) -> list[str]:
    """How ``now`` differs from ``before``, one line per difference."""
    lines = [f"{key}: {before.get(key)!r} then, {now.get(key)!r} now"
             for key in ("platform", "machine", "python") if before.get(key) != now.get(key)]
    old, new = before.get("libraries", {}), now.get("libraries", {})
    lines += [f"{name}: {old.get(name, 'absent')} then, {new.get(name, 'absent')} now"
              for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
    return lines
