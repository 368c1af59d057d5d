"""Where backends come from: built-ins, installed plugins, or ``module:Class`` on the command line.

Built-ins are imported lazily, so listing them never imports torch, Triton or TVM; a
backend's own ``availability()`` says why it cannot run here.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path

from backends.base import Backend

ENTRY_POINT_GROUP = "paged_decode_conformance.backends"

BUILTINS: dict[str, str] = {
    "numpy": "backends.numpy_splitk:NumpySplitK",
    "triton-paged": "backends.triton.backends:TritonPaged",
    "triton-splitkv": "backends.triton.backends:TritonSplitKV",
    "triton-contiguous": "backends.triton.backends:TritonContiguous",
    "tvm-cpu": "backends.tvm.backends:TvmCpu",
    "tvm-cuda": "backends.tvm.backends:TvmCuda",
}


class UnknownBackendError(ValueError):
    """A backend name that names nothing; the message lists the valid ones."""


def plugin_targets() -> dict[str, str]:
    """Backends registered by installed packages through the entry-point group."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> dict[str, str]:
    """Every registered name and its ``module:Class`` target (built-ins win on a clash)."""
    return {**plugin_targets(), **BUILTINS}


def _import_target(target: str) -> type[Backend]:
    module_name, _, class_name = target.partition(":")
    if not class_name:
        raise UnknownBackendError(f"backend target {target!r} must be 'module:Class'")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.exists():
            raise UnknownBackendError(f"backend file {module_name!r} does not exist")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise UnknownBackendError(f"{target!r}: {class_name!r} is not a Backend subclass in "
                                  f"{module_name!r}")
    return cls


def resolve(name: str) -> type[Backend]:
    """The backend class a name stands for: a registered name, or ``module:Class``."""
    known = known_backends()
    if name in known:
        return _import_target(known[name])
    if ":" in name:
        return _import_target(name)
    raise UnknownBackendError(f"unknown backend {name!r}; registered: {', '.join(sorted(known))}"
                              f" (or give 'module:Class' or 'path/to/file.py:Class')")


def backend_label(name: str, cls: type[Backend]) -> str:
    """The name a backend is reported under: its registered name, else its class's ``name``."""
    return name if name in known_backends() else (cls.name or name)
