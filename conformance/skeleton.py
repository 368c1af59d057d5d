"""``new-backend``: a skeleton adapter that runs as written and claims nothing until filled in."""

from __future__ import annotations

import re
from pathlib import Path

TEMPLATE = '''"""{name}: a paged decode attention backend for the conformance suite.

Add a backend in ten minutes:

1. Run this file as it is; every case is reported *unsupported*, none passed, and the run
   fails because the backend claims nothing (``--allow-empty`` accepts that for now):
       python -m conformance run --backend {path}:{cls} --profile smoke --allow-empty
2. Fill in ``decode`` below. The problem is canonical NumPy (docs/design.md):
       problem.q             (batch, num_qo_heads, head_dim)               case dtype
       problem.k_pages       (num_pages, page_size, num_kv_heads, head_dim) case dtype
       problem.v_pages       same shape as k_pages
       problem.block_table   (batch, max_blocks) int32, -1 = unallocated
       problem.context_lens  (batch,) int32, 0 is legal
       problem.sm_scale, problem.window (None or int), problem.sinks (int)
   An fp8 cache (only on cases you claim in kv_dtypes/kv_scales): k_pages and v_pages hold
   the codes (ml_dtypes float8_e4m3fn / float8_e5m2), read as
   code * scale, with problem.kv_scale naming the layout of the float32 scales:
       "per-tensor"  problem.k_scale, problem.v_scale   (1,)
       "per-head"    the same                           (num_kv_heads,)
       "per-token"   the same                           (num_pages, page_size, num_kv_heads)
   An fp8 query (q_dtypes): q holds codes, problem.q_scale (1,), the output is problem.dtype.
   Hand codes and scales to your kernel as its users do; never dequantize for it.
   Several query tokens per sequence (features "multi_token", "draft_mask"): q, out and lse
   have one row per query token, packed; problem.query_lens (batch,) int32, its index
   pointer problem.query_start (batch + 1,), problem.padded_rows() for a padded layout;
   problem.draft_mask (tokens, max query_len) bool or None (causal). The drafts are each
   sequence's last positions; windows and ALiBi count from each draft's own position.
   bfloat16 and fp8 arrays are ml_dtypes types, which torch.from_numpy refuses: convert with
       from conformance.backends.tensors import to_numpy_many, to_torch
       q = to_torch(problem.q, "cuda")      ...
       out[...], lse[...] = to_numpy_many([(out_t, out), (lse_t, lse)])  # one wait for both
   Convert to your kernel's layout here (that part is not timed), run the kernel, and write
   the results into ``out`` (batch, num_qo_heads, head_dim) in the query dtype and ``lse``
   (batch, num_qo_heads) float32, natural log. Both arrive poisoned: write every element.
   Do not modify the problem's arrays; the suite compares them with its own copies.
3. Declare ``capabilities`` honestly: what you leave out is reported unsupported, with the
   reason; what you claim and fail is a failure.
4. If your kernel reports LSE in base 2 or uses a finite "empty" LSE, say so in
   ``conventions`` and convert the LSE to natural log before writing it.
5. Run the ``ci`` profile; list deviations you accept in expectations/{name}.toml with a
   reason each, and register the backend in backends/registry.py (or through the
   ``paged_decode_conformance.backends`` entry-point group of your own package).
"""

from __future__ import annotations

import numpy as np

from conformance.backends.base import AttentionState, Backend, Capabilities, Conventions


class {cls}(Backend):
    name = "{name}"
    description = "describe the kernel in one line"
    capabilities = Capabilities(
        dtypes=frozenset(),  # e.g. frozenset({{"float16", "bfloat16"}}): empty claims nothing
        head_dims=None,  # None = any; else e.g. frozenset({{64, 128}})
        page_sizes=None,
        max_group_size=None,
        instances=None,  # or the (qo heads, kv heads, head_dim, page_size, dtype) you built
        features=frozenset(),  # any of "lse", "merge", "split_k", "sliding_window", "sinks",
        # "soft_cap", "sink_logits", "alibi", "multi_token", "draft_mask"
        devices=("cpu",),
        float32_matmul="ieee",  # "tf32" if float32 matmuls run in TF32
        kv_dtypes=frozenset(),  # fp8 caches read: "float8_e4m3fn", "float8_e5m2"
        kv_scales=frozenset(),  # with them, scale layouts: "per-tensor", "per-head", "per-token"
        q_dtypes=frozenset(),  # fp8 queries taken
    )
    conventions = Conventions()  # e.g. Conventions(lse_base=2.0, empty_lse=-5e4)

    @classmethod
    def availability(cls) -> str | None:
        # Return why this backend cannot run here (a missing package, no GPU), or None.
        return None

    @classmethod
    def preload(cls) -> None:
        # Optional: import your heavy libraries here (import torch), touching no GPU and
        # starting no thread: done once, and every worker of a run is forked from there.
        # Unsure whether an import starts CUDA? Write this as a generator: each `yield`
        # ends a stage, and the workers are forked after the last stage that left it safe.
        pass

    def unsupported_reason(self, case) -> str | None:
        if not self.capabilities.dtypes:
            return "skeleton: declare capabilities and fill in decode()"
        return super().unsupported_reason(case)

    def decode(self, problem, out: np.ndarray, lse: np.ndarray, *,
               num_splits: int | None = None) -> None:
        raise NotImplementedError("fill in decode()")

    def merge(self, a: AttentionState, b: AttentionState) -> AttentionState:
        # Only with the "merge" feature: combine two states with your merge kernel and
        # return a new AttentionState(out, lse) without modifying a or b.
        raise NotImplementedError("fill in merge() or leave 'merge' out of the features")
'''


def class_name(name: str) -> str:
    """``my-kernel`` -> ``MyKernelBackend``."""
    parts = re.split(r"[^0-9A-Za-z]+", name)
    return "".join(part[:1].upper() + part[1:] for part in parts if part) + "Backend"


def write_skeleton(name: str, path: Path) -> None:
    """Write the skeleton; refuses to overwrite an existing file."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
        raise ValueError(f"backend name {name!r} must start with a letter and hold only "
                         f"letters, digits, '-' and '_'")
    if path.exists():
        raise FileExistsError(f"{path} exists; choose another --out")
    path.write_text(TEMPLATE.format(name=name, cls=class_name(name), path=path))
