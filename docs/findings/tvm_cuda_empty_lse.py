"""TVM _attention_decode (CUDA): an empty context's LSE is -5e4 + log2(bdz), not -5e4.

Run: python docs/findings/tvm_cuda_empty_lse.py   (apache-tvm with its compiler; the kernel
run needs a CUDA device, the launch geometry does not)
"""

import math
import re

import numpy as np
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

QO_HEADS, KV_HEADS, D, PAGE = 8, 2, 64, 16
target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024,
                            "max_threads_per_block": 1024, "thread_warp_size": 32})
func = _attention_decode(KV_HEADS, QO_HEADS, D, "float16", False, {}, target, PAGE)
bdz = int(re.search(r'T\.thread_binding\((\d+), thread="threadIdx\.z"\)', func.script())[1])
print(f"threadIdx.z = {bdz}: an empty row's LSE will be -5e4 + log2({bdz}) = "
      f"{-5e4 + math.log2(bdz)}")

if tvm.cuda(0).exist:
    decode = tvm.compile(tvm.IRModule({"main": func}), target=target)["batch_decode_paged_kv"]
    dev = tvm.cuda(0)
    q = np.ones((1, QO_HEADS, D), "float16")
    pages = np.ones((1, 2, KV_HEADS, PAGE, D), "float16")
    out = tvm.runtime.tensor(np.full((1, QO_HEADS, D), np.nan, "float16"), dev)
    lse = tvm.runtime.tensor(np.full((1, QO_HEADS), np.nan, "float32"), dev)
    args = [q, pages, np.array([0, 0], np.int32), np.array([0], np.int32),  # no pages: empty
            np.array([0], np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32)]
    decode(*[tvm.runtime.tensor(a, dev) for a in args], out, lse, 0, 1.0, 1e4, 0.125)
    print("LSE of the empty row:", lse.numpy()[0, 0], "(expected -50000.0)")
