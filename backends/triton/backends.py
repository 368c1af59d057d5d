"""The Triton kernels as suite backends: one adapter base, one small class per kernel."""

from __future__ import annotations

import numpy as np

from backends.base import AttentionState, Backend, Capabilities
from backends.triton import runtime

BF16_INTERPRETER = ("bfloat16 arithmetic is not supported by the Triton interpreter "
                    "(triton-lang/triton#11584, #4972); the case runs on a GPU")
FEATURES = frozenset({"lse", "merge", "sliding_window", "sinks"})


class TritonBackend(Backend):
    """Moves the canonical problem to the kernel's device, runs it, copies results back."""

    conversion = "none"  # what the adapter does to the layout before the kernel

    @classmethod
    def availability(cls) -> str | None:
        return runtime.unavailable_reason()

    def __init__(self) -> None:
        self.mode = runtime.select_mode()  # before any kernel module is imported

    def unsupported_reason(self, case) -> str | None:
        if self.mode.interpreted and case.dtype == "bfloat16":
            return BF16_INTERPRETER
        return super().unsupported_reason(case)

    def decode(self, problem, out, lse, *, num_splits=None) -> None:
        device = self.mode.device
        inputs = {name: runtime.to_torch(array, device)
                  for name, array in problem.arrays().items()}
        out_t, lse_t = runtime.to_torch(out, device), runtime.to_torch(lse, device)
        self.launch(problem, inputs, out_t, lse_t, num_splits)
        out[...] = runtime.to_numpy(out_t, out)
        lse[...] = runtime.to_numpy(lse_t, lse)

    def launch(self, problem, inputs: dict, out, lse, num_splits: int | None) -> None:
        raise NotImplementedError

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        from backends.triton.merge_kernel import merge_states

        device = self.mode.device
        out = np.full_like(a.out, np.nan)
        lse = np.full_like(a.lse, np.nan, dtype=np.float32)
        out_t, lse_t = runtime.to_torch(out, device), runtime.to_torch(lse, device)
        merge_states(runtime.to_torch(a.out, device), runtime.to_torch(a.lse, device),
                     runtime.to_torch(b.out, device), runtime.to_torch(b.lse, device),
                     out_t, lse_t)
        return AttentionState(out=runtime.to_numpy(out_t, out), lse=runtime.to_numpy(lse_t, lse))


class TritonSplitKV(TritonBackend):
    name = "triton-splitkv"
    description = ("paged split-KV flash decoding, GQA group packed in one tl.dot tile, "
                   "LSE combine kernel")
    capabilities = Capabilities(features=FEATURES | {"split_k"}, max_group_size=128,
                                head_dims=frozenset(range(16, 257)), split_counts=(1, 3, 8),
                                devices=("cuda", "cpu-interpreter"))

    def launch(self, problem, inputs, out, lse, num_splits) -> None:
        from backends.triton.splitkv_kernel import splitkv_decode

        splitkv_decode(inputs["q"], inputs["k_pages"], inputs["v_pages"],
                       inputs["block_table"], inputs["context_lens"], out, lse,
                       sm_scale=problem.sm_scale, window=problem.window, sinks=problem.sinks,
                       num_splits=num_splits, sm_count=self.mode.sm_count)


class TritonPaged(TritonBackend):
    name = "triton-paged"
    description = "paged decode, one program per (sequence, query head), no split"
    capabilities = Capabilities(features=FEATURES, head_dims=frozenset(range(1, 257)),
                                devices=("cuda", "cpu-interpreter"))

    def launch(self, problem, inputs, out, lse, num_splits) -> None:
        from backends.triton.paged_kernel import paged_decode

        paged_decode(inputs["q"], inputs["k_pages"], inputs["v_pages"], inputs["block_table"],
                     inputs["context_lens"], out, lse, sm_scale=problem.sm_scale,
                     window=problem.window, sinks=problem.sinks)


def contiguous_cache(problem) -> tuple[np.ndarray, np.ndarray]:
    """Gather the pages into ``(batch, qo_heads, max_len, head_dim)`` caches, each query head
    with its own copy of its KV head; slots past a context or evicted by the window are NaN,
    so the kernel must mask them."""
    batch, max_len = problem.batch, max(1, int(problem.context_lens.max(initial=0)))
    shape = (batch, max_len, problem.num_kv_heads, problem.head_dim)
    keys = np.full(shape, np.nan, dtype=problem.dtype)
    values = np.full(shape, np.nan, dtype=problem.dtype)
    for b in range(batch):
        kept = problem.kept(b)
        pages = problem.block_table[b, kept // problem.page_size]
        keys[b, kept] = problem.k_pages[pages, kept % problem.page_size]
        values[b, kept] = problem.v_pages[pages, kept % problem.page_size]
    kv_of_head = np.arange(problem.num_qo_heads) // problem.group_size
    return (np.ascontiguousarray(keys[:, :, kv_of_head].transpose(0, 2, 1, 3)),
            np.ascontiguousarray(values[:, :, kv_of_head].transpose(0, 2, 1, 3)))


class TritonContiguous(TritonBackend):
    name = "triton-contiguous"
    description = ("split-K decode over a contiguous (batch, heads, seq, dim) cache, KV "
                   "expanded to every query head; the adapter gathers the pages")
    capabilities = Capabilities(features=FEATURES | {"split_k"}, split_counts=(1, 3, 8),
                                head_dims=frozenset(range(1, 257)),
                                devices=("cuda", "cpu-interpreter"))

    def launch(self, problem, inputs, out, lse, num_splits) -> None:
        from backends.triton.contiguous_kernel import contiguous_decode

        keys, values = contiguous_cache(problem)
        device = self.mode.device
        contiguous_decode(inputs["q"], runtime.to_torch(keys, device),
                          runtime.to_torch(values, device), inputs["context_lens"], out, lse,
                          sm_scale=problem.sm_scale, window=problem.window, sinks=problem.sinks,
                          num_splits=num_splits, sm_count=self.mode.sm_count)
