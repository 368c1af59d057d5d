"""NumPy arrays to torch tensors and back, for adapters: every dtype a problem holds.

The problem's bfloat16 and fp8 arrays are ``ml_dtypes`` types, which ``torch.from_numpy``
refuses; they cross as integer views of the same bytes, so no value is rounded on the way.
"""

from __future__ import annotations

import numpy as np

VIEWED = {"bfloat16": np.int16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def to_torch(array: np.ndarray, device: str = "cpu"):
    """A torch tensor with the same values on ``device`` (a copy; the array is not touched)."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype.name in VIEWED:
        return torch.from_numpy(array.view(VIEWED[array.dtype.name]).copy()).view(
            getattr(torch, array.dtype.name)).to(device)
    return torch.from_numpy(array.copy()).to(device)


def to_numpy(tensor, like: np.ndarray) -> np.ndarray:
    """The tensor's values as a NumPy array of ``like``'s dtype (cast if the dtypes differ)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    name = str(tensor.dtype).removeprefix("torch.")
    if name in VIEWED:
        values = tensor.view(getattr(torch, np.dtype(VIEWED[name]).name)).numpy().view(
            np.dtype(like.dtype) if like.dtype.name == name else _ml_dtype(name))
        return values.astype(like.dtype, copy=False)
    return tensor.numpy().astype(like.dtype, copy=False)


def _ml_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))
