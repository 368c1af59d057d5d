"""The dtypes a case can name, and their NumPy types (bfloat16 through ml_dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES: dict[str, type] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}

SHORT_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def numpy_dtype(name: str) -> type:
    """The NumPy scalar type for a dtype name of the spec."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def dtype_name(dtype: np.dtype | type) -> str:
    """The spec's name for a NumPy dtype."""
    dtype = np.dtype(dtype)
    for name, scalar in DTYPES.items():
        if np.dtype(scalar) == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {', '.join(DTYPES)}")
