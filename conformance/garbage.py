"""What the slots no sequence reads hold: garbage far from any answer, or NaN.

A kernel that reads a slot it must not meets values that move its output past every budget
(``garbage``), or NaN that reaches its output (``nan``: the poison family's masked-NaN
problem). A layout (``conformance.materialise``) fills its whole pool with one of them, then
writes the sequences' tokens over it.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from conformance.bulk import tiled_pool
from conformance.case import GARBAGE_CHUNK  # at most this many garbage elements made
from conformance.dtypes import dtype_name, quantize
from conformance.variants import Quantization

MASKED_FILLS = ("garbage", "nan")
GARBAGE_SCORE = 20.0  # standard deviation of a garbage key's score against a normal query
GARBAGE_VALUE = 1000.0  # magnitude of a garbage value (an fp8 cache saturates it)
GARBAGE_BANK_SEED = 0x6A7BA6E  # the process's garbage values (``_garbage_bank``)


def unread_pages(masked: str, rng: np.random.Generator, shape: tuple[int, ...], dtype: type,
                 sm_scale: float, quant: Quantization | None) -> tuple[np.ndarray, np.ndarray]:
    """K and V pools of ``shape`` ``(pages, page_size, kv_heads, head_dim)`` filled as
    ``masked`` says."""
    if masked not in MASKED_FILLS:
        raise ValueError(f"masked fill {masked!r}; known: {', '.join(MASKED_FILLS)}")
    if masked == "nan":
        return _nan_pages(shape, dtype)
    return _garbage(rng, shape, dtype, GARBAGE_SCORE / (math.sqrt(shape[-1]) * sm_scale), quant)


def _nan_pages(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Pages of NaN; an e5m2 cache's keys hold +inf instead (the format has one, e4m3fn not)."""
    def filled(value: float) -> np.ndarray:
        return tiled_pool(shape, dtype, np.full((1, *shape[1:]), value, dtype=dtype))
    return filled(np.inf if dtype_name(dtype) == "float8_e5m2" else np.nan), filled(np.nan)


def _garbage(rng: np.random.Generator, shape: tuple[int, ...], dtype: type, key_scale: float,
             quant: Quantization | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Garbage K (normal, scores of ~``GARBAGE_SCORE``) and V (+-``GARBAGE_VALUE``) pages;
    in a quantized cache, codes for them at the scale of a slot nothing reads (saturating).

    At most ``GARBAGE_CHUNK`` elements of each are made; a larger pool repeats them (a pool
    of 2^32 elements would take minutes to draw, and garbage needs no more variety than a
    wrong page meeting values far off the answer). They are a window, at offsets ``rng``
    draws, of values drawn once per process (``_garbage_bank``); a pool that repeats them
    takes the window at the bank's start, so that every such layout of a geometry holds the
    same garbage and a layout over memory that held the one before finds it there
    already (``bulk._overwrite``)."""
    pages = max(1, min(shape[0], GARBAGE_CHUNK // max(1, math.prod(shape[1:]))))
    drawn = (pages, *shape[1:])
    k_raw, v_raw = _garbage_values(rng if pages == shape[0] else None, drawn)
    k_block, v_block = k_raw * np.float32(key_scale), v_raw * np.float32(GARBAGE_VALUE)
    if quant is None:
        k_block, v_block = k_block.astype(dtype), v_block.astype(dtype)
    else:
        k_block = quantize(k_block, quant.k_fill[:, None], quant.dtype)
        v_block = quantize(v_block, quant.v_fill[:, None], quant.dtype)
    if pages == shape[0]:
        return k_block, v_block
    return tiled_pool(shape, dtype, k_block), tiled_pool(shape, dtype, v_block)


def _garbage_values(rng: np.random.Generator | None, shape: tuple[int, ...]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Standard normals and random signs (float32) of ``shape``: windows of the bank at two
    offsets (``rng``'s, or its start), or (a page larger than the bank's window) drawn here."""
    count = math.prod(shape)
    if count > GARBAGE_CHUNK:
        return _drawn(rng or np.random.default_rng(GARBAGE_BANK_SEED + 1), shape)
    normals, signs = _garbage_bank()
    k_at, v_at = (0, 0) if rng is None else (
        int(i) for i in rng.integers(0, GARBAGE_CHUNK, size=2))
    return (normals[k_at:k_at + count].reshape(shape), signs[v_at:v_at + count].reshape(shape))


@functools.cache
def _garbage_bank() -> tuple[np.ndarray, np.ndarray]:
    """Twice ``GARBAGE_CHUNK`` normals and signs, drawn once per process: drawing them for
    every layout (17 per case) was a sixth of a NumPy ``ci`` run."""
    return _drawn(np.random.default_rng(GARBAGE_BANK_SEED), (2 * GARBAGE_CHUNK,))


def _drawn(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal(shape, dtype=np.float32),
            np.where(rng.random(shape) < 0.5, np.float32(-1), np.float32(1)))
