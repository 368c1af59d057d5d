"""How the harness reads what a backend's calls send back: each plain-data reply checked
against its call's contract before anything uses it (a violation is ``ContractError``, a
failed check of the backend)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.backends.base import AttentionState
from conformance.worker import ContractError


def check_merged(backend_name: str, a: AttentionState, out: np.ndarray,
                 lse: np.ndarray) -> AttentionState:
    """The merged state, if its shapes and dtypes are the contract's; else the violation."""
    problems = []
    if out.shape != a.out.shape:
        problems.append(f"output shape {out.shape}, want {a.out.shape}")
    if out.dtype != a.out.dtype:
        problems.append(f"output dtype {out.dtype}, want {a.out.dtype}")
    if lse.shape != a.lse.shape:
        problems.append(f"lse shape {lse.shape}, want {a.lse.shape}")
    if lse.dtype != np.float32:
        problems.append(f"lse dtype {lse.dtype}, want float32")
    if problems:
        raise ContractError(f"{backend_name}'s merge returned a state with "
                            f"{'; '.join(problems)}")
    return AttentionState(out=out, lse=lse)


def merged_arrays(label: str, value: Any) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(value, dict) and set(value) == {"out", "lse"}
            and all(isinstance(v, np.ndarray) for v in value.values())):
        raise ContractError(f"{label}'s merge sent back {str(value)[:120]}, not an output and "
                            f"an LSE array")
    return value["out"], value["lse"]


def _reply_of(kind: type | tuple[type, ...], what: str) -> Callable[[str, Any], Any]:
    def check(label: str, value: Any) -> Any:
        if not isinstance(value, kind):
            raise ContractError(f"{label}'s {what} sent back {str(value)[:120]!r}")
        return value
    return check


def _notes_reply(label: str, value: Any) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ContractError(f"{label}'s notes sent back {str(value)[:120]!r}, not lines")
    return value


# How the harness reads each call's plain-data reply before anything else uses it.
REPLIES: dict[str, Callable[[str, Any], Any]] = {
    "unsupported_reason": _reply_of((str, type(None)), "unsupported_reason"),
    "notes": _notes_reply,
    "device": _reply_of(str, "device"),
    "timing_device": _reply_of(list, "timing_device"),
    "bench": _reply_of(dict, "bench"),
    "decode": _reply_of(type(None), "decode"),
    "merges": lambda label, value: value,  # read by merges itself
}
