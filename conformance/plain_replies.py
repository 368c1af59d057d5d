"""Worker to harness: data only. JSON for the structure, arrays as dtype + shape + raw bytes
after it, every part validated before use (``decode_reply``): nothing a backend sends is
executed or unpickled, so it can neither run code in the harness nor forge a verdict."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from conformance.dtypes import DTYPES
from conformance.wire import HEADER, WireError

# dtypes a reply may carry, by name (NumPy's own names; bfloat16 through ml_dtypes)
REPLY_DTYPES: dict[str, np.dtype] = {
    **{name: np.dtype(scalar) for name, scalar in DTYPES.items()},
    **{name: np.dtype(name) for name in ("float64", "int64", "int32", "int16", "int8", "uint8",
                                         "bool")},
}




def encode_reply(value: Any) -> bytes:
    """JSON for the structure, arrays as raw bytes after it; only plain data is accepted."""
    buffers: list[bytes] = []

    def plain(item: Any) -> Any:
        if item is None or isinstance(item, (bool, str)):
            return item
        if isinstance(item, (int, float)):
            return item
        if isinstance(item, np.generic) and not isinstance(item, np.void):
            return plain(item.item())
        if isinstance(item, np.ndarray):
            name = dtype_name(item.dtype)
            buffers.append(np.ascontiguousarray(item).tobytes())
            return {"__array__": len(buffers) - 1, "dtype": name, "shape": list(item.shape)}
        if isinstance(item, (list, tuple)):
            return [plain(x) for x in item]
        if isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                raise TypeError("a reply's dict keys must be strings")
            return {k: plain(v) for k, v in item.items()}
        raise TypeError(f"a reply cannot carry {type(item).__name__} (plain data and NumPy "
                        f"arrays only)")

    header = json.dumps({"value": plain(value), "sizes": [len(b) for b in buffers]}).encode()
    return HEADER.pack(len(header)) + header + b"".join(buffers)


def dtype_name(dtype: np.dtype) -> str:
    for name, known in REPLY_DTYPES.items():
        if dtype == known:
            return name
    raise TypeError(f"a reply cannot carry arrays of dtype {dtype}")


def decode_reply(payload: bytes) -> Any:
    """The value ``encode_reply`` made, validated; ``WireError`` for anything else."""
    try:
        (length,) = HEADER.unpack_from(payload)
        header = json.loads(payload[HEADER.size:HEADER.size + length])
    except (struct.error, ValueError, RecursionError) as exc:
        raise WireError(f"the reply is not a data frame ({type(exc).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"value", "sizes"}:
        raise WireError("the reply's header is not {value, sizes}")
    sizes = header["sizes"]
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise WireError("the reply's array sizes are not non-negative integers")
    body = memoryview(payload)[HEADER.size + length:]
    if sum(sizes) != len(body):
        raise WireError(f"the reply announces {sum(sizes)} bytes of arrays and carries "
                        f"{len(body)}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def build(item: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise WireError("the reply is nested too deeply")
        if isinstance(item, list):
            return [build(x, depth + 1) for x in item]
        if isinstance(item, dict):
            if "__array__" in item:
                return array_of(item)
            return {k: build(v, depth + 1) for k, v in item.items()}
        return item

    def array_of(spec: dict) -> np.ndarray:
        index, name, shape = spec.get("__array__"), spec.get("dtype"), spec.get("shape")
        if set(spec) != {"__array__", "dtype", "shape"} or not isinstance(index, int) \
                or not 0 <= index < len(sizes):
            raise WireError(f"a malformed array in the reply: {str(spec)[:200]}")
        if name not in REPLY_DTYPES:
            raise WireError(f"an array of dtype {str(name)[:40]!r} in the reply; allowed: "
                            f"{', '.join(REPLY_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise WireError(f"an array of shape {str(shape)[:80]} in the reply")
        dtype = REPLY_DTYPES[name]
        if math.prod(shape) * dtype.itemsize != sizes[index]:
            raise WireError(f"an array of shape {shape} and dtype {name} carries "
                            f"{sizes[index]} bytes")
        data = body[starts[index]:starts[index] + sizes[index]]
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()

    return build(header["value"])
