"""Where backends come from: built-ins, installed plugins (entry points), module:Class."""

import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from conformance.backends import registry
from conformance.parallel import gpu_environment, xdist_worker_environment

ROOT = Path(__file__).resolve().parents[1]


def test_an_installed_plugin_is_found_through_its_entry_point(monkeypatch):
    plugin = EntryPoint(name="my-kernel", value="tests.planted:WindowOffByOne",
                        group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [plugin] if group == registry.ENTRY_POINT_GROUP else [])
    assert "my-kernel" in registry.known_backends()
    cls = registry.resolve("my-kernel")
    assert cls.__name__ == "WindowOffByOne"
    assert registry.backend_label("my-kernel", cls) == "my-kernel"


def test_builtins_resolve_without_importing_their_dependencies():
    """Every built-in resolves to its class, importing neither torch, Triton nor TVM until
    the class asks (its availability() is what says whether they are there)."""
    code = ("import sys\nfrom backends import registry\n"
            "for name in registry.BUILTINS:\n"
            "    cls = registry.resolve(name)\n"
            "    assert registry.backend_label(name, cls) == name == cls.name, name\n"
            "print(sorted(m for m in ('torch', 'triton', 'tvm', 'flashinfer') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name,fragment", [
    ("nope", "registered:"),
    ("tests.planted:NoSuchClass", "is not a Backend subclass"),
    ("missing/file.py:Backend", "does not exist"),
])
def test_bad_names_say_what_is_valid(name, fragment):
    with pytest.raises(registry.UnknownBackendError, match=fragment):
        registry.resolve(name)


def test_workers_are_spread_one_per_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert [gpu_environment(i)["CUDA_VISIBLE_DEVICES"] for i in range(5)] == \
        ["0", "1", "2", "0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpu_environment(0) == {}  # one GPU: nothing to spread


def test_xdist_workers_are_spread_one_per_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)  # polling: test_polling
    assert xdist_worker_environment() == {"CUDA_VISIBLE_DEVICES": "5"}
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert xdist_worker_environment() == {}  # not under xdist: leave the GPUs alone


def test_choosing_a_gpu_does_not_touch_cuda():
    """CUDA fixes the visible devices when it starts: a worker that asked torch how many GPUs
    there are before choosing its own would stay on all of them (seen with pytest -n on two
    H200s: every worker on GPU 0)."""
    code = ("import sys; from conformance import parallel; parallel.gpu_environment(1);"
            "parallel.xdist_worker_environment(); print('torch' in sys.modules)")
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "False"
