"""TVM _attention_prefill (CUDA): with one KV head and a small head_dim, building TVM's own
paged prefill kernel fails inside TVM's compiler with "variable cse_vN has been used before
definition" (an InternalError), for every page size tried.

The prefill kernel is what serves several query tokens per sequence (speculative decoding's
verification) on a paged cache. The same shapes build for the tree kernel
(tree_attn_with_paged_kv_cache), with two KV heads, or with a larger head_dim; no GPU is
needed: the error comes from tvm.compile for a CUDA target.

Run: python docs/findings/tvm_cuda_prefill_small_head_build.py   (apache-tvm with its compiler)
"""

import tvm
from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill

target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024,
                            "max_threads_per_block": 1024, "thread_warp_size": 32,
                            "max_shared_memory_per_block": 49152})

# (query heads, KV heads, head_dim, dtype); page size 16 (1, 2 and 38 fail alike)
SHAPES = [(1, 1, 8, "float16"), (8, 1, 8, "float32"), (4, 1, 16, "float32"),
          (4, 1, 16, "float16"), (2, 2, 8, "float16"), (1, 1, 32, "float32")]

for qo_heads, kv_heads, head_dim, dtype in SHAPES:
    func = _attention_prefill(kv_heads, qo_heads, head_dim, dtype, False, {}, target, 16)
    try:
        tvm.compile(tvm.IRModule({"batch_prefill_paged_kv": func}), target=target)
        verdict = "builds"
    except Exception as exc:  # the defect: an InternalError of TVM's compiler
        verdict = "fails: " + str(exc).strip().splitlines()[-1][:100]
    print(f"{qo_heads}/{kv_heads} heads, head_dim {head_dim}, {dtype}: {verdict}")
