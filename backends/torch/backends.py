"""Adapters for PyTorch's attention kernels: they convert layouts and declare conventions.

``torch-flex`` runs ``flex_attention`` over the whole page pool, flattened to one sequence
``(1, kv_heads, pages * page_size, dim)``, with a block mask whose ``mask_mod`` maps each
physical slot back to its sequence and position and applies the window and the sinks: no
page is gathered. Uncompiled on a CPU (PyTorch's dense reference path), compiled with
``torch.compile`` on CUDA (the flex-decoding kernel serving stacks use). Soft-cap and ALiBi
are its ``score_mod`` (on the scaled score, as flex applies it); a sink logit is a term of the
denominator with no key, which neither a mask nor a score_mod can add: not claimed. An MLA
problem is one KV head whose value is a narrower view of its key (flex takes a value width of
its own): ``q`` ``[q_nope | q_pe]`` against ``[latent | rope]``, ``enable_gqa`` over every head.

``torch-sdpa`` gathers each sequence's pages into a contiguous cache (outside the timed call)
and calls the op ``F.scaled_dot_product_attention`` dispatches to, in the variant that
returns the LSE: ``_scaled_dot_product_flash_attention_for_cpu`` on a CPU,
``_scaled_dot_product_efficient_attention`` on CUDA. Neither library has a merge kernel the
suite could call: no ``merge`` feature. ALiBi is part of the float mask it takes (in the
query's dtype, as the CPU op requires); a soft-cap and sink logits it has no way to take.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from conformance.backends.base import Backend, Capabilities
from conformance.backends.tensors import to_numpy_many, to_torch

FEATURES = frozenset({"lse", "sliding_window", "sinks"})


def torch_unavailable() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return f"torch is not importable ({exc}); pip install -e '.[torch]'"
    return None


@cache
def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchBackend(Backend):
    """Uploads the problem, runs the op ``prepare`` binds, copies the results back."""

    @classmethod
    def availability(cls) -> str | None:
        return torch_unavailable()

    @classmethod
    def preload(cls) -> None:
        import torch  # noqa: F401

    def decode(self, problem, out, lse, *, num_splits=None) -> None:
        result = self.prepare(problem, out, lse, num_splits=num_splits)
        result()
        self.write_back(out, lse)

    def write_back(self, out: np.ndarray, lse: np.ndarray) -> None:
        out_t, lse_t = self.results
        out[...], lse[...] = to_numpy_many([(out_t, out), (lse_t, lse)])

    def timing_device(self) -> str:
        return device()

    def upload(self, array: np.ndarray):
        return to_torch(array, device())


def slot_positions(problem) -> np.ndarray:
    """``(batch, pages * page_size)`` int32: the position each physical slot holds in each
    sequence, -1 where it holds none of that sequence's tokens (window and sinks not applied:
    that is the mask function's job)."""
    slots = np.full((problem.batch, problem.k_pages.shape[0] * problem.page_size), -1,
                    dtype=np.int32)
    for b in range(problem.batch):
        positions = np.arange(int(problem.context_lens[b]))
        pages, slot = problem.slots(b, positions)
        live = pages >= 0  # a page the window evicted entirely is -1 in the table
        slots[b, pages[live] * problem.page_size + slot[live]] = positions[live]
    return slots


COMPILED_MIN_HEAD_DIM = 16  # Inductor's flex lowering raises NYI below (seen on the H200)


class TorchFlex(TorchBackend):
    name = "torch-flex"
    description = ("torch flex_attention over the flattened page pool, a block mask mapping "
                   "slots to (sequence, position); compiled on CUDA, eager on a CPU")
    capabilities = Capabilities(features=FEATURES | {"soft_cap", "alibi", "multi_token",
                                                     "draft_mask"},
                                devices=("cpu", "cuda"), kinds=frozenset({"gqa", "mla"}))

    @classmethod
    def availability(cls) -> str | None:
        reason = torch_unavailable()
        if reason:
            return reason
        from torch.nn.attention import flex_attention

        if not hasattr(flex_attention, "AuxRequest"):
            return "this torch has no flex_attention AuxRequest (torch >= 2.9 returns the LSE so)"
        return None

    def __init__(self) -> None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        self.compiled = device() == "cuda"
        if self.compiled:
            # every shape of the spec compiles once; the default limit of 8 would fall back
            # to the eager path silently
            torch._dynamo.config.cache_size_limit = 4096
            torch._dynamo.config.accumulated_cache_size_limit = 4096
            self.flex = torch.compile(flex_attention, dynamic=False)
        else:
            self.flex = flex_attention

    def unsupported_reason(self, case) -> str | None:
        if device() == "cuda" and case.head_dim < COMPILED_MIN_HEAD_DIM:
            return (f"head_dim {case.head_dim}: compiled flex_attention lowers only head_dim >= "
                    f"{COMPILED_MIN_HEAD_DIM} ('NYI: embedding dimension of the query, key, and "
                    f"value must be at least 16')")
        return super().unsupported_reason(case)

    def prepare(self, problem, out, lse, *, num_splits=None):
        import torch
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

        batch, hq, hkv, d = problem.batch, problem.num_qo_heads, problem.num_kv_heads, \
            problem.head_dim
        slots_total = problem.k_pages.shape[0] * problem.page_size
        q = self.upload(padded_queries(problem))  # (batch, hq, drafts, d)
        k = self.upload(problem.k_pages).reshape(slots_total, hkv, d).transpose(0, 1)[None]
        if problem.kind == "mla":  # the value is the key's latent: a narrower view of it
            v = k[..., :problem.head_dim_v]
        else:
            v = self.upload(problem.v_pages).reshape(slots_total, hkv, d).transpose(0, 1)[None]
        positions = self.upload(slot_positions(problem))
        rows = problem.padded_rows()
        # each padded query row's position (-1: padding, sees nothing) and what it sees
        query_at = self.upload(np.where(rows >= 0, problem.query_positions[rows], -1))
        first_draft = self.upload(problem.context_lens - problem.row_lens.astype(np.int32))
        seen = None if problem.draft_mask is None else self.upload(
            np.where((rows >= 0)[..., None], problem.draft_mask[rows], False))
        window, sinks = problem.window, problem.sinks

        def mask_mod(b, h, q_idx, kv_idx):
            position, query = positions[b, kv_idx], query_at[b, q_idx]
            keep = (position >= 0) & (query >= 0)
            if seen is None:
                keep = keep & (position <= query)
            else:
                draft = position - first_draft[b]
                keep = keep & ((draft < 0) | seen[b, q_idx, draft.clamp(min=0)])
            if window is not None:
                keep = keep & ((position > query - window) | (position < sinks))
            return keep

        block_mask = create_block_mask(mask_mod, batch, None, q.shape[2], slots_total,
                                       device=device())
        scale = float(problem.sm_scale)
        score_mod = self.score_mod(problem, positions, query_at)

        def call() -> None:
            output, aux = self.flex(q, k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1),
                                    score_mod=score_mod, block_mask=block_mask, scale=scale,
                                    enable_gqa=hq != hkv, return_aux=AuxRequest(lse=True))
            self.results = (packed(output, problem), packed(aux.lse, problem))
        self.results = (torch.empty(0), torch.empty(0))
        return call

    def score_mod(self, problem, positions, query_at):
        """The problem's soft-cap and ALiBi as a flex ``score_mod``, or None without them."""
        import torch

        cap = problem.soft_cap
        slopes = None if problem.alibi_slopes is None else self.upload(problem.alibi_slopes)
        if cap is None and slopes is None:
            return None

        def score_mod(score, b, h, q_idx, kv_idx):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score + slopes[h] * (positions[b, kv_idx] - query_at[b, q_idx])
            return score
        return score_mod


def contiguous_cache(problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys and values gathered into ``(batch, kv_heads, longest, dim)`` (zeros past a
    sequence) and, per query row, whether each position is attended to (window, sinks and
    draft mask applied)."""
    longest = max(1, int(problem.context_lens.max(initial=0)))
    shape = (problem.batch, longest, problem.num_kv_heads, problem.head_dim)
    keys = np.zeros(shape, dtype=problem.dtype)
    values = np.zeros(shape, dtype=problem.dtype)
    attended = np.zeros((problem.tokens, longest), dtype=bool)
    for row, b in enumerate(problem.row_sequence):
        kept = problem.kept(row)
        keys[b, kept], values[b, kept] = problem.gather(b, kept)
        attended[row, kept] = True
    return keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3), attended


def attention_bias(problem, attended: np.ndarray) -> np.ndarray:
    """``(batch, heads, longest query_len, longest)`` float32, the queries padded per
    sequence: -inf where a position is not attended to, else 0, or the ALiBi bias
    ``slope_h * (position - query position)``. A padding row attends to position 0 (its
    result is dropped), so that no row is all -inf."""
    bias = np.where(attended, 0.0, -np.inf)[:, None, :].repeat(problem.num_qo_heads, axis=1)
    if problem.alibi_slopes is not None:
        offsets = np.arange(attended.shape[1])[None, :] - problem.query_positions[:, None]
        bias = bias + problem.alibi_slopes[None, :, None] * offsets[:, None, :]
    rows = problem.padded_rows()
    padded = np.where((rows >= 0)[:, None, :, None], bias[rows].transpose(0, 2, 1, 3), 0.0)
    return padded.astype(np.float32)


def padded_queries(problem) -> np.ndarray:
    """q as ``(batch, heads, longest query_len, dim)``, zeros in padding rows."""
    rows = problem.padded_rows()
    q = np.where((rows >= 0)[..., None, None], problem.q[rows], 0).astype(problem.q.dtype)
    return np.ascontiguousarray(q.transpose(0, 2, 1, 3))


def packed(tensor, problem):
    """``(batch, heads, longest query_len[, dim])`` results back to the packed query rows."""
    import torch

    sequence, draft = np.nonzero(problem.padded_rows() >= 0)  # row-major: the packed order
    return tensor[torch.as_tensor(sequence, device=tensor.device), :,
                  torch.as_tensor(draft, device=tensor.device)]


class TorchSdpa(TorchBackend):
    name = "torch-sdpa"
    description = ("the LSE-returning op behind F.scaled_dot_product_attention over pages "
                   "gathered into a contiguous cache (flash for CPU, memory-efficient on CUDA)")
    capabilities = Capabilities(features=FEATURES | {"alibi", "multi_token", "draft_mask"},
                                devices=("cpu", "cuda"))

    def prepare(self, problem, out, lse, *, num_splits=None):
        import torch

        keys, values, attended = contiguous_cache(problem)
        bias = attention_bias(problem, attended)  # (batch, heads, queries, longest)
        scale = float(problem.sm_scale)
        q = self.upload(padded_queries(problem))
        if device() == "cuda":
            # the memory-efficient kernel wants one KV head per query head and a bias whose
            # last dimension is a multiple of 16
            group = problem.group_size
            k = self.upload(np.ascontiguousarray(np.repeat(keys, group, axis=1)))
            v = self.upload(np.ascontiguousarray(np.repeat(values, group, axis=1)))
            padded = -(-attended.shape[1] // 16) * 16
            full = np.full((*bias.shape[:3], padded), -np.inf, dtype=np.float32)
            full[..., :attended.shape[1]] = bias
            bias_t = self.upload(full).to(q.dtype)[..., :attended.shape[1]]
            op = torch.ops.aten._scaled_dot_product_efficient_attention

            def call() -> None:
                output, log_sum_exp, _, _ = op(q, k, v, bias_t, True, 0.0, False, scale=scale)
                self.results = (packed(output, problem), packed(log_sum_exp, problem))
        else:
            k = self.upload(np.ascontiguousarray(keys))
            v = self.upload(np.ascontiguousarray(values))
            mask = self.upload(bias).to(q.dtype)
            op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

            def call() -> None:
                output, log_sum_exp = op(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
                self.results = (packed(output, problem), packed(log_sum_exp, problem))
        self.results = (torch.empty(0), torch.empty(0))
        return call
