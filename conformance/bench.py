"""Benchmarks: time only the kernel call of a backend on named shapes.

A backend's ``prepare`` does every conversion once and returns the call to time. On a GPU
the call is timed with ``triton.testing.do_bench`` (CUDA events, L2 flushed before every
call, median) next to a device-to-device copy measured in the same process; on a CPU with a
plain median of wall-clock repeats. Each result records the bytes that must move (K and V of
every attended token, read once) and the achieved rate.
"""

from __future__ import annotations

import statistics
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from conformance.backends.base import Backend
from conformance.dtypes import FP8_DTYPES, SHORT_NAMES, numpy_dtype
from conformance.materialise import materialise
from conformance.problem import poisoned_outputs
from conformance.spec import Case
from conformance.worker import ContractError

BENCH_PATH = Path(__file__).with_name("bench.toml")
_FIELDS = {"name", "sets", "batch", "context", "num_qo_heads", "num_kv_heads", "head_dim",
           "page_size", "dtype", "kv_dtypes", "query_lens", "kv_lora_rank", "rope_dim"}


@dataclass(frozen=True)
class BenchShape:
    name: str
    sets: tuple[str, ...]
    batch: int
    context: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"
    kv_dtype: str | None = None  # an fp8 cache (per-tensor scales), else K and V in dtype
    query_len: int = 1  # query tokens per sequence (causal drafts, its last positions)
    kv_lora_rank: int | None = None  # MLA: the latent's width (head_dim is then ignored)
    rope_dim: int = 0  # MLA: the rotary key part

    @property
    def key_width(self) -> int:
        """A key's width: head_dim, or for MLA the latent and its rotary part."""
        return self.head_dim if self.kv_lora_rank is None else self.kv_lora_rank + self.rope_dim

    def case(self) -> Case:
        mla = self.kv_lora_rank is not None
        return Case(family="bench", tag=self.name, num_qo_heads=self.num_qo_heads,
                    num_kv_heads=1 if mla else self.num_kv_heads, head_dim=self.key_width,
                    kv_lora_rank=self.kv_lora_rank,
                    page_size=self.page_size, dtype=self.dtype,
                    context_lens=(self.context,) * self.batch, kv_dtype=self.kv_dtype,
                    query_lens=(self.query_len,) * self.batch if self.query_len > 1 else None,
                    batch_label=f"{self.batch}x[{self.context}]")

    @property
    def kv_bytes(self) -> int:
        """K and V of every token, read once: the bytes no kernel can avoid moving (an fp8
        cache's codes; its two per-tensor scales are noise). An MLA token is its latent and
        rotary part, read once for key and value alike."""
        itemsize = np.dtype(numpy_dtype(self.kv_dtype or self.dtype)).itemsize
        if self.kv_lora_rank is not None:
            return self.batch * self.context * self.key_width * itemsize
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * itemsize


def load_shapes(path: Path = BENCH_PATH) -> list[BenchShape]:
    """The shapes of a bench file; a shape listing ``kv_dtypes`` is one shape per KV dtype
    (its own ``dtype``: the plain shape; an fp8 format: ``NAME-kv-e4m3``, per-tensor scales),
    and one listing ``query_lens`` one per query length (above one: ``NAME-q4``, causal)."""
    shapes = []
    for index, entry in enumerate(tomllib.loads(path.read_text()).get("shape", [])):
        unknown = set(entry) - _FIELDS
        if unknown:
            raise ValueError(f"{path.name}: shape #{index + 1}: unknown field(s) "
                             f"{sorted(unknown)}; known: {', '.join(sorted(_FIELDS))}")
        entry = {**entry, "sets": tuple(entry.get("sets", ()))}
        for query_len in entry.pop("query_lens", [1]):
            if not isinstance(query_len, int) or query_len < 1:
                raise ValueError(f"{path.name}: shape {entry.get('name')!r}: field "
                                 f"'query_lens' lists {query_len!r}; want integers >= 1")
            shapes.extend(_by_kv_dtype(path, entry if query_len == 1 else {
                **entry, "query_len": query_len, "name": f"{entry['name']}-q{query_len}"}))
    return shapes


def _by_kv_dtype(path: Path, entry: dict) -> list[BenchShape]:
    """One shape per entry of the entry's ``kv_dtypes``."""
    shapes = []
    entry = dict(entry)
    dtype = entry.get("dtype", BenchShape.dtype)
    for kv_dtype in entry.pop("kv_dtypes", [dtype]):
        if kv_dtype == dtype:
            shapes.append(BenchShape(**entry))
        elif kv_dtype in FP8_DTYPES:
            shapes.append(BenchShape(**{**entry, "kv_dtype": kv_dtype, "name":
                                        f"{entry['name']}-kv-{SHORT_NAMES[kv_dtype]}"}))
        else:
            raise ValueError(f"{path.name}: shape {entry.get('name')!r}: field "
                             f"'kv_dtypes' names {kv_dtype!r}; known: {dtype} (the "
                             f"shape's dtype), {', '.join(FP8_DTYPES)}")
    return shapes


def select_shapes(shape_set: str, names: list[str] | None = None) -> list[BenchShape]:
    shapes = [s for s in load_shapes() if shape_set in s.sets]
    if names:
        known = {s.name for s in load_shapes()}
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(f"unknown bench shape {missing[0]!r}; known: "
                             f"{', '.join(sorted(known))}")
        shapes = [s for s in load_shapes() if s.name in names]
    if not shapes:
        raise ValueError(f"no bench shape in set {shape_set!r}")
    return shapes


def prepared_call(backend: Backend, shape: BenchShape) -> Callable[[], None]:
    """The backend's kernel call on the shape's problem, every conversion done beforehand."""
    problem = materialise(shape.case())
    out, lse = poisoned_outputs(problem, 0.0)
    return backend.prepare(problem, out, lse)


def time_cpu(call: Callable[[], None], repeats: int = 7) -> float:
    """Median seconds of ``repeats`` calls after one warm-up."""
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_cuda(call: Callable[[], None], graph: bool = True) -> float:
    """Median seconds by CUDA events, L2 flushed before every call (``do_bench``).

    The call is captured in a CUDA graph first, so the host-side cost of launching (Python
    argument handling, two launches) does not leave the GPU idle inside the timed region;
    a call that cannot be captured is timed as it is.
    """
    from triton.testing import do_bench

    timed = capture_graph(call) if graph else call
    return do_bench(timed, warmup=25, rep=200, return_mode="median") / 1e3


def capture_graph(call: Callable[[], None]) -> Callable[[], None]:
    """The call captured in a CUDA graph (its replay), or the call itself if it cannot be."""
    import torch

    call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            call()  # warm-up on the side stream, as capture requires
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, stream=stream):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        return cuda_graph.replay
    except RuntimeError:
        torch.cuda.synchronize()
        return call


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written."""
    import torch

    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = time_cuda(lambda: target.copy_(source), graph=False)
    return 2 * source.numel() / seconds


@dataclass
class BenchResult:
    backend: str
    shape: str
    device: str
    median_s: float
    kv_bytes: int
    bytes_per_s: float
    copy_bytes_per_s: float | None
    fraction_of_copy: float | None
    medians_s: list[float]

    @property
    def spread(self) -> float:
        return max(self.medians_s) / min(self.medians_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "spread": self.spread}

    @classmethod
    def from_data(cls, data: dict) -> BenchResult:
        """A result a worker sent as plain data, checked before it is printed or saved."""
        names = [f.name for f in fields(cls)]
        numbers = ("median_s", "kv_bytes", "bytes_per_s")
        if set(data) != set(names) or not all(
                isinstance(data[n], (int, float)) and data[n] > 0 for n in numbers) or not (
                isinstance(data["medians_s"], list) and data["medians_s"] and all(
                    isinstance(m, (int, float)) and m > 0 for m in data["medians_s"])):
            raise ContractError(f"the bench call sent back {str(data)[:200]}, not a result")
        return cls(**data)


def bench(backend: Backend, label: str, shape: BenchShape, rounds: int = 1,
          copy_rate: float | None = None) -> BenchResult:
    """Time one shape ``rounds`` times (each a median); report the median of the medians."""
    call = prepared_call(backend, shape)
    device = backend.timing_device()
    if device == "cuda":
        medians = [time_cuda(call, graph=backend.capturable) for _ in range(rounds)]
    else:
        medians = [time_cpu(call) for _ in range(rounds)]
    seconds = statistics.median(medians)
    rate = shape.kv_bytes / seconds
    return BenchResult(label, shape.name, device, seconds, shape.kv_bytes, rate, copy_rate,
                       rate / copy_rate if copy_rate else None, medians)
