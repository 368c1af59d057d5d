"""TVM _attention_decode (CUDA): when head_dim / 4 x group size < 8 the kernel is launched
with a threadIdx.z extent over CUDA's limit of 64, and every launch fails with
CUDA_ERROR_INVALID_VALUE.

The kernel sets bdx = head_dim // 4 (VEC_SIZE from a hard-coded 2-byte element), bdy = the
group size, and bdz = 512 // (bdx * bdy). head_dim 8 with one query head per KV head gives
bdx 2, bdz 256; head_dim 16 gives bdz 128. check_thread_limits() only tests bdz <= 64 for
WebGPU. The launch geometry shows it on any machine; on a CUDA machine the script also runs
the kernel.

Run: python docs/findings/tvm_cuda_thread_z_over_limit.py   (apache-tvm with its compiler)
"""

import re

import numpy as np
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

CUDA_MAX_BLOCK_Z = 64
target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024,
                            "max_threads_per_block": 1024, "thread_warp_size": 32})


def extents(func) -> dict[str, int]:
    return {axis: int(n) for n, axis in re.findall(
        r'T\.thread_binding\((\d+), thread="(\w+\.\w)"\)', func.script())}


for qo_heads, kv_heads, head_dim in ((1, 1, 8), (30, 30, 16), (4, 1, 8), (8, 2, 64)):
    z = extents(_attention_decode(kv_heads, qo_heads, head_dim, "float32", False, {},
                                  target, 16))["threadIdx.z"]
    verdict = "over CUDA's limit: cannot launch" if z > CUDA_MAX_BLOCK_Z else "ok"
    print(f"{qo_heads}/{kv_heads} heads, head_dim {head_dim}: threadIdx.z = {z} ({verdict})")

if tvm.cuda(0).exist:
    QO, KV, D, PAGE = 1, 1, 8, 16
    func = _attention_decode(KV, QO, D, "float32", False, {}, target, PAGE)
    decode = tvm.compile(tvm.IRModule({"main": func}), target=target)["batch_decode_paged_kv"]
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((1, QO, D)).astype("float32"),
            rng.standard_normal((1, 2, KV, PAGE, D)).astype("float32"),
            np.array([0, 1], np.int32), np.array([0], np.int32), np.array([PAGE], np.int32),
            np.zeros(1, np.int32), np.zeros(1, np.int32),
            np.zeros((1, QO, D), "float32"), np.zeros((1, QO), "float32")]
    try:
        decode(*[tvm.runtime.tensor(a, dev) for a in args], 0, 1.0, 1e4, 0.35)
        print("launch succeeded")
    except Exception as exc:  # the defect: CUDA_ERROR_INVALID_VALUE
        print("launch failed:", str(exc).splitlines()[0])
