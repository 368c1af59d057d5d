"""Where the Triton kernels run (GPU or interpreter) and moving canonical arrays there."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Mode:
    device: str  # "cuda" or "cpu"
    interpreted: bool
    sm_count: int


@cache
def select_mode() -> Mode:
    """GPU when torch sees one, else the interpreter.

    ``@triton.jit`` reads ``TRITON_INTERPRET`` when a function is decorated, and Triton
    decorates its own library (``tl.cdiv``...) on import: so this runs before Triton is
    imported anywhere.
    """
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return Mode("cuda", False, sms)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before the interpreter could be selected; "
                           "set TRITON_INTERPRET=1 in the environment on a machine without a GPU")
    os.environ["TRITON_INTERPRET"] = "1"
    return Mode("cpu", True, 4)


def preload() -> Iterator[None]:
    """torch; then, where Triton will compile for a GPU, the GPU count, Triton's import and its
    cache key, a stage each; where it may be interpreted, not Triton (``select_mode`` must come
    first). The GPUs are counted by NVML, which makes no CUDA context, in a forked child
    (NVML's own thread stays there), and a CUDA_VISIBLE_DEVICES that may hide them all
    imports no Triton. A stage each because on an H100 (torch 2.11, Triton 3.6) the three
    as one left a thread in the zygote, and counting in the zygote itself was the step that
    did (2026-12-07): the zygote keeps the stages before the one that does, and says which."""
    import torch

    yield
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = visible is None or all(d.strip() and not d.strip().startswith("-")
                                   for d in visible.split(","))
    if not (torch.version.cuda and shown
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")):
        return
    from conformance.parallel import gpu_count_apart

    if not gpu_count_apart():
        return
    yield
    from triton.runtime.cache import triton_key

    yield
    triton_key()  # a hash of Triton's own files, once a process


def start_early(mode: Mode) -> None:
    """On a GPU, make the CUDA context and Triton's cache key in threads of their own, now:
    a worker constructs its backend before its first case comes, and the driver's part of
    the context (1.8 s a worker with 16 starting at once on an H100) and the key (0.5 s)
    otherwise wait for that case. Torch's lazy initialisation takes a lock and the key is
    cached, so the first decode waits only for what is left. A failure here is left for
    that decode to meet and report. ``CONFORMANCE_EARLY_CONTEXT=0``: not started."""
    if mode.device != "cuda" or os.environ.get("CONFORMANCE_EARLY_CONTEXT", "1") == "0":
        return
    for name, work in (("CUDA context", _make_context), ("Triton's cache key", _triton_key)):
        threading.Thread(target=_quietly, args=(work,), name=f"early {name}",
                         daemon=True).start()


def _quietly(work) -> None:
    try:
        work()
    except Exception:  # the first decode meets it again and reports it
        pass


def _make_context() -> None:
    import torch

    torch.empty(1, device="cuda")


def _triton_key() -> None:
    from triton.runtime.cache import triton_key

    triton_key()


def unavailable_reason() -> str | None:
    """Why Triton cannot run here, or None."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return f"torch is not importable ({exc}); pip install -e '.[triton]'"
    try:
        select_mode()
    except RuntimeError as exc:
        return str(exc)
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc}); pip install -e '.[triton]'"
    return None


# dtypes NumPy holds through ml_dtypes: torch takes their bytes through a view
