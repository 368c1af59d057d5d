"""The adapter API's NumPy <-> torch conversion: every dtype a problem holds, bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the conversion's other side")

from conformance.backends import tensors  # noqa: E402
from conformance.backends.tensors import (  # noqa: E402
    DIRECT_BYTES,
    to_numpy,
    to_numpy_many,
    to_torch,
    to_torch_many,
)

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, np.int32]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_problem_dtype_goes_to_torch_and_back_bit_for_bit(dtype):
    values = np.random.default_rng(0).standard_normal((3, 5)) * 100
    array = values.astype(dtype)
    kept = array.copy()
    tensor = to_torch(array[:, ::2])  # a strided view as well
    assert str(tensor.dtype) == f"torch.{np.dtype(dtype).name}"
    back = to_numpy(tensor, array)
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back.view(np.uint8), np.ascontiguousarray(
        array[:, ::2]).view(np.uint8))
    np.testing.assert_array_equal(array.view(np.uint8), kept.view(np.uint8))  # untouched
    tensor.fill_(0)
    np.testing.assert_array_equal(array.view(np.uint8), kept.view(np.uint8))  # a copy


def test_a_torch_result_lands_in_the_dtype_of_the_buffer_it_is_written_to():
    out = np.zeros(4, dtype=ml_dtypes.bfloat16)
    result = torch.tensor([1.0, 2.5, -3.0, 0.1], dtype=torch.float32)
    np.testing.assert_array_equal(to_numpy(result, out).astype(np.float32),
                                  np.array([1.0, 2.5, -3.0, 0.1]).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32))
    e4m3 = torch.tensor([448.0, -2.0]).to(torch.float8_e4m3fn)
    assert to_numpy(e4m3, np.zeros(2, np.float32)).tolist() == [448.0, -2.0]


def test_plain_from_numpy_is_what_it_replaces():
    with pytest.raises(TypeError):
        torch.from_numpy(np.zeros(2, dtype=ml_dtypes.bfloat16))


def test_several_arrays_go_in_one_copy_each_its_own_view_bit_for_bit():
    rng = np.random.default_rng(1)
    arrays = {np.dtype(d).name: (rng.standard_normal((3, 5)) * 100).astype(d)[:, ::2]
              for d in DTYPES}
    arrays |= {"mask": np.array([[True, False, True]]), "none": np.zeros((0, 4), np.float32),
               "one": np.float32(2.5).reshape(())}
    kept = {name: array.copy() for name, array in arrays.items()}
    tensors = to_torch_many(arrays)
    for name, array in arrays.items():
        tensor = tensors[name]
        assert tuple(tensor.shape) == array.shape and tensor.is_contiguous(), name
        np.testing.assert_array_equal(_bytes(to_numpy(tensor, array)), _bytes(array),
                                      err_msg=name)
        tensor.fill_(0)  # a write to one view reaches neither its neighbours nor the array
        np.testing.assert_array_equal(_bytes(array), _bytes(kept[name]))
    assert all(float(t.float().abs().sum()) == 0 for t in tensors.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the unstaged path is for a device "
                    "other than the CPU; none is visible")
@pytest.mark.parametrize("chunk", [tensors.CHUNK_BYTES, 1 << 20], ids=["one-chunk", "chunks"])
def test_a_pool_past_the_staging_limit_goes_to_the_gpu_on_its_own_bit_for_bit(chunk, monkeypatch):
    monkeypatch.setattr(tensors, "CHUNK_BYTES", chunk)  # 1 MiB: 65 chunks, the last of 6 bytes
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 1 << 16, DIRECT_BYTES // 2 + 3, dtype=np.uint16).view(
        ml_dtypes.bfloat16).reshape(-1, 1)  # past the limit by six bytes
    pool.setflags(write=False)  # read-only goes the same way
    arrays = {"pool": pool, "table": np.arange(7, dtype=np.int32),
              "query": rng.standard_normal((2, 3)).astype(np.float16)}
    kept = {name: array.copy() for name, array in arrays.items()}
    moved = to_torch_many(arrays, "cuda")
    for name, array in arrays.items():
        tensor = moved[name]
        assert tensor.device.type == "cuda" and tuple(tensor.shape) == array.shape, name
        assert str(tensor.dtype) == f"torch.{array.dtype.name}", name
        np.testing.assert_array_equal(_bytes(to_numpy(tensor, array)), _bytes(array),
                                      err_msg=name)
        tensor.fill_(0)
        np.testing.assert_array_equal(_bytes(array), _bytes(kept[name]))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned path is for a CUDA device; none is visible"))]


@pytest.mark.parametrize("device", DEVICES)
def test_several_results_come_back_with_one_wait_each_its_own_bit_for_bit(device):
    rng = np.random.default_rng(3)
    likes = [(rng.standard_normal((4, 6)) * 100).astype(d) for d in DTYPES]
    moved = to_torch_many({str(i): like for i, like in enumerate(likes)}, device)
    tensors_ = [moved[str(i)] for i in range(len(likes))]
    if device == "cuda":
        torch.cuda._sleep(50_000_000)  # the writes below land well after the call returns
    for tensor in tensors_:  # every byte inverted on the device, whatever the dtype
        tensor.view(torch.uint8).bitwise_not_()
    strided = tensors_[0][:, ::2]  # not contiguous
    back = to_numpy_many([(t, like) for t, like in zip(tensors_, likes, strict=True)]
                         + [(strided, likes[0][:, ::2])])
    for array, like in zip(back, [*likes, likes[0][:, ::2]], strict=True):
        assert array.dtype == like.dtype and array.shape == like.shape
        np.testing.assert_array_equal(_bytes(array), ~_bytes(like), err_msg=like.dtype.name)
    as_float = to_numpy_many([(tensors_[1], np.zeros((4, 6), np.float32))])[0]
    assert as_float.dtype == np.float32  # cast to the buffer's dtype
    np.testing.assert_array_equal(as_float, back[1].astype(np.float32))


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
