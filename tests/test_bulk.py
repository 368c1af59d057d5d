"""Whole-pool copies, fills and comparisons give what one NumPy statement gives, on one
thread or on several (the threads are forced here: slices of 64 bytes, every CPU idle)."""

from __future__ import annotations

import numpy as np
import pytest

from conformance import bulk
from conformance.bulk import (
    copy_into,
    empty_pool,
    recycling,
    same_bytes,
    threads_for,
    tile_into,
)


@pytest.fixture(params=["one thread", "threads"])
def threads(request, monkeypatch):
    if request.param == "threads":
        monkeypatch.setattr(bulk, "BULK_BYTES", 0)
        monkeypatch.setattr(bulk, "SLICE_BYTES", 64)
        monkeypatch.setattr(bulk, "CPUS", 4)
        monkeypatch.setattr(bulk, "runnable_tasks", lambda: 1)
        assert threads_for(1) == 4
    return request.param


@pytest.mark.parametrize("size", [0, 5, 8, 13, (1 << 16) + 3, (1 << 17) + 5])
def test_same_bytes_sees_one_flipped_byte_anywhere(size, threads):
    a = np.arange(size).astype(np.uint8)
    assert same_bytes(a, a.copy())
    for where in {0, size // 2, size - 1} if size else ():
        b = a.copy()
        b[where] ^= 1
        assert not same_bytes(a, b)
    nan = np.array([np.nan, -0.0], dtype=np.float32)
    assert same_bytes(nan, nan.copy()) and not same_bytes(nan, np.array([np.nan, 0.0], np.float32))


def test_copy_into_copies_every_byte_of_a_view_or_a_whole_array(threads):
    source = np.random.default_rng(0).standard_normal((37, 3, 5)).astype(np.float16)
    for view in (source, source[:, ::2]):  # the strided one takes NumPy's own path
        target = np.zeros_like(view)
        copy_into(target, view)
        np.testing.assert_array_equal(target.view(np.uint16), view.view(np.uint16))


@pytest.mark.parametrize("rows", [1, 4, 7, 37, 50])
def test_tile_into_repeats_the_block_and_cuts_the_last_copy_short(rows, threads):
    block = np.random.default_rng(1).standard_normal((rows, 3, 5)).astype(np.float32)
    target = np.full((37, 3, 5), np.nan, np.float32)
    tile_into(target, block[:37])
    want = np.concatenate([block[:37]] * (37 // min(rows, 37) + 1))[:37]
    np.testing.assert_array_equal(target, want)


def test_threads_only_for_large_arrays_on_a_machine_with_cpus_to_spare(monkeypatch):
    monkeypatch.setattr(bulk, "CPUS", 16)
    monkeypatch.setattr(bulk, "runnable_tasks", lambda: 1)
    assert threads_for(bulk.BULK_BYTES - 1) == 1
    assert threads_for(bulk.BULK_BYTES) == bulk.MAX_THREADS
    monkeypatch.setattr(bulk, "runnable_tasks", lambda: 13)  # 3 idle and this one's own
    assert threads_for(bulk.BULK_BYTES) == 4
    monkeypatch.setattr(bulk, "runnable_tasks", lambda: 40)
    assert threads_for(bulk.BULK_BYTES) == 1
    monkeypatch.setattr(bulk, "runnable_tasks", lambda: None)
    assert threads_for(bulk.BULK_BYTES) == 1


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_pool_is_handed_out_again_only_once_nothing_references_it(monkeypatch):
    monkeypatch.setattr(bulk, "BULK_BYTES", 0)
    with recycling():
        first = empty_pool((4, 8), np.float32)
        where, view = _address(first), first[1:]
        del first
        second = empty_pool((4, 8), np.float32)
        assert not np.shares_memory(second, view)  # the view still holds the first one
        del view
        third = empty_pool((2, 8), np.float64)  # as many bytes, another shape and dtype
        assert _address(third) == where and third.shape == (2, 8) and third.dtype == np.float64
        assert not np.shares_memory(third, second)
        larger = empty_pool((5, 8), np.float32)
        assert _address(larger) not in (where, _address(second))
    outside = [empty_pool((4, 8), np.float32) for _ in range(2)]
    del outside[0]
    assert _address(empty_pool((4, 8), np.float32)) != _address(outside[0])
