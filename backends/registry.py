"""Where backends come from: built-ins, installed plugins, or ``module:Class`` on the command line.

Built-ins are imported lazily, so listing them never imports torch, Triton or TVM; a
backend's own ``availability()`` says why it cannot run here.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import traceback
from importlib.metadata import entry_points
from pathlib import Path

from conformance.backends.base import Backend

ENTRY_POINT_GROUP = "paged_decode_conformance.backends"

BUILTINS: dict[str, str] = {
    "numpy": "conformance.backends.numpy_splitk:NumpySplitK",
    "triton-paged": "conformance.backends.triton.backends:TritonPaged",
    "triton-splitkv": "conformance.backends.triton.backends:TritonSplitKV",
    "triton-contiguous": "conformance.backends.triton.backends:TritonContiguous",
    "triton-mla": "conformance.backends.triton.backends:TritonMla",
    "tvm-cpu": "conformance.backends.tvm.backends:TvmCpu",
    "tvm-cuda": "conformance.backends.tvm.backends:TvmCuda",
    "torch-flex": "conformance.backends.torch.backends:TorchFlex",
    "torch-sdpa": "conformance.backends.torch.backends:TorchSdpa",
    "flashinfer": "conformance.backends.flashinfer.backends:FlashInferDecode",
    "flashinfer-tc": "conformance.backends.flashinfer.backends:FlashInferTensorCores",
    "flashinfer-prefill": "conformance.backends.flashinfer.backends:FlashInferPrefill",
    "flashinfer-mla": "conformance.backends.flashinfer.backends:FlashInferMla",
}


class UnknownBackendError(ValueError):
    """A backend name that names nothing or cannot be loaded; the message says which and why."""


# Names become report keys and file names (expectations/<name>.toml): keep them plain.
MAX_NAME = 64
SAFE_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._+-]{{0,{MAX_NAME - 1}}}")


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
    try:
        module = _import_module(module_name)
    except UnknownBackendError:
        raise
    except Exception as exc:  # the backend's own module failed: say where, not a traceback
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise UnknownBackendError(f"backend {target!r} failed to import: {type(exc).__name__}: "
                                  f"{exc} (at {frame.filename}:{frame.lineno})") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise UnknownBackendError(f"{target!r}: {class_name!r} is not a Backend subclass in "
                                  f"{module_name!r}")
    return cls


def _import_module(module_name: str):
    if not module_name.endswith(".py"):
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise UnknownBackendError(f"no module named {module_name!r}") from None
            raise
    path = Path(module_name).resolve()
    if not path.is_file():
        raise UnknownBackendError(f"backend file {module_name!r} does not exist")
    loaded = sys.modules.get(path.stem)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded  # once a process, as an installed module is (a forked worker's too)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


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
    """The name a backend is reported under: its registered name, else the ``name`` its class
    sets itself. A class that would borrow another backend's identity is refused."""
    known = known_backends()
    if name in known:
        label = name
    else:
        own = cls.__dict__.get("name", "")
        if not own:
            inherited = f" (it would be reported as {cls.name!r}, inherited)" if cls.name else ""
            raise UnknownBackendError(f"backend {name!r}: class {cls.__name__} does not set its "
                                      f"own `name`{inherited}; give it one")
        if own in known:
            raise UnknownBackendError(f"backend {name!r}: its name {own!r} is a registered "
                                      f"backend's; choose another")
        label = own
    if not isinstance(label, str) or not SAFE_NAME.fullmatch(label):
        raise UnknownBackendError(f"backend {name!r}: name {str(label)[:80]!r} must be letters, "
                                  f"digits and . _ + - (starting with a letter or digit, at "
                                  f"most {MAX_NAME} characters)")
    return label


def availability_reason(cls: type[Backend]) -> str | None:
    """None when the backend can run here, else why not; a probe that breaks its contract
    (raises, or returns something other than None or a reason) says so."""
    try:
        reason = cls.availability()
    except Exception as exc:
        return f"availability() raised {type(exc).__name__}: {exc}"
    if reason is None:
        return None
    if isinstance(reason, str) and reason.strip():
        return reason
    return f"availability() returned {reason!r}; it must return None (available) or a reason"
