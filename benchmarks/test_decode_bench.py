"""Time a backend's kernel call on the named shapes, through pytest-benchmark.

    pytest benchmarks --bench-backend triton-splitkv --bench-shapes gpu --benchmark-save=base
    pytest benchmarks --bench-backend triton-splitkv --bench-shapes gpu \\
        --benchmark-compare=0001 --benchmark-compare-fail=median:10%  # CPUs: min, wider

Test names hold the shape only, so a saved run of one build compares with a later one. Only
the call ``Backend.prepare`` returns is timed: on a GPU by CUDA events around a CUDA-graph
replay with the L2 flushed before each call (``GpuClock``), elsewhere by the wall clock.
Each result's ``extra_info`` records the bytes that must move, the achieved rate and, on a
GPU, the fraction of a device-to-device copy measured in the same session.
"""

from __future__ import annotations

import pytest

from conformance.bench import copy_bandwidth, prepared_call, select_shapes
from conformance.session import open_backend


class GpuClock:
    """A clock that advances only by GPU time measured with CUDA events around each call, so
    pytest-benchmark's statistics are of device time, not of host-side launch cost."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.elapsed = 0.0
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self) -> float:
        return self.elapsed

    def timed(self, replay):
        def call() -> None:
            self.flush.zero_()  # a cold L2 for every call
            self.start.record()
            replay()
            self.end.record()
            self.end.synchronize()
            self.elapsed += self.start.elapsed_time(self.end) / 1e3
        return call


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "shape" in metafunc.fixturenames:
        shapes = select_shapes(metafunc.config.getoption("bench_shapes"))
        metafunc.parametrize("shape", shapes, ids=[s.name for s in shapes])


@pytest.fixture(scope="session")
def backend(request):
    # timed here, beside the kernel: loaded in this process too
    opened = open_backend(request.config.getoption("bench_backend"), isolated=False)
    if opened.reason:
        pytest.skip(f"backend {opened.label} unavailable: {opened.reason}")
    return opened


@pytest.fixture(scope="session")
def gpu_copy_rate(backend):
    return copy_bandwidth() if backend.instance().timing_device() == "cuda" else None


def test_decode(benchmark, backend, shape, gpu_copy_rate):
    if benchmark.disabled:
        pytest.skip("benchmarks are disabled (--benchmark-disable, or under xdist)")
    reason = backend.instance().unsupported_reason(shape.case())
    if reason:
        pytest.skip(f"unsupported: {reason}")
    call = prepared_call(backend.instance(), shape)
    if backend.instance().timing_device() == "cuda":
        from conformance.bench import capture_graph

        clock = GpuClock()
        benchmark._timer = clock  # pytest-benchmark reads its clock from here
        target = clock.timed(capture_graph(call) if backend.instance().capturable else call)
        benchmark.pedantic(target, rounds=50, iterations=1, warmup_rounds=5)
    else:
        benchmark.pedantic(call, rounds=15, iterations=1, warmup_rounds=2)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update({
        "backend": backend.label, "kv_bytes": shape.kv_bytes,
        "bytes_per_s": shape.kv_bytes / median,
        "copy_bytes_per_s": gpu_copy_rate,
        "fraction_of_copy": shape.kv_bytes / median / gpu_copy_rate if gpu_copy_rate else None})
    assert median > 0
