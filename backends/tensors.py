"""NumPy arrays to torch tensors and back, for adapters: every dtype a problem holds.

The problem's bfloat16 and fp8 arrays are ``ml_dtypes`` types, which ``torch.from_numpy``
refuses; they cross as integer views of the same bytes, so no value is rounded on the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

VIEWED = {"bfloat16": np.int16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def to_torch(array: np.ndarray, device: str = "cpu"):
    """A torch tensor with the same values on ``device`` (a copy; the array is not touched)."""
    return to_torch_many({"array": array}, device)["array"]


STAGED_ALIGN = 256  # bytes: where each array of a staged upload starts
DIRECT_BYTES = 1 << 26  # arrays from this size go to a device on their own, unstaged
CHUNK_BYTES = 1 << 27  # a large array goes to a CUDA device in chunks of this size


def to_torch_many(arrays: dict[str, np.ndarray], device: str = "cpu") -> dict:
    """``to_torch`` for several arrays in one host-to-device copy: views, each starting on
    ``STAGED_ALIGN``, of one allocation. On the H200 with 16 workers sharing the GPU, a copy
    per array cost 1.7 ms each, the largest share of a warm ``ci`` run (docs/gpu-results.md):
    each waited for the device. To CUDA the copy now leaves from pinned memory and nothing
    waits for it; the kernels that read the tensors come after it on the same stream.

    An array of ``DIRECT_BYTES`` or more bound for a device goes there on its own (to CUDA in
    pinned chunks, ``_to_cuda``): staging a pool of gigabytes cost a fresh allocation and a
    host copy of it on every call (the ``large-offset`` case's 8.6 GB, about 20 calls),
    against a millisecond saved."""
    import torch

    kind = torch.device(device).type
    direct = {name for name, array in arrays.items() if kind != "cpu"
              and array.nbytes >= DIRECT_BYTES and (kind == "cuda" or array.flags.writeable)}
    offsets, size = {}, 0
    for name, array in arrays.items():
        if name not in direct:
            offsets[name] = size = -(-size // STAGED_ALIGN) * STAGED_ALIGN
            size += array.nbytes
    # to CUDA from pinned memory, without waiting: torch keeps the buffer until the copy is done
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True) if kind == "cuda" else None
    staged = pinned.numpy() if pinned is not None else np.empty(size, dtype=np.uint8)
    for name, array in arrays.items():
        if name not in direct:
            staged[offsets[name]:offsets[name] + array.nbytes] = _flat_bytes(array)
    moved = (pinned.to(device, non_blocking=True) if pinned is not None
             else torch.from_numpy(staged).to(device))
    upload = _to_cuda if kind == "cuda" else lambda data, device: torch.from_numpy(data).to(device)
    return {name: (upload(_flat_bytes(array), device) if name in direct
                   else moved[offsets[name]:offsets[name] + array.nbytes])
            .view(_torch_dtype(array)).view(array.shape) for name, array in arrays.items()}


def _to_cuda(data: np.ndarray, device: str):
    """Bytes to a CUDA device through two pinned buffers in turn, the host copy of one chunk
    (on the CPUs a run leaves idle: ``conformance.bulk``) while the other's goes over the bus.

    ``.to(device)`` from pageable memory ran at 10.6 GB/s on an H100 (the driver stages it on
    one thread), the chunks at 38.6: it had been 27 of the 44 s of the ``large-offset`` case."""
    import torch

    from conformance.bulk import copy_into
    from conformance.tiled_arena import mapped_parts

    parts = mapped_parts(data)
    if parts is not None:
        return _tiled_to_cuda(parts, device)
    out = torch.empty(data.size, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(out.device)
    buffers, done = _pinned_buffers(), [None, None]
    for index, start in enumerate(range(0, data.size, CHUNK_BYTES)):
        end, turn = min(data.size, start + CHUNK_BYTES), index % 2
        if done[turn] is not None:
            done[turn].synchronize()  # its last chunk has left
        copy_into(buffers[turn][1][:end - start], data[start:end])
        out[start:end].copy_(buffers[turn][0][:end - start], non_blocking=True)
        done[turn] = stream.record_event()
    stream.synchronize()
    return out


_PINNED: list = []  # the process's two pinned chunk buffers: (tensor, its NumPy view)


def _tiled_to_cuda(parts, device: str):
    """A pool the worker mapped from its stamp and rows (``conformance.tiled_arena``), built
    on the device from them: what the array holds, since it is those very bytes, for a
    megabyte or two over the bus instead of a whole pool (4.3 GB per K and V in
    ``large-offset``, 17 times a case)."""
    import torch

    out = torch.empty(parts.nbytes, dtype=torch.uint8, device=device)
    stamp = torch.from_numpy(parts.stamp.copy()).to(device)
    whole = parts.nbytes // stamp.numel() * stamp.numel()
    out[:whole].view(-1, stamp.numel()).copy_(stamp.expand(whole // stamp.numel(), -1))
    out[whole:].copy_(stamp[:parts.nbytes - whole])
    if parts.row_ids.size:
        rows = torch.from_numpy(parts.rows.copy()).to(device)
        out.view(-1, rows.shape[1])[torch.from_numpy(parts.row_ids).to(device)] = rows
    return out


def _pinned_buffers() -> list:
    import torch

    if not _PINNED or _PINNED[0][1].size < CHUNK_BYTES:
        _PINNED.clear()
        for _ in range(2):
            tensor = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
            _PINNED.append((tensor, tensor.numpy()))
    return _PINNED


def _flat_bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _torch_dtype(array: np.ndarray):
    import torch

    if array.dtype.name in VIEWED:
        return getattr(torch, array.dtype.name)
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype


def to_numpy(tensor, like: np.ndarray) -> np.ndarray:
    """The tensor's values as a NumPy array of ``like``'s dtype (cast if the dtypes differ)."""
    return to_numpy_many([(tensor, like)])[0]


def to_numpy_many(pairs: Sequence[tuple[Any, np.ndarray]]) -> list[np.ndarray]:
    """``to_numpy`` for several (tensor, like) pairs with one wait for the device: each CUDA
    tensor of less than ``DIRECT_BYTES`` is copied into pinned memory without waiting, then
    the devices' streams are waited for once (a decode's out and LSE: one wait, not two)."""
    import torch

    hosts, devices = [], set()
    for tensor, _ in pairs:
        tensor = tensor.detach()
        if tensor.device.type == "cuda" and tensor.nbytes < DIRECT_BYTES:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            devices.add(tensor.device)
            tensor = host
        hosts.append(tensor)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return [_host_numpy(host.cpu().contiguous(), like)
            for host, (_, like) in zip(hosts, pairs, strict=True)]


def _host_numpy(tensor, like: np.ndarray) -> np.ndarray:
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name in VIEWED:
        values = tensor.view(getattr(torch, np.dtype(VIEWED[name]).name)).numpy().view(
            np.dtype(like.dtype) if like.dtype.name == name else _ml_dtype(name))
        return values.astype(like.dtype, copy=False)
    return tensor.numpy().astype(like.dtype, copy=False)


def _ml_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))
