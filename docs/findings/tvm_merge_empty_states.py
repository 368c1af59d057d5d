"""TVM merge_state_inplace: merging two empty attention states does not give an empty state.

Run: python docs/findings/tvm_merge_empty_states.py   (needs apache-tvm, CPU only)
"""

import numpy as np
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace_cpu

SENTINEL = -5e4  # what TVM's decode kernels write as the (base-2) LSE of an empty context

merge = tvm.compile(tvm.IRModule({"main": _merge_state_inplace_cpu("float32")}),
                    target="llvm")["merge_state_inplace_cpu"]
dev = tvm.cpu()
v = tvm.runtime.tensor(np.zeros((1, 1, 4), np.float32), dev)
s = tvm.runtime.tensor(np.full((1, 1), SENTINEL, np.float32), dev)
v_other = tvm.runtime.tensor(np.zeros((1, 1, 4), np.float32), dev)
s_other = tvm.runtime.tensor(np.full((1, 1), SENTINEL, np.float32), dev)
merge(v, s, v_other, s_other)
print(f"merged LSE {s.numpy()[0, 0]} (expected the empty sentinel {SENTINEL})")
assert s.numpy()[0, 0] == SENTINEL + 1.0  # log2(2^-5e4 + 2^-5e4) = -5e4 + 1
