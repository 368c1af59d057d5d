"""TVM's kernels as suite backends: the CPU (LLVM) kernels and the CUDA kernels.

Conventions, declared rather than hidden: TVM's LSE is base 2 and an empty context leaves
the kernel's running max at its initial -5e4 with a denominator of 1, so its LSE is the finite
sentinel -5e4 (base 2). The adapter converts LSE to natural log both ways (for merge inputs
too) and declares the sentinel; the suite then accepts exactly -5e4·ln 2 for empty rows.

Set ``CONFORMANCE_TVM_AOT=DIR`` to run from an ahead-of-time build
(``python -m conformance build tvm ...``), e.g. on a GPU machine with only TVM's runtime.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from conformance.backends.base import AttentionState, Backend, Capabilities, Conventions
from conformance.backends.tvm import kernels
from conformance.backends.tvm.layout import tvm_layout
from conformance.dtypes import dtype_name

LN2 = math.log(2.0)
AOT_ENV = kernels.AOT_ENV_NAME


def aot_dir() -> Path | None:
    value = os.environ.get(AOT_ENV)
    return Path(value) if value else None


def aot_only(target: str) -> set[kernels.KernelKey] | None:
    """The kernels of the ahead-of-time build when they are all this tvm can run (it has no
    compiler), else None: then every shape compiles on demand."""
    directory = aot_dir()
    if directory is None or kernels.has_compiler():
        return None
    return {k for k in kernels.built_keys(directory) if k.target == target}


def claims(base: Capabilities, target: str) -> Capabilities:
    """Runtime-only TVM claims exactly the kernel instances its ahead-of-time build holds."""
    keys = aot_only(target)
    instances = frozenset(k.instance for k in keys or () if k.kernel in ("decode", "mla"))
    return replace(base, instances=instances) if instances else base


class TvmBackend(Backend):
    target: ClassVar[str] = "llvm"
    conventions = Conventions(lse_base=2.0, empty_lse=-5e4)
    # both targets: the decode kernel, and for several query tokens the prefill and tree kernels
    capabilities = Capabilities(features=frozenset({"lse", "merge", "sliding_window", "sinks",
                                                    "multi_token", "draft_mask"}))

    @classmethod
    def preload(cls) -> Iterator[None]:
        """torch where installed; then tvm, a stage of its own: its tvm_ffi imports torch and
        asks ``torch.cuda.is_available()`` on import."""
        with contextlib.suppress(ImportError):
            import torch  # noqa: F401
        yield
        kernels.import_tvm()
        import tvm_ffi  # noqa: F401

    @classmethod
    def availability(cls) -> str | None:
        try:
            kernels.import_tvm()
            import tvm_ffi  # noqa: F401
        except ImportError as exc:
            return f"tvm is not importable ({exc}); pip install -e '.[tvm]'"
        if not kernels.has_compiler() and aot_dir() is None:
            return (f"this tvm has no compiler library and {AOT_ENV} names no ahead-of-time "
                    f"build")
        return None

    def __init__(self) -> None:
        self.tvm = kernels.import_tvm()
        self.cache = kernels.KernelCache(self.target, aot_dir())
        self.built = aot_only(self.target)  # None: shapes compile on demand
        # what TVM could not build there, in its own words (read once, as ``built`` is)
        self.build_failed = kernels.build_failures(aot_dir()) if self.built else {}
        self.device = self.tvm.cpu(0) if self.target == "llvm" else self.tvm.cuda(0)

    def unsupported_reason(self, case) -> str | None:
        if case.query_lens is not None and case.window is not None:
            return ("several query tokens with a sliding window: TVM's prefill kernel takes "
                    "its window size at compile time (sliding_window_size) beside the cache's "
                    "sink and offset, its tree kernel none; not adapted")
        if case.query_lens is not None and case.mask == "all":
            return ("every draft seeing every draft: TVM's tree kernel takes a tree (each "
                    "draft's depth-first interval), which no such mask is")
        if case.query_lens is not None and case.mask != "causal" and case.page_size != 16:
            return (f"page size {case.page_size} with a draft tree: TVM's tree kernels "
                    f"(tree_attn_with_paged_kv_cache and its CPU variant) take no page size "
                    f"and read pages of 16 tokens only (on CUDA another size is refused: "
                    f"'Mismatched pages.strides', H200)")
        reason = super().unsupported_reason(case)
        if reason or not self.built:
            return reason
        key = kernels.KernelKey.for_case(case, self.target)
        if key in self.built:
            return None
        failed = self.build_failed.get(key.filename)
        if failed:  # TVM's own words (docs/findings/tvm-cuda-prefill-small-head-build.md)
            return f"TVM could not build {key.filename}: {failed}"
        return f"{key.filename} is not in the ahead-of-time build"

    def notes(self) -> list[str]:
        cache = self.cache
        return [f"{len(cache.functions)} kernels: {cache.compiled} compiled, {cache.loaded} "
                f"loaded ahead-of-time, {cache.compile_seconds:.1f} s compiling and loading"]

    def tensor(self, array: np.ndarray):
        return self.tvm.runtime.tensor(np.ascontiguousarray(array), self.device)

    def decode_call(self, problem, out: np.ndarray, lse: np.ndarray):
        """The kernel launch on converted inputs, and how to read results back: the decode
        kernel for one query token per sequence, for several the causal prefill kernel or,
        with a draft mask, the tree kernel."""
        kv = tvm_layout(problem)
        if problem.kind == "mla":
            kind = "mla"
            key = kernels.KernelKey(kind, self.target, problem.num_qo_heads, 1,
                                    problem.head_dim_v, dtype_name(problem.dtype),
                                    problem.page_size, kv.sliding_window,
                                    problem.head_dim - problem.head_dim_v)
        else:
            kind = "decode" if problem.query_lens is None else \
                "prefill" if problem.draft_mask is None else "tree"
            key = kernels.KernelKey(kind, self.target, problem.num_qo_heads,
                                    problem.num_kv_heads, problem.head_dim,
                                    dtype_name(problem.dtype), problem.page_size,
                                    kv.sliding_window)
        function = self.cache.get(key)
        zeros = np.zeros(problem.batch, dtype=np.int32)
        out_t, lse_t = self.tensor(out), self.tensor(lse)
        pages = [self.tensor(kv.pages), self.tensor(kv.page_indptr), self.tensor(kv.page_values),
                 self.tensor(kv.length_info)]
        rope = [0, 1.0, 1e4, float(problem.sm_scale)]  # no RoPE: mode 0, scale, theta
        if kind == "mla":  # q (tokens, heads, latent + rope), one token per sequence, no mask
            q_indptr = np.arange(problem.batch + 1, dtype=np.int32)
            args = [self.tensor(problem.q), self.tensor(q_indptr), *pages, out_t, lse_t, 0,
                    float(problem.sm_scale)]
        elif kind == "decode":
            args = [self.tensor(problem.q), *pages, self.tensor(zeros), self.tensor(zeros),
                    out_t, lse_t, *rope]
        else:  # q_indptr after q, q_rope_position per token
            queries = [self.tensor(problem.q), self.tensor(problem.query_start), *pages,
                       self.tensor(zeros), self.tensor(np.zeros(problem.tokens, dtype=np.int32)),
                       out_t, lse_t]
            args = [*queries, 1, *rope] if kind == "prefill" else [
                *queries, *rope, self.tensor(problem.query_start),
                self.tensor(tree_order(problem))]

        def call() -> None:
            function(*args)

        def read_back() -> None:
            out[...] = out_t.numpy()
            lse[...] = lse_t.numpy() * np.float32(LN2)

        return call, read_back

    def decode(self, problem, out, lse, *, num_splits=None) -> None:
        if problem.batch == 0:
            return
        call, read_back = self.decode_call(problem, out, lse)
        call()
        read_back()

    def prepare(self, problem, out, lse, *, num_splits=None):
        call, _ = self.decode_call(problem, out, lse)
        call()
        return call

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        _, heads, head_dim = a.out.shape
        key = kernels.KernelKey("merge", self.target, heads, heads, head_dim,
                                dtype_name(a.out.dtype))
        function = self.cache.get(key)
        v, s = self.tensor(a.out.copy()), self.tensor((a.lse / np.float32(LN2)).astype(np.float32))
        v_other = self.tensor(b.out.copy())
        s_other = self.tensor((b.lse / np.float32(LN2)).astype(np.float32))
        function(v, s, v_other, s_other)
        return AttentionState(out=v.numpy(), lse=(s.numpy() * np.float32(LN2)).astype(np.float32))


def tree_order(problem) -> np.ndarray:
    """TVM's ``tree_order`` ``(tokens, 2)`` int32: each draft's [enter, exit) interval of a
    depth-first walk of its sequence's draft tree (draft i sees draft j when j's interval
    holds i's enter). Refuses a visibility matrix that is no tree."""
    from conformance.references import tree_visibility

    order = np.zeros((problem.tokens, 2), dtype=np.int32)
    for b in range(problem.batch):
        rows = problem.rows_of([b])
        seen = problem.draft_mask[rows, :len(rows)]
        parents = np.array([max((j for j in range(i) if seen[i, j]), default=-1)
                            for i in range(len(rows))])
        if not np.array_equal(tree_visibility(parents), seen):
            raise ValueError(f"draft_mask of sequence {b} is not a tree (each draft seeing "
                             f"itself and its ancestors): TVM's tree kernel takes trees only")
        clock, stack = 0, [(int(root), False) for root in np.flatnonzero(parents == -1)[::-1]]
        while stack:  # depth first: enter a draft, walk its children, then leave it
            node, leaving = stack.pop()
            if leaving:
                order[rows[node], 1] = clock
                continue
            order[rows[node], 0] = clock
            clock += 1
            stack.append((node, True))
            stack.extend((int(child), False) for child in np.flatnonzero(parents == node)[::-1])
    return order


class TvmCpu(TvmBackend):
    name = "tvm-cpu"
    description = ("TVM 0.27 _attention_decode_cpu and _merge_state_inplace_cpu, LLVM target, "
                   "from the installed apache-tvm; _attention_prefill_cpu (causal) and "
                   "tree_attn_with_paged_kv_cache_cpu (a draft tree) for several query tokens "
                   "per sequence")
    target = "llvm"


class TvmCuda(TvmBackend):
    name = "tvm-cuda"
    description = ("TVM 0.27 _attention_decode and _merge_state_inplace, CUDA sm_90, from the "
                   "installed apache-tvm or an ahead-of-time build; _attention_prefill (causal) "
                   "and tree_attn_with_paged_kv_cache (a draft tree) for several query tokens "
                   "per sequence; _attention_prefill_mla (one query token: a decode) for MLA, "
                   "which has no CPU variant")
    target = "cuda"
    capturable = False  # TVM launches on the legacy default stream: no CUDA-graph capture
    # from an ahead-of-time build alone (no compiler), only the shapes it holds are claimed
    capabilities = claims(replace(TvmBackend.capabilities, devices=("cuda",),
                                  kinds=frozenset({"gqa", "mla"})), target)

    @classmethod
    def availability(cls) -> str | None:
        reason = super().availability()
        if reason:
            return reason
        tvm = kernels.import_tvm()
        try:
            kernels.prepare_cuda_runtime(aot_dir())  # registers TVM's CUDA device API
        except OSError as exc:
            return f"no CUDA driver ({exc})"
        if not tvm.cuda(0).exist:
            return "no CUDA device"
        return None

    def timing_device(self) -> str:
        return "cuda"
