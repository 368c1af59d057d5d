"""TVM decode: when every score is below -5e4 (base 2) the kernel returns an empty state.

The running max starts at the finite -5e4 with a denominator of 1, so scores below it
never become the max: the output is ~0 and the LSE is the empty sentinel, whatever V is.

Run: python docs/findings/tvm_very_negative_scores.py   (needs apache-tvm, CPU only)
"""

import math

import numpy as np
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode_cpu

D, PAGE = 4, 16
decode = tvm.compile(tvm.IRModule({"main": _attention_decode_cpu(1, 1, D, "float32", False, {},
                                                                   PAGE)}),
                     target="llvm")["batch_decode_paged_kv_cpu"]
dev = tvm.cpu()
q = np.array([[[100.0, 0, 0, 0]]], np.float32)
keys = np.array([[-1000.0, 0, 0, 0], [-1001.0, 0, 0, 0]], np.float32)  # scores -1e5, -1.001e5
values = np.array([[1.0, 2, 3, 4], [5.0, 6, 7, 8]], np.float32)
pages = np.zeros((1, 2, 1, PAGE, D), np.float32)
pages[0, 0, 0, :2], pages[0, 1, 0, :2] = keys, values
out = tvm.runtime.tensor(np.full((1, 1, D), np.nan, np.float32), dev)
lse = tvm.runtime.tensor(np.full((1, 1), np.nan, np.float32), dev)
args = [q, pages, np.array([0, 1], np.int32), np.array([0], np.int32), np.array([2], np.int32),
        np.zeros(1, np.int32), np.zeros(1, np.int32)]
decode(*[tvm.runtime.tensor(a, dev) for a in args], out, lse, 0, 1.0, 1e4, 1.0)

scores = (keys @ q[0, 0]).astype(np.float64)
weights = np.exp(scores - scores.max())
expected = weights @ values / weights.sum()
expected_lse = (scores.max() + math.log(weights.sum())) / math.log(2)
print("output", out.numpy()[0, 0], "expected", expected)
print("LSE (base 2)", lse.numpy()[0, 0], "expected", expected_lse)
assert np.allclose(out.numpy()[0, 0], 0, atol=1e-6) and lse.numpy()[0, 0] == -5e4
