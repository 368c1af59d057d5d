"""TVM causal prefill (CPU): when every score a query token may see is below -5e4 (base 2),
the keys the causal mask hides join its output with weight 1 each.

The kernel gives a masked position the score -5e4 but keeps the running max of the last
visible one; with every visible score below -5e4 that max is the initial -5e4, so each
masked position adds exp2(0) = 1 to the denominator and its value to the output. Two query
tokens over three keys: the first must see keys 0 and 1 only, yet its output is the mean of
V over key 2 (hidden) and the initial empty state.

Run: python docs/findings/tvm_prefill_masked_keys_leak.py   (needs apache-tvm, CPU only)
"""

import numpy as np
import tvm
from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu

D, PAGE = 4, 16
prefill = tvm.compile(tvm.IRModule({"main": _attention_prefill_cpu(1, 1, D, "float32", False,
                                                                    {}, PAGE)}),
                      target="llvm")["batch_prefill_paged_kv_cpu"]
dev = tvm.cpu()
q = np.array([[[100.0, 0, 0, 0]], [[100.0, 0, 0, 0]]], np.float32)  # 2 query tokens
keys = np.array([[-1000.0, 0, 0, 0], [-1001.0, 0, 0, 0], [-1002.0, 0, 0, 0]], np.float32)
values = np.array([[1.0, 1, 1, 1], [2.0, 2, 2, 2], [9.0, 9, 9, 9]], np.float32)
pages = np.zeros((1, 2, 1, PAGE, D), np.float32)
pages[0, 0, 0, :3], pages[0, 1, 0, :3] = keys, values
out = tvm.runtime.tensor(np.full((2, 1, D), np.nan, np.float32), dev)
lse = tvm.runtime.tensor(np.full((2, 1), np.nan, np.float32), dev)
args = [q, np.array([0, 2], np.int32), pages, np.array([0, 1], np.int32),
        np.array([0], np.int32), np.array([3], np.int32), np.zeros(1, np.int32),
        np.zeros(2, np.int32)]
prefill(*[tvm.runtime.tensor(a, dev) for a in args], out, lse, 1, 0, 1.0, 1e4, 1.0)

scores = (keys @ q[0, 0]).astype(np.float64)[:2]  # token 0 sits at position 1: keys 0, 1
weights = np.exp(scores - scores.max())
print("query token 0: output", out.numpy()[0, 0], "expected", weights @ values[:2] / weights.sum())
print("  LSE (base 2)", lse.numpy()[0, 0], "(the empty sentinel is -5e4)")
assert np.allclose(out.numpy()[0, 0], values[2] / 2, atol=1e-4), "the hidden key 2 leaks"
