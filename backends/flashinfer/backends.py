"""Adapters for FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` and ``merge_state``.

The canonical NHD pages are FlashInfer's own layout; the adapter builds its CSR page table
(``indptr``, ``indices``, ``last_page_len``) from the block table and declares what FlashInfer
documents: a base-2 LSE (``state.cuh``: ``m + log2(d)``), also what ``cascade.merge_state``
takes and returns. A sliding window is ``window_left = window - 1``; pages the window evicted
entirely (``-1`` inside the context) are given to FlashInfer as physical page 0, which no
sequence owns and which holds garbage (or NaN): the window must keep the kernel from attending
to them. FlashInfer's ``sinks`` argument is per-head sink *logits*, not kept tokens, so
StreamingLLM sinks are not claimed (two passes merged with ``merge_state`` would do them;
the adapter does not pretend that is one kernel). An fp8 cache is passed as FlashInfer's
users pass it: ``kv_data_type`` at plan, and ``run(k_scale=, v_scale=)`` as floats, which
FlashInfer folds into sm_scale and multiplies into the output ("The calibration scale of key
for fp8 input"): per-tensor scales only.

The score modifiers go where FlashInfer's users put them: ``logits_soft_cap`` and
``pos_encoding_mode="ALIBI"`` at plan (its slopes are ``get_alibi_slopes(num_qo_heads)``, the
standard ones; explicit slopes are not accepted), the per-head sink logits as ``run(sinks=)``,
documented as "appended to each row of the softmax denominator" (its fa2 kernels ignore them:
a finding, in the manifests). ALiBi with a soft-cap is not claimed: ``variants.cuh`` adds the
bias inside the cap and scales the score twice (the spec caps, then biases).

Several query tokens per sequence go where serving stacks send speculative verification:
``flashinfer-prefill`` is ``BatchPrefillWithPagedKVCacheWrapper`` over the same pages, the
packed queries' ``qo_indptr``, ``causal=True`` (FlashInfer aligns the causal mask to the end
of the KV, as the spec places the drafts), and for a draft mask its documented
``custom_mask``: per request a ``(query_len, kv_len)`` boolean block, flattened and joined.
The decode wrappers take one query token per sequence; the prefill adapter takes only
several (one token a sequence is the decode wrappers' job). It asks for the ``fa2`` kernels,
the ones the tensor-core decode runs: ``backend="auto"`` picks ``fa3`` on Hopper for a causal
mask (``fa2`` for a custom one), whose JIT build needs CUTLASS (not in the carried bundle)
and minutes per module; an ``fa3`` adapter is this class with ``kernels = "fa3"``.

``flashinfer-mla`` is ``BatchMLAPagedAttentionWrapper`` as DeepSeek serving stacks call it,
in the planned form FlashInfer 0.7 documents (``metadata=MLAPlanMetadata.csr(...)``, then
``run(query=(q_nope, q_pe), kv_cache=(ckv, kpe))``): the problem's latent pool is one tensor
and its latent and rotary caches are adjacent views of it, as a serving stack slices one
buffer; one query token per sequence (``causal=False``), a base-2 LSE (``lse_mode="base2"``),
``backend="fa2"`` for the reason above. It has no window and no sinks argument.
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from functools import cache

import numpy as np

from conformance.backends.base import AttentionState, Backend, Capabilities, Conventions
from conformance.backends.tensors import to_numpy_many, to_torch

WORKSPACE_BYTES = 256 * 1024 * 1024
FP8_SCALES = ("FlashInfer's decode takes k_scale and v_scale as floats (run(): 'The "
              "calibration scale of key for fp8 input'): per-tensor scales only")
ALIBI_WITH_CAP = ("FlashInfer adds the ALiBi bias inside the soft-cap and scales the score "
                  "twice (variants.cuh LogitsTransform; docs/findings/"
                  "flashinfer-alibi-softcap-scale-twice.md); the spec caps, then adds the bias")
# BatchDecodeWithPagedKVCacheWrapper's CUDA-core path: group sizes it dispatches
# (others raise "Unsupported group_size"); use_tensor_cores takes the prefill kernels.
CUDA_CORE_GROUP_SIZES = frozenset({1, 2, 3, 4, 6, 8, 16})


@cache
def load_flashinfer():
    """The ``flashinfer`` package, or its decode and cascade modules alone when importing
    the whole package fails for an optional dependency the machine lacks."""
    try:
        import flashinfer

        return flashinfer
    except ImportError:
        import importlib.util

        spec = importlib.util.find_spec("flashinfer")
        if spec is None or not spec.submodule_search_locations:
            raise
        package = types.ModuleType("flashinfer")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["flashinfer"] = package
        import flashinfer.cascade
        import flashinfer.decode
        import flashinfer.prefill

        package.BatchDecodeWithPagedKVCacheWrapper = \
            flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper
        package.BatchPrefillWithPagedKVCacheWrapper = \
            flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper
        package.merge_state = flashinfer.cascade.merge_state
        return package


def csr_page_table(problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's ``indptr``, ``indices`` and ``last_page_len`` (int32) for the problem."""
    ps = problem.page_size
    indices, indptr, last = [], [0], []
    for b in range(problem.batch):
        n = int(problem.context_lens[b])
        pages = problem.block_table[b, :-(-n // ps)] if n else problem.block_table[b, :0]
        indices.extend(np.where(pages >= 0, pages, 0).tolist())  # evicted: page 0 (garbage)
        indptr.append(len(indices))
        last.append(n - (len(pages) - 1) * ps if n else 0)
    return (np.asarray(indptr, np.int32), np.asarray(indices, np.int32),
            np.asarray(last, np.int32))


class FlashInferDecode(Backend):
    """``BatchDecodeWithPagedKVCacheWrapper`` on the canonical NHD pages."""

    name = "flashinfer"
    description = ("FlashInfer BatchDecodeWithPagedKVCacheWrapper (CUDA cores), NHD pages, "
                   "CSR page table; cascade.merge_state as the merge")
    capabilities = Capabilities(dtypes=frozenset({"float16", "bfloat16"}),
                                head_dims=frozenset({64, 128, 256}),
                                group_sizes=CUDA_CORE_GROUP_SIZES,
                                features=frozenset({"lse", "merge", "sliding_window",
                                                    "soft_cap", "sink_logits", "alibi"}),
                                devices=("cuda",),
                                kv_dtypes=frozenset({"float8_e4m3fn", "float8_e5m2"}),
                                kv_scales=frozenset({"per-tensor"}))
    conventions = Conventions(lse_base=2.0)
    use_tensor_cores = False

    @classmethod
    def preload(cls) -> None:
        import torch  # noqa: F401  (not FlashInfer: what it does on import is its own)

    @classmethod
    def availability(cls) -> str | None:
        try:
            import torch
        except ImportError as exc:
            return f"torch is not importable ({exc})"
        if not torch.cuda.is_available():
            return "FlashInfer needs a CUDA GPU; none is visible"
        try:
            load_flashinfer()
        except Exception as exc:
            return f"flashinfer is not importable ({type(exc).__name__}: {exc}); pip install " \
                   f"-e '.[flashinfer]'"
        return None

    def __init__(self) -> None:
        import torch

        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    def unsupported_reason(self, case) -> str | None:
        if case.kv_dtype is not None and case.kv_scale != "per-tensor":
            return f"kv scale {case.kv_scale}: {FP8_SCALES}"
        if case.alibi is not True and case.alibi:
            return ("explicit ALiBi slopes: FlashInfer computes its own "
                    "(get_alibi_slopes(num_qo_heads), the standard slopes)")
        if case.alibi and case.soft_cap is not None:
            return f"ALiBi with a soft-cap: {ALIBI_WITH_CAP}"
        return super().unsupported_reason(case)

    def notes(self) -> list[str]:
        flashinfer = load_flashinfer()
        return [f"flashinfer {getattr(flashinfer, '__version__', '(version unknown)')}, "
                f"use_tensor_cores={self.use_tensor_cores}"]

    def timing_device(self) -> str:
        return "cuda"

    def decode(self, problem, out, lse, *, num_splits=None) -> None:
        call = self.prepare(problem, out, lse)
        call()
        out[...], lse[...] = to_numpy_many([(self.results[0], out),  # LSE base 2 -> natural
                                            (self.results[1] * np.log(2.0), lse)])

    def prepare(self, problem, out, lse, *, num_splits=None):
        q = to_torch(problem.q, "cuda")
        k, v = to_torch(problem.k_pages, "cuda"), to_torch(problem.v_pages, "cuda")
        wrapper = self.planned(problem, q, k)
        extra = self.run_arguments(problem)

        def call() -> None:
            self.results = wrapper.run(q, (k, v), return_lse=True, **extra)
        return call

    def planned(self, problem, q, k):
        """The wrapper, planned for the problem."""
        wrapper = load_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores)
        wrapper.plan(*(to_torch(a, "cuda") for a in csr_page_table(problem)),
                     problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                     problem.page_size, **self.plan_options(problem, q, k))
        return wrapper

    def plan_options(self, problem, q, k) -> dict:
        """What ``plan()`` takes besides the page table and the shape: the window, dtypes,
        scale, soft-cap and ALiBi."""
        return {"window_left": problem.window - 1 if problem.window is not None else -1,
                "q_data_type": q.dtype, "kv_data_type": k.dtype, "sm_scale": problem.sm_scale,
                "logits_soft_cap": problem.soft_cap,
                "pos_encoding_mode": "NONE" if problem.alibi_slopes is None else "ALIBI"}

    def run_arguments(self, problem) -> dict:
        """What ``run()`` takes besides q and the pages: per-tensor fp8 scales as floats,
        the sink logits."""
        extra = {}
        if problem.k_scale is not None:  # per-tensor: FlashInfer's float arguments
            extra = {"k_scale": float(problem.k_scale[0]), "v_scale": float(problem.v_scale[0])}
        if problem.sink_logits is not None:
            extra["sinks"] = to_torch(problem.sink_logits, "cuda")
        return extra

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        flashinfer = load_flashinfer()
        to_base2 = np.float32(1.0 / np.log(2.0))
        v, s = flashinfer.merge_state(to_torch(a.out, "cuda"), to_torch(a.lse * to_base2, "cuda"),
                                      to_torch(b.out, "cuda"), to_torch(b.lse * to_base2, "cuda"))
        merged_out, merged_lse = to_numpy_many([(v, a.out), (s, a.lse)])
        return AttentionState(out=merged_out, lse=(merged_lse / to_base2).astype(np.float32))


class FlashInferTensorCores(FlashInferDecode):
    name = "flashinfer-tc"
    description = ("FlashInfer BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True): the "
                   "prefill kernels, any group size; cascade.merge_state as the merge")
    capabilities = replace(FlashInferDecode.capabilities, group_sizes=None)
    use_tensor_cores = True



def custom_mask(problem) -> np.ndarray:
    """FlashInfer's ``custom_mask``: per sequence a ``(query_len, kv_len)`` boolean block
    (the context before the drafts visible, the drafts as the draft mask says), flattened
    row-major and joined in batch order."""
    blocks = []
    for b, (n, query_len) in enumerate(zip(problem.context_lens.tolist(),
                                           problem.row_lens.tolist(), strict=True)):
        rows = problem.rows_of([b])
        block = np.ones((query_len, n), dtype=bool)
        block[:, n - query_len:] = problem.draft_mask[rows, :query_len]
        blocks.append(block.reshape(-1))
    return np.concatenate(blocks)


class FlashInferPrefill(FlashInferDecode):
    name = "flashinfer-prefill"
    description = ("FlashInfer BatchPrefillWithPagedKVCacheWrapper over the paged cache: the "
                   "speculative-verification path (causal=True, custom_mask for a draft mask)")
    capabilities = replace(FlashInferDecode.capabilities, group_sizes=None,
                           features=FlashInferDecode.capabilities.features
                           | {"multi_token", "draft_mask"})
    kernels = "fa2"  # FlashInfer's backend= (see the module docstring)

    def unsupported_reason(self, case) -> str | None:
        if case.query_lens is None:
            return ("one query token per sequence: the decode wrappers (flashinfer, "
                    "flashinfer-tc) are FlashInfer's path for it")
        return super().unsupported_reason(case)

    def notes(self) -> list[str]:
        flashinfer = load_flashinfer()
        return [f"flashinfer {getattr(flashinfer, '__version__', '(version unknown)')}, "
                f"BatchPrefillWithPagedKVCacheWrapper(backend={self.kernels!r})"]

    def planned(self, problem, q, k):
        mask = None if problem.draft_mask is None else to_torch(custom_mask(problem), "cuda")
        wrapper = load_flashinfer().BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", backend=self.kernels)
        wrapper.plan(to_torch(problem.query_start, "cuda"),
                     *(to_torch(a, "cuda") for a in csr_page_table(problem)),
                     problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                     problem.page_size, custom_mask=mask, causal=mask is None,
                     **self.plan_options(problem, q, k))
        return wrapper


class FlashInferMla(FlashInferDecode):
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on the problem's latent cache."""

    name = "flashinfer-mla"
    description = ("FlashInfer BatchMLAPagedAttentionWrapper (fa2): the latent and rotary "
                   "caches as split views of one page pool, CSR page table; merge_state")
    capabilities = Capabilities(kinds=frozenset({"mla"}), dtypes=frozenset({"float16",
                                                                             "bfloat16"}),
                                latent_dims=frozenset({(512, 64)}),
                                features=frozenset({"lse", "merge"}), devices=("cuda",))
    kernels = "fa2"  # the planned backend (see the module docstring)

    def notes(self) -> list[str]:
        flashinfer = load_flashinfer()
        return [f"flashinfer {getattr(flashinfer, '__version__', '(version unknown)')}, "
                f"BatchMLAPagedAttentionWrapper(backend={self.kernels!r})"]

    def prepare(self, problem, out, lse, *, num_splits=None):
        import importlib

        mla = importlib.import_module("flashinfer.mla")
        rank = problem.kv_lora_rank
        q = to_torch(problem.q, "cuda")
        pages = to_torch(problem.k_pages, "cuda")[:, :, 0]  # (pages, page_size, rank + rope)
        indptr, indices, _ = (to_torch(a, "cuda") for a in csr_page_table(problem))
        metadata = mla.MLAPlanMetadata.csr(to_torch(problem.query_start, "cuda"), indptr,
                                           indices, to_torch(problem.context_lens, "cuda"))
        wrapper = mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=self.kernels)
        wrapper.plan(metadata=metadata, num_heads=problem.num_qo_heads, head_dim_ckv=rank,
                     head_dim_kpe=problem.rope_dim, page_size=problem.page_size, causal=False,
                     sm_scale=problem.sm_scale, q_data_type=q.dtype, kv_data_type=pages.dtype,
                     query_layout="split", kv_cache_layout="split", lse_mode="base2")
        query, cache = (q[..., :rank], q[..., rank:]), (pages[..., :rank], pages[..., rank:])

        def call() -> None:
            self.results = wrapper.run(query=query, kv_cache=cache, return_lse=True)
        return call
