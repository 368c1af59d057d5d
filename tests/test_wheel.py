"""A built wheel works from anywhere: the spec, bench shapes and manifests travel with it, and
pytest finds the plugin through its ``pytest11`` entry point."""

from __future__ import annotations

import subprocess
import sys
import venv

import pytest

from tests.run_cli import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv (seeing this interpreter's packages for numpy and the rest) with the wheel."""
    where = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(where), str(ROOT)], check=True, capture_output=True,
                   timeout=300)
    wheel = next(where.glob("paged_decode_conformance-*.whl"))
    env_dir = where / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True,
                   timeout=300)
    outside = where / "elsewhere"
    outside.mkdir()
    return python, outside


def run_there(installed, *args):
    python, outside = installed
    # a clean environment: nothing may be found through the source tree
    env = {"PATH": "/usr/bin:/bin", "HOME": str(outside)}
    return subprocess.run([str(python), *args], cwd=outside, capture_output=True, text=True,
                          timeout=600, env=env)


def test_the_installed_suite_runs_from_another_directory(installed):
    where = run_there(installed, "-c", "import conformance, expectations; "
                                       "print(conformance.__file__, expectations.__file__)")
    assert where.returncode == 0 and str(ROOT) not in where.stdout, where.stdout + where.stderr
    result = run_there(installed, "-m", "conformance", "run", "--backend", "numpy", "--profile",
                       "smoke")
    assert result.returncode == 0 and "no unexpected failures" in result.stdout, result.stderr
    bench = run_there(installed, "-m", "conformance", "bench", "--backend", "numpy", "--shapes",
                      "cpu", "--rounds", "1")
    assert bench.returncode == 0 and "numpy" in bench.stdout, bench.stderr
    manifests = run_there(installed, "-c", "from conformance.manifest import load_manifest; "
                                           "print(len(load_manifest('tvm-cpu').entries))")
    assert manifests.returncode == 0 and int(manifests.stdout) > 0, manifests.stderr


def test_pytest_finds_the_plugin_through_its_entry_point(installed):
    result = run_there(installed, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                       "conformance", "--backend", "numpy", "--profile", "smoke",
                       "--check-family", "oracle")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "16 passed" in result.stdout
