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
    seal_tiling,
    threads_for,
    tile_into,
    tiled_pool,
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
    assert threads_for(bulk.HUGE_BYTES) == bulk.HUGE_THREADS  # the run's critical path
    monkeypatch.setattr(bulk, "runnable_tasks", lambda: None)
    assert threads_for(bulk.BULK_BYTES) == 1
    monkeypatch.setattr(bulk, "CPUS", 2)
    assert threads_for(bulk.HUGE_BYTES) == 2


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


def test_a_pool_leaves_room_to_a_power_of_two_for_a_larger_one(monkeypatch):
    """A case's neighbours variant is a page or two larger than its other layouts: it
    reuses their memory instead of faulting in fresh pages (issue 22)."""
    monkeypatch.setattr(bulk, "BULK_BYTES", 0)
    with recycling():
        first = empty_pool((33,), np.float32)  # 132 bytes, in a buffer of 256
        where = _address(first)
        del first
        assert _address(empty_pool((64,), np.float32)) == where
        assert _address(empty_pool((65,), np.float32)) != where  # past its 256 bytes


@pytest.fixture
def tilings(monkeypatch):
    """Every pool a tiled one, read in stamps of 96 bytes (a block of 3 rows is 60 bytes)."""
    monkeypatch.setattr(bulk, "BULK_BYTES", 0)
    monkeypatch.setattr(bulk, "STAMP_BYTES", 96)


def _sealed_pool(written=(7, 20, 49)):
    block = np.random.default_rng(2).standard_normal((3, 5, 2)).astype(np.float16)
    pool = tiled_pool((50, 5, 2), np.float16, block)
    assert pool.nbytes > 1 << 9  # several stamps, and slices of 64 bytes under ``threads``
    pool[list(written)] = np.float16(7)
    seal_tiling(pool, np.array(written))
    return pool


def test_a_sealed_tiled_pool_is_copied_and_compared_whole(tilings, threads):
    pool = _sealed_pool()
    assert bulk.tiling_of(pool) is not None and not pool.flags.writeable
    with pytest.raises(ValueError):
        pool[0] = 0  # sealed: nothing writes it behind its tiling's back
    copied = np.zeros_like(pool)
    copy_into(copied, pool)
    assert copied.tobytes() == pool.tobytes()
    assert same_bytes(copied, pool) and same_bytes(pool, copied)
    for row, element in [(0, 0), (7, 3), (8, 9), (20, 0), (48, 9), (49, 9)]:  # garbage, written
        flipped = copied.copy()
        flipped.reshape(50, -1).view(np.uint16)[row, element] ^= 1
        assert not same_bytes(flipped, pool) and not same_bytes(pool, flipped), (row, element)


def test_a_pool_is_read_from_its_tiling_only_once_sealed_and_mostly_garbage(tilings):
    block = np.arange(30, dtype=np.float32).reshape(3, 5, 2)
    unsealed = tiled_pool((50, 5, 2), np.float32, block)
    unsealed[4] = -1  # not declared: its tiling must not be read
    copied = np.zeros_like(unsealed)
    copy_into(copied, unsealed)
    assert copied.tobytes() == unsealed.tobytes() and bulk.tiling_of(unsealed) is None
    busy = _sealed_pool(written=range(20))  # most rows its own: no tiling, still writable
    assert bulk.tiling_of(busy) is None and busy.flags.writeable
    sealed = _sealed_pool()
    count = len(bulk._tilings)
    del sealed
    assert len(bulk._tilings) == count - 1  # forgotten with its pool
