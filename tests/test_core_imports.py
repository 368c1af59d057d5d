"""The core runs with torch, triton and tvm made unimportable (docs/design.md §2)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "triton", "tvm", "tvm_ffi")

BLOCK_AND_RUN = f"""
import sys
for name in {HEAVY!r}:
    sys.modules[name] = None  # any import of it now raises ImportError
import backends.base, backends.numpy_splitk, backends.registry, conformance.cli, references
from conformance.cli import main
code = main(["run", "--backend", "numpy", "--profile", "smoke"])
loaded = [n for n in {HEAVY!r} if sys.modules.get(n) is not None]
assert not loaded, loaded
sys.exit(code)
"""


def test_core_and_numpy_backend_run_without_torch_triton_tvm():
    result = subprocess.run([sys.executable, "-c", BLOCK_AND_RUN], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no unexpected failures" in result.stdout


def test_the_blocking_really_blocks():
    probe = "import sys; sys.modules['torch'] = None\ntry:\n import torch\nexcept ImportError:\n" \
            " sys.exit(3)"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 3
