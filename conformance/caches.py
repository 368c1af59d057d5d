"""Where the backends' compile caches live: under one folder, so that a CI job keeps Triton's,
Inductor's and FlashInfer's compiled kernels with one cache step (docs/ci/conformance.yml)
and a first run's compiles are paid once per machine, not once per job.

The folders are set in this process's environment before any backend loads; every worker
inherits them. Python's own bytecode joins them where the libraries' is not kept beside them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from conformance.inputs import InputError

# each library's own variable for its cache, and the sub-folder it gets
CACHE_VARIABLES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor",
                   "FLASHINFER_WORKSPACE_BASE": "flashinfer"}


def default_cache_dir() -> Path:
    """The user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``), ours in it."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "paged-decode-conformance"


def use_cache_dir(path: Path | None) -> dict[str, str]:
    """Point every compile cache under ``path``; with None, under the default folder, keeping
    any variable the user set. A named folder that cannot be made is refused; the default one
    is skipped (each library keeps its own default). Returns the variables now set."""
    root = default_cache_dir() if path is None else path
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if path is not None:
            raise InputError(f"--cache-dir {str(path)!r}: cannot make it ({exc.strerror})"
                             ) from None
        return {}
    if path is not None and not os.access(root, os.W_OK):
        raise InputError(f"--cache-dir {str(path)!r}: not writable")
    for variable, folder in CACHE_VARIABLES.items():
        if path is not None or variable not in os.environ:
            os.environ[variable] = str(root / folder)
    chosen = {variable: os.environ[variable] for variable in CACHE_VARIABLES}
    if "PYTHONPYCACHEPREFIX" not in os.environ and not libraries_bytecode_kept():
        os.environ["PYTHONPYCACHEPREFIX"] = str(root / "python")
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the workers' bytecode goes there
        chosen["PYTHONPYCACHEPREFIX"] = os.environ["PYTHONPYCACHEPREFIX"]
    return chosen


def libraries_bytecode_kept() -> bool:
    """Whether the bytecode of the heaviest library a worker imports is kept beside it (pip
    writes it on install). Where it is not (an image installed with PYTHONDONTWRITEBYTECODE),
    every fresh worker compiled torch's modules from source: 2.7 s a worker, and a warm GPU
    ci run 1.25x slower (docs/gpu-results.md, 2026-12-06)."""
    for name in ("torch", "numpy"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            return os.path.exists(importlib.util.cache_from_source(spec.origin))
    return True
