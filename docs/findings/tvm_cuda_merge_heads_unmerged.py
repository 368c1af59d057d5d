"""TVM _merge_state_inplace (CUDA): heads past a multiple of the block's head count are
never merged; they keep the first state.

The kernel sets bdx = head_dim // 4 and bdy = num_heads, halves bdy until bdx * bdy <= 1024,
then launches gdy = num_heads // bdy blocks: with 27 heads of head_dim 192, bdx 48,
bdy 27 -> 13, gdy 2, so 26 heads are merged and head 26 keeps (v, s) as they were: merging a
state into an empty one leaves that head empty. The launch geometry shows it on any machine;
on a CUDA machine the script also runs the kernel.

Run: python docs/findings/tvm_cuda_merge_heads_unmerged.py   (apache-tvm with its compiler)
"""

import re

import numpy as np
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace

HEADS, D = 27, 192
target = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024,
                            "max_threads_per_block": 1024, "thread_warp_size": 32})
func = _merge_state_inplace(HEADS, D, "float32", target)
extents = {axis: int(n) for n, axis in re.findall(
    r'T\.thread_binding\((\d+), thread="(\w+\.\w)"\)', func.script())}
covered = extents["blockIdx.y"] * extents["threadIdx.y"]
print(f"launch: blockIdx.y={extents['blockIdx.y']} threadIdx.y={extents['threadIdx.y']}: "
      f"{covered} of {HEADS} heads merged")
assert covered == 26

if tvm.cuda(0).exist:
    merge = tvm.compile(tvm.IRModule({"main": func}), target=target)["merge_state_inplace"]
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    v_other = rng.standard_normal((1, HEADS, D)).astype("float32")
    s_other = rng.standard_normal((1, HEADS)).astype("float32")
    v = tvm.runtime.tensor(np.zeros((1, HEADS, D), "float32"), dev)  # an empty state:
    s = tvm.runtime.tensor(np.full((1, HEADS), -5e4, "float32"), dev)  # TVM's sentinel
    merge(v, s, tvm.runtime.tensor(v_other, dev), tvm.runtime.tensor(s_other, dev))
    wrong = np.where(np.abs(s.numpy()[0] - s_other[0]) > 1e-3)[0]
    print("heads whose merge(empty, x) is not x:", wrong.tolist())
