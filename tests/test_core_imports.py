"""The core runs with torch, triton and tvm made unimportable (docs/design.md §2): in the
harness and in the worker processes that run the backend alike."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "triton", "tvm", "tvm_ffi")

# imported at the start of every Python process that has this folder on its path: the CLI
# and each worker it starts (a worker's path is the harness's)
BLOCK = f"""
import sys
for name in {HEAVY!r}:
    sys.modules[name] = None  # any import of it now raises ImportError
"""


def blocked_run(tmp_path, *code_lines):
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    return subprocess.run([sys.executable, "-c", "\n".join(code_lines)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT}"})


def test_core_and_numpy_backend_run_without_torch_triton_tvm(tmp_path):
    result = blocked_run(
        tmp_path, "import sys", "from conformance.cli import main",
        "code = main(['run', '--backend', 'numpy', '--profile', 'smoke', '-j', '2'])",
        f"loaded = [n for n in {HEAVY!r} if sys.modules.get(n) is not None]",
        "assert not loaded, loaded", "sys.exit(code)")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no unexpected failures" in result.stdout


def test_the_blocking_really_blocks_in_workers_too(tmp_path):
    # a backend that imports torch fails in its worker: the block reached it
    (tmp_path / "needs_torch.py").write_text(
        "from conformance.backends.numpy_splitk import NumpySplitK\n\n"
        "class NeedsTorch(NumpySplitK):\n    name = 'needs-torch'\n\n"
        "    def decode(self, problem, out, lse, *, num_splits=None):\n"
        "        import torch  # noqa: F401\n"
        "        super().decode(problem, out, lse, num_splits=num_splits)\n")
    result = blocked_run(
        tmp_path, "import sys", "from conformance.cli import main",
        f"sys.exit(main(['run', '--backend', '{tmp_path}/needs_torch.py:NeedsTorch', "
        "'--profile', 'smoke', '--check', 'oracle', '-k', 'sinks/']))")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "import of torch halted" in result.stdout
