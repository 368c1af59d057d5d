"""Running ``python -m conformance`` as a user does, from the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: object, cwd: Path = ROOT, timeout: float = 600,
        **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, **kwargs)
