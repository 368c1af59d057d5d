"""The channel's two encodings: the harness's arrays in shared memory, compared byte for byte
after the call; the worker's replies as validated plain data, never code."""

from __future__ import annotations

import json
import os
import pickle

import ml_dtypes
import numpy as np
import pytest

from backends.tensors import _tiled_to_cuda, to_torch
from conformance import bulk
from conformance.bulk import same_bytes
from conformance.materialise import materialise
from conformance.plain_replies import decode_reply, encode_reply
from conformance.tiled_arena import mapped_parts
from conformance.wire import (
    ARENA_SHRINK_AFTER,
    ARENA_SHRINK_BYTES,
    HEADER,
    Arena,
    Mapped,
    WireError,
    pack_message,
    unpack_message,
)
from tests.test_problem import make_case


@pytest.mark.parametrize("pool", ["small", "tiled", "mapped"])
def test_a_message_arrives_as_views_of_the_segment_and_changes_are_seen(pool, monkeypatch):
    """``tiled``: garbage pages copied and compared from their stamp (``conformance.bulk``);
    ``mapped``: rows of whole pages, so the pool travels as its stamp and written rows and
    the worker maps them back (``conformance.tiled_arena``)."""
    if pool != "small":
        monkeypatch.setattr(bulk, "BULK_BYTES", 0)
        monkeypatch.setattr(bulk, "STAMP_BYTES", 64)
    rows = {"head_dim": 128} if pool == "mapped" else {}  # a page of 4 x 2 x 128 float32
    problem = materialise(make_case(pool_pages=5000, **rows))  # past a block of garbage
    assert (bulk.tiling_of(problem.k_pages) is not None) == (pool != "small")
    out = np.full(problem.q.shape, np.nan, dtype=problem.dtype)  # NaN equals itself by bytes
    payload, segment = pack_message(("call", "decode", (problem, out)))
    _, _, (theirs, their_out) = unpack_message(payload, os.dup(segment.arena.fd))
    assert np.array_equal(theirs.k_pages, problem.k_pages) and theirs.sm_scale == problem.sm_scale
    parts = mapped_parts(theirs.v_pages.reshape(-1).view(np.uint8))
    assert (parts is not None) == (pool == "mapped")
    if pool == "mapped":  # the arena holds the parts: far less than the two pools
        assert segment.arena.size < problem.k_pages.nbytes
        assert to_torch(theirs.v_pages).numpy().tobytes() == problem.v_pages.tobytes()
        assert _tiled_to_cuda(parts, "cpu").numpy().tobytes() == problem.v_pages.tobytes()
    index = {id(a): i for i, a in enumerate(segment.originals)}
    assert not any(segment.changed(i) for i in range(len(segment.originals)))
    their_out[0, 0, 0] = 1.0  # what the backend writes, the harness reads
    theirs.context_lens[0] += 1  # and what it scribbles on, the harness sees
    assert segment.view(index[id(out)])[0, 0, 0] == 1.0
    changed = {name for name, a in problem.arrays().items() if segment.changed(index[id(a)])}
    assert changed == {"context_lens"}
    unread = np.setdiff1d(np.arange(problem.k_pages.shape[0]), problem.block_table)
    for page in (unread[0], unread[-1], problem.block_table[0, 0]):  # garbage, garbage, read
        theirs.v_pages[page, -1, -1, -1] += 1
        assert segment.changed(index[id(problem.v_pages)]), page
        theirs.v_pages[page, -1, -1, -1] = problem.v_pages[page, -1, -1, -1]
        assert not segment.changed(index[id(problem.v_pages)])


@pytest.mark.parametrize("value", [
    None, "text", 3, -2.5, float("-inf"), [1, "a", None], {"k": [True, False]},
    {"out": np.arange(6, dtype=np.float32).reshape(2, 3),
     "lse": np.ones((2,), dtype=ml_dtypes.bfloat16)},
])
def test_plain_data_round_trips(value):
    back = decode_reply(encode_reply(value))
    if isinstance(value, dict) and "out" in value:
        assert back["out"].dtype == np.float32 and np.array_equal(back["out"], value["out"])
        assert back["lse"].dtype == np.dtype(ml_dtypes.bfloat16)
    else:
        assert json.dumps(back) == json.dumps(value)


def test_a_reply_cannot_carry_objects():
    with pytest.raises(TypeError, match="cannot carry"):
        encode_reply({"state": object()})
    with pytest.raises(TypeError, match="dtype object"):
        encode_reply(np.array([object()]))


def frame(header: dict, body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return HEADER.pack(len(text)) + text + body


@pytest.mark.parametrize("payload,what", [
    (pickle.dumps(("ok", None)), "not a data frame"),
    (frame({"value": 1}), "not {value, sizes}"),
    (frame({"value": {"__array__": 0, "dtype": "object", "shape": [1]}, "sizes": [8]},
           b"\0" * 8), "dtype 'object'"),
    (frame({"value": {"__array__": 0, "dtype": "float32", "shape": [4]}, "sizes": [8]},
           b"\0" * 8), "carries 8 bytes"),
    (frame({"value": None, "sizes": [100]}, b"\0" * 8), "announces 100 bytes"),
    (frame({"value": {"__array__": 5, "dtype": "float32", "shape": [1]}, "sizes": [4]},
           b"\0" * 4), "malformed array"),
])
def test_a_reply_that_is_not_plain_data_is_refused(payload, what):
    with pytest.raises(WireError, match=what.replace("{", r"\{").replace("}", r"\}")
                       .replace("(", r"\(")):
        decode_reply(payload)


def test_requests_reuse_one_arena_that_the_worker_maps_once():
    small, large = np.arange(10, dtype=np.float32), np.zeros(1 << 19, dtype=np.float32)
    payload, first = pack_message(("call", "x", (small,)))
    worker = Mapped()
    (_, _, (theirs,)) = worker.unpack(payload, os.dup(first.arena.fd))
    assert np.array_equal(theirs, small)
    first.arena.close_fd()
    payload, second = pack_message(("call", "y", (small * 2,)), first.arena)
    assert second.arena is first.arena  # no new descriptor travels
    (_, _, (again,)) = worker.unpack(payload, None)
    assert np.array_equal(again, small * 2)
    with pytest.raises(RuntimeError, match="reused its arena"):
        first.view(0)  # the first request's views are gone once the next is placed
    _, grown = pack_message(("call", "z", (large, large + 1)), first.arena)
    assert grown.arena is not first.arena and grown.arena.size >= 2 * large.nbytes
    large_arena = Arena(ARENA_SHRINK_BYTES * 2)
    for _ in range(ARENA_SHRINK_AFTER - 1):  # a large arena stays through a few small calls
        assert pack_message(("call", "w", (small,)), large_arena)[1].arena is large_arena
    _, shrunk = pack_message(("call", "w", (small,)), large_arena)
    assert shrunk.arena.size < ARENA_SHRINK_BYTES  # ... and is given back after many
    assert pack_message(("call", "notes", ()))[1].arena is None  # no arrays, no arena


def test_a_new_arena_is_as_large_as_the_workers_largest_unless_the_message_is_small():
    """A slot grown call by call faulted in each size's pages (issue 22); a message of an
    eighth or more of the worker's largest arena gets one that large at once."""
    like = 1 << 24
    message = np.zeros(like // 8, dtype=np.uint8)
    assert pack_message(("call", "x", (message,)), None, 1, like)[1].arena.size == like
    small = np.zeros(like // 16, dtype=np.uint8)
    assert pack_message(("call", "x", (small,)), None, 1, like)[1].arena.size < like
    larger = np.zeros(2 * like, dtype=np.uint8)
    assert pack_message(("call", "x", (larger,)), None, 1, like)[1].arena.size >= 2 * like


def test_two_requests_may_be_out_and_each_gets_its_own_reply_and_memory():
    """A check sends its next decode while the backend works on this one (``Trial.decodes``):
    the two share no memory, each gets its own reply in whichever order the harness reads
    them, and a third waits until one is read."""
    from conformance.backends.registry import resolve
    from conformance.session import open_backend

    backend = open_backend("numpy")
    handle = backend.connect()
    problems = [materialise(make_case()), materialise(make_case(context_lens=(3, 21), head_dim=16))]
    shapes = [((p.tokens, p.num_qo_heads, p.head_dim_v), (p.tokens, p.num_qo_heads))
              for p in problems]
    try:
        waiting = [handle.submit_decode(p, np.empty(o, p.dtype), np.empty(s, np.float32), None)
                   for p, (o, s) in zip(problems, shapes, strict=True)]
        with pytest.raises(RuntimeError, match="2 requests to numpy are out"):
            handle.call("device")
        got = [waiting[1](), waiting[0]()][::-1]  # read out of order: the first reply is kept
        for problem, (out, lse, mutated), (o, s) in zip(problems, got, shapes, strict=True):
            want_out, want_lse = np.empty(o, problem.dtype), np.empty(s, np.float32)
            resolve("numpy")().decode(problem, want_out, want_lse)
            assert same_bytes(out, want_out) and same_bytes(lse, want_lse) and not mutated
        assert handle.call("device") == "cpu"  # and once answered, the next goes out
    finally:
        backend.disconnect()
