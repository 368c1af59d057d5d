"""The dtypes a case can name, and their NumPy types (bfloat16 and fp8 through ml_dtypes).

``DTYPES`` are what queries, outputs and an unquantized cache hold; ``FP8_DTYPES`` what a
quantized cache (and an fp8 query) stores as codes, read as ``code * scale``."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

DTYPES: dict[str, type] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}

FP8_DTYPES: dict[str, type] = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,  # no inf; NaN is 0x7f/0xff; finite max 448
    "float8_e5m2": ml_dtypes.float8_e5m2,  # IEEE-like: inf and NaN; finite max 57344
}

SHORT_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16",
               "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}

# How a quantized cache's scales are laid out (docs/design.md §3).
SCALE_MODES = {
    "per-tensor": "one k_scale and one v_scale, arrays of shape (1,)",
    "per-head": "one scale per KV head, shape (num_kv_heads,)",
    "per-token": "one scale per token and KV head, paged like the pages: shape (num_pages, "
                 "page_size, num_kv_heads)",
}


def numpy_dtype(name: str) -> type:
    """The NumPy scalar type for a dtype name of the spec."""
    try:
        return DTYPES[name] if name in DTYPES else FP8_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: "
                         f"{', '.join([*DTYPES, *FP8_DTYPES])}") from None


def dtype_name(dtype: np.dtype | type) -> str:
    """The spec's name for a NumPy dtype."""
    dtype = np.dtype(dtype)
    for name, scalar in {**DTYPES, **FP8_DTYPES}.items():
        if np.dtype(scalar) == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {', '.join([*DTYPES, *FP8_DTYPES])}")


def fp8_max(name: str) -> float:
    """The largest finite value of an fp8 format."""
    return float(ml_dtypes.finfo(FP8_DTYPES[name]).max)


def fp8_smallest_normal(name: str) -> float:
    return float(ml_dtypes.finfo(FP8_DTYPES[name]).smallest_normal)


def quantize(values: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """fp8 codes for ``values / scales``: rounded to nearest even, saturating at the format's
    finite maximum (never NaN or inf from a finite value)."""
    top = fp8_max(name)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.asarray(values, np.float64) / np.asarray(scales, np.float64)
    return np.clip(ratio, -top, top).astype(FP8_DTYPES[name])


_FP8_NUMPY = frozenset(np.dtype(t) for t in FP8_DTYPES.values())


def widened(values: np.ndarray, dtype: type) -> np.ndarray:
    """``values.astype(dtype)`` for a wider float ``dtype``, the same bits: fp8 codes through
    a table of their 256 values, since ml_dtypes converts them an element at a time (5 ns an
    element: a third of a long fp8 case's host time went there)."""
    source = values.dtype
    if source.itemsize == 1 and source in _FP8_NUMPY:
        return _fp8_table(source, np.dtype(dtype))[values.view(np.uint8)]
    return values.astype(dtype)


@functools.cache
def _fp8_table(source: np.dtype, target: np.dtype) -> np.ndarray:
    """What each of the 256 codes of ``source`` converts to, by ml_dtypes' own conversion."""
    return np.arange(256, dtype=np.uint8).view(source).astype(target)
