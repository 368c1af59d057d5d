"""The Triton kernels as suite backends: one adapter base, one small class per kernel."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np

from conformance.backends.base import AttentionState, Backend, Capabilities
from conformance.backends.tensors import to_numpy_many, to_torch, to_torch_many
from conformance.backends.triton import runtime

BF16_INTERPRETER = ("bfloat16 arithmetic is not supported by the Triton interpreter "
                    "(triton-lang/triton#11584, #4972); the case runs on a GPU")
E5M2_INTERPRETER = ("the Triton interpreter converts e5m2 subnormal codes to float16 wrongly "
                    "(2^-15 and 2^-16 become 0; docs/findings/triton-interpreter-e5m2-"
                    "subnormals.md; its converter's float16 -> e5m2 direction is "
                    "triton-lang/triton#8322); the case runs on a GPU")
FEATURES = frozenset({"lse", "merge", "sliding_window", "sinks"})
MODIFIERS = frozenset({"soft_cap", "sink_logits", "alibi"})  # the paged kernels take them
# what the paged kernels read: both fp8 formats in every scale layout, and an fp8 query
FP8 = {"kv_dtypes": frozenset({"float8_e4m3fn", "float8_e5m2"}),
       "kv_scales": frozenset({"per-tensor", "per-head", "per-token"}),
       "q_dtypes": frozenset({"float8_e4m3fn", "float8_e5m2"})}


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonBackend(Backend):
    """Moves the canonical problem to the kernel's device, runs it, copies results back."""

    conversion = "none"  # what the adapter does to the layout before the kernel

    @classmethod
    def availability(cls) -> str | None:
        return runtime.unavailable_reason()

    @classmethod
    def preload(cls) -> Iterator[None]:
        return runtime.preload()

    def __init__(self) -> None:
        self.mode = runtime.select_mode()  # before any kernel module is imported
        runtime.start_early(self.mode)

    def unsupported_reason(self, case) -> str | None:
        if self.mode.interpreted and case.dtype == "bfloat16":
            return BF16_INTERPRETER
        return super().unsupported_reason(case)

    def decode(self, problem, out, lse, *, num_splits=None) -> None:
        out_t, lse_t = self.upload(out), self.upload(lse)
        self.bind(problem, out_t, lse_t, num_splits, validate=True)()
        out[...], lse[...] = to_numpy_many([(out_t, out), (lse_t, lse)])

    def prepare(self, problem, out, lse, *, num_splits=None):
        out_t, lse_t = self.upload(out), self.upload(lse)
        self.bind(problem, out_t, lse_t, num_splits, validate=True)()  # checks and compiles
        return self.bind(problem, out_t, lse_t, num_splits, validate=False)

    def timing_device(self) -> str:
        return self.mode.device

    def upload(self, array: np.ndarray):
        return to_torch(array, self.mode.device)

    def bind(self, problem, out, lse, num_splits: int | None, validate: bool):
        """Convert the problem for the kernel and return the launch, ready to call."""
        raise NotImplementedError

    def inputs(self, problem) -> dict:
        return to_torch_many(problem.arrays(), self.mode.device)

    def scales(self, tensors: dict, problem):
        """The kernels' ``Scales`` for an fp8 cache or query: the problem's own arrays, on
        the device; the kernel dequantizes."""
        from conformance.backends.triton.validation import Scales

        return Scales(problem.kv_scale, tensors.get("k_scale"), tensors.get("v_scale"),
                      tensors.get("q_scale"))

    def queries(self, tensors: dict, problem):
        """The kernels' ``Queries`` for several query tokens per sequence (None for one):
        the packed rows' start offsets and the problem's draft mask, on the device."""
        from conformance.backends.triton.validation import Queries

        if problem.query_lens is None:
            return None
        return Queries(self.upload(problem.query_start), int(problem.query_lens.max()),
                       tensors.get("draft_mask"))

    def modifiers(self, tensors: dict, problem):
        """The kernels' ``ScoreModifiers``: the problem's soft-cap, sink logits and slopes."""
        from conformance.backends.triton.validation import ScoreModifiers

        return ScoreModifiers(problem.soft_cap, tensors.get("sink_logits"),
                              tensors.get("alibi_slopes"))

    def splits(self, problem, num_splits: int | None, block_n: int, waves: float = 2.0,
               programs_per_split: int | None = None) -> int:
        """The split count: the caller's, or the heuristic on the host-side problem."""
        from conformance.backends.triton.kernel_common import choose_splits

        if num_splits:
            return num_splits
        longest = max((len(problem.kept(r)) for r in range(problem.tokens)), default=0)
        return choose_splits(problem.batch, programs_per_split or problem.num_kv_heads,
                             longest, self.mode.sm_count, block_n, waves)

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        from conformance.backends.triton.merge_kernel import merge_states

        device = self.mode.device
        out = np.full_like(a.out, np.nan)
        lse = np.full_like(a.lse, np.nan, dtype=np.float32)
        tensors = to_torch_many({"a.out": a.out, "a.lse": a.lse, "b.out": b.out,
                                 "b.lse": b.lse, "out": out, "lse": lse}, device)
        out_t, lse_t = tensors["out"], tensors["lse"]
        merge_states(tensors["a.out"], tensors["a.lse"], tensors["b.out"], tensors["b.lse"],
                     out_t, lse_t)
        merged_out, merged_lse = to_numpy_many([(out_t, out), (lse_t, lse)])
        return AttentionState(out=merged_out, lse=merged_lse)


class TritonSplitKV(TritonBackend):
    name = "triton-splitkv"
    description = ("paged split-KV flash decoding, GQA group (times the query tokens of a "
                   "sequence) packed in one tl.dot tile, LSE combine kernel")
    capabilities = Capabilities(features=FEATURES | MODIFIERS | {"split_k", "multi_token",
                                                                 "draft_mask"},
                                max_group_size=128, head_dims=frozenset(range(16, 257)),
                                split_counts=(1, 3, 8), devices=("cuda", "cpu-interpreter"),
                                **FP8)
    MAX_ROWS = 128  # query tokens x group (each padded to a power of two) in one tile

    def unsupported_reason(self, case) -> str | None:
        if case.query_lens is not None:
            rows = _next_power_of_2(max(case.query_lens)) * _next_power_of_2(case.group_size)
            if rows > self.MAX_ROWS:
                return (f"{max(case.query_lens)} query tokens x a group of {case.group_size} "
                        f"are {rows} tile rows (padded to powers of two); the kernel packs at "
                        f"most {self.MAX_ROWS}")
        # codes that go into tl.dot as float16 as they are: per-program scales, an fp8 query
        direct = (case.kv_dtype == "float8_e5m2" and case.kv_scale != "per-token") or \
            case.q_dtype == "float8_e5m2"
        if self.mode.interpreted and direct and case.dtype == "float16":
            return E5M2_INTERPRETER
        return super().unsupported_reason(case)

    def bind(self, problem, out, lse, num_splits, validate):
        from conformance.backends.triton.splitkv_kernel import splitkv_decode, tile_config

        tensors = self.inputs(problem)
        config = tile_config(problem.head_dim, problem.kv_scale is not None,
                             batch=problem.batch)
        splits = self.splits(problem, num_splits, config["BLOCK_N"], config["waves"])
        return partial(splitkv_decode, tensors["q"], tensors["k_pages"], tensors["v_pages"],
                       tensors["block_table"], tensors["context_lens"], out, lse,
                       sm_scale=problem.sm_scale, window=problem.window, sinks=problem.sinks,
                       num_splits=splits, validate=validate,
                       scales=self.scales(tensors, problem),
                       modifiers=self.modifiers(tensors, problem),
                       queries=self.queries(tensors, problem))


class TritonPaged(TritonBackend):
    name = "triton-paged"
    description = "paged decode, one program per (sequence, query head), no split"
    capabilities = Capabilities(features=FEATURES | MODIFIERS,
                                head_dims=frozenset(range(1, 257)),
                                devices=("cuda", "cpu-interpreter"), **FP8)

    def bind(self, problem, out, lse, num_splits, validate):
        from conformance.backends.triton.paged_kernel import paged_decode

        tensors = self.inputs(problem)
        return partial(paged_decode, tensors["q"], tensors["k_pages"], tensors["v_pages"],
                       tensors["block_table"], tensors["context_lens"], out, lse,
                       sm_scale=problem.sm_scale, window=problem.window, sinks=problem.sinks,
                       validate=validate, scales=self.scales(tensors, problem),
                       modifiers=self.modifiers(tensors, problem))


class TritonMla(TritonBackend):
    name = "triton-mla"
    description = ("paged split-KV MLA decode: 16 query heads of the one latent in a tl.dot "
                   "tile, the latent tile read once as key and value, LSE combine kernel")
    capabilities = Capabilities(kinds=frozenset({"mla"}), features=FEATURES | {"split_k"},
                                split_counts=(1, 3, 8), devices=("cuda", "cpu-interpreter"))
    INTERPRETED_RANK = 128  # the widest latent the interpreter runs in CI time

    def unsupported_reason(self, case) -> str | None:
        if (self.mode.interpreted and case.kv_lora_rank is not None
                and case.kv_lora_rank > self.INTERPRETED_RANK):
            return (f"kv_lora_rank {case.kv_lora_rank}: the Triton interpreter runs latents "
                    f"up to {self.INTERPRETED_RANK} wide in CI time; the real widths run "
                    f"compiled on a GPU")
        return super().unsupported_reason(case)

    def bind(self, problem, out, lse, num_splits, validate):
        from conformance.backends.triton.mla_kernel import mla_decode, tile_config

        tensors = self.inputs(problem)
        config = tile_config(problem.kv_lora_rank, problem.num_qo_heads, problem.batch)
        blocks = -(-problem.num_qo_heads // config["BLOCK_H"])
        return partial(mla_decode, tensors["q"], tensors["k_pages"], tensors["block_table"],
                       tensors["context_lens"], out, lse, kv_lora_rank=problem.kv_lora_rank,
                       sm_scale=problem.sm_scale, window=problem.window, sinks=problem.sinks,
                       num_splits=self.splits(problem, num_splits, config["BLOCK_N"],
                                              config["waves"], programs_per_split=blocks),
                       validate=validate)


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
        keys[b, kept], values[b, kept] = problem.gather(b, kept)
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

    def bind(self, problem, out, lse, num_splits, validate):
        from conformance.backends.triton.contiguous_kernel import BLOCK_N, contiguous_decode

        keys, values = contiguous_cache(problem)
        return partial(contiguous_decode, self.upload(problem.q), self.upload(keys),
                       self.upload(values), self.upload(problem.context_lens), out, lse,
                       sm_scale=problem.sm_scale, window=problem.window, sinks=problem.sinks,
                       num_splits=self.splits(problem, num_splits, BLOCK_N,
                                              programs_per_split=problem.num_qo_heads),
                       validate=validate)
