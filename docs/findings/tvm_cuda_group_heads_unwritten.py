"""TVM _attention_decode (CUDA): with 71 query heads per KV head (Falcon-7B), heads 68-70
are never computed.

The kernel halves its threadIdx.y extent (the heads of a group per block) until
threadIdx.x * threadIdx.y fits 512 threads, then launches group // threadIdx.y blocks per
KV head: 71 -> 35 -> 17 heads a block, 71 // 17 = 4 blocks, 68 heads. The launch geometry
shows it on any machine; on a CUDA machine the script also runs the kernel.

Run: python docs/findings/tvm_cuda_group_heads_unwritten.py   (apache-tvm with its compiler)
"""

import re

import numpy as np
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

QO_HEADS, KV_HEADS, D, PAGE = 71, 1, 64, 16
target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024,
                            "max_threads_per_block": 1024, "thread_warp_size": 32})
func = _attention_decode(KV_HEADS, QO_HEADS, D, "float16", False, {}, target, PAGE)
extents = dict((axis, int(n)) for n, axis in re.findall(
    r'T\.thread_binding\((\d+), thread="(\w+\.\w)"\)', func.script()))
covered = extents["blockIdx.y"] // KV_HEADS * extents["threadIdx.y"] * KV_HEADS
print(f"launch: blockIdx.y={extents['blockIdx.y']} threadIdx.y={extents['threadIdx.y']}: "
      f"{covered} of {QO_HEADS} query heads computed")
assert covered == 68

if tvm.cuda(0).exist:
    decode = tvm.compile(tvm.IRModule({"main": func}), target=target)["batch_decode_paged_kv"]
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    pages = rng.standard_normal((1, 2, KV_HEADS, PAGE, D)).astype("float16")
    q = rng.standard_normal((1, QO_HEADS, D)).astype("float16")
    out = tvm.runtime.tensor(np.full((1, QO_HEADS, D), np.nan, "float16"), dev)
    lse = tvm.runtime.tensor(np.full((1, QO_HEADS), np.nan, "float32"), dev)
    args = [q, pages, np.array([0, 1], np.int32), np.array([0], np.int32),
            np.array([PAGE], np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32)]
    decode(*[tvm.runtime.tensor(a, dev) for a in args], out, lse, 0, 1.0, 1e4, 0.125)
    unwritten = np.where(np.isnan(out.numpy()[0]).all(axis=1))[0]
    print("heads left unwritten (NaN as poisoned):", unwritten.tolist())
