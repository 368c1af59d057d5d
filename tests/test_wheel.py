"""A built wheel works from anywhere: the spec, bench shapes and manifests travel with it, and
pytest finds the plugin through its ``pytest11`` entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from conformance.spec import default_spec
from tests.run_cli import ROOT

SOURCE_FOLDERS = ("conformance", "backends", "references", "expectations")


def running_site_packages() -> list[str]:
    """Where this interpreter finds its packages: the virtual environment the suite was
    installed into, or the system's. Not the base interpreter's, which a venv made with
    ``system_site_packages`` would see instead (and where numpy or ml_dtypes may be missing)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with the wheel, seeing the running environment's packages for numpy and the
    rest: added as plain paths, so the editable install of the source tree (a ``.pth`` hook
    there) is not."""
    where = tmp_path_factory.mktemp("wheel")
    # built from a copy of what the wheel is made of: setuptools builds in the tree and keeps
    # what an earlier build left in build/, which a wheel would then carry
    source = where / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in SOURCE_FOLDERS:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(where), str(source)], check=True, capture_output=True,
                   timeout=300)
    wheel = next(where.glob("paged_decode_conformance-*.whl"))
    inside = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in inside}
    assert {t for t in top if not t.endswith(".dist-info")} == {"conformance"}, top
    # every package of the tree is in it (pyproject lists them, mapped under `conformance`)
    packages = {str(p.parent.relative_to(ROOT)) for folder in SOURCE_FOLDERS
                for p in (ROOT / folder).rglob("__init__.py")}
    missing = {p for p in packages if (p if p.startswith("conformance") else
                                       f"conformance/{p}") + "/__init__.py" not in inside}
    assert not missing, f"pyproject.toml's packages leave out {sorted(missing)}"
    env_dir = where / "venv"
    venv.create(env_dir, system_site_packages=False, with_pip=False)
    python = env_dir / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    Path(own, "running-environment.pth").write_text("\n".join(running_site_packages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True,
                   timeout=300)
    outside = where / "elsewhere"
    outside.mkdir()
    return python, outside


def run_there(installed, *args, cwd: Path | None = None):
    python, outside = installed
    # a clean environment: nothing may be found through the source tree
    env = {"PATH": "/usr/bin:/bin", "HOME": str(outside)}
    return subprocess.run([str(python), *args], cwd=cwd or outside, capture_output=True,
                          text=True, timeout=600, env=env)


def test_the_installed_suite_runs_from_another_directory(installed):
    where = run_there(installed, "-c", "import conformance.expectations as e, conformance as c; "
                                       "print(c.__file__, e.__file__)")
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
                       "conformance", "--conformance-backend", "numpy",
                       "--conformance-profile", "smoke", "--conformance-check", "oracle")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"{len(default_spec().cases('smoke'))} passed" in result.stdout


def test_a_project_with_packages_of_the_same_names_keeps_them(installed, tmp_path):
    # a user's project whose own `backends`, `references` and `expectations` come first on the
    # path: the suite's are installed under `conformance`, so neither shadows the other
    for name in ("backends", "references", "expectations"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"OWNER = 'the project: {name}'\n")
    both = run_there(installed, "-c", "import backends, references, expectations; "
                     "from conformance.backends.registry import resolve; "
                     "from conformance.manifest import load_manifest; "
                     "print(backends.OWNER, references.OWNER, expectations.OWNER); "
                     "print(resolve('numpy').__module__, len(load_manifest('tvm-cpu').entries))",
                     cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    ours, theirs = both.stdout.splitlines()[1], both.stdout.splitlines()[0]
    assert theirs.count("the project") == 3
    assert ours.split()[0] == "conformance.backends.numpy_splitk" and int(ours.split()[1]) > 0
    run = run_there(installed, "-m", "conformance", "run", "--backend", "numpy", "--profile",
                    "smoke", "--check", "oracle", cwd=tmp_path)
    assert run.returncode == 0 and "no unexpected failures" in run.stdout, run.stderr
