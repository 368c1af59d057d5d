"""PyTorch's CPU flash attention returns logsumexp 0, not -inf, for a row whose keys are all
masked out: the state reads as "attention over keys whose scores sum to 1" and a split-K
merge gives it real weight.

Run: python docs/findings/torch_sdpa_cpu_masked_row_lse.py   (torch, CPU only)
"""

import math

import torch

torch.manual_seed(0)
q = torch.randn(1, 2, 1, 8)  # (batch, heads, query length, dim)
k = torch.randn(1, 2, 4, 8)
v = torch.randn(1, 2, 4, 8)
every_key_masked = torch.full((1, 1, 1, 4), float("-inf"))
out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
    q, k, v, 0.0, False, attn_mask=every_key_masked)
print(f"torch {torch.__version__}: output {out.flatten()[:4].tolist()}, logsumexp "
      f"{lse.flatten().tolist()} (want 0 and -inf: log of an empty sum)")

# Why it matters: merging this "empty" state with a real one by log-sum-exp.
real_out, real_lse = torch.randn(8), 1.5
weight = math.exp(lse.flatten()[0].item() - torch.logaddexp(lse.flatten()[0],
                                                            torch.tensor(real_lse)).item())
print(f"weight the empty state gets in a merge: {weight:.3f} (want 0)")
assert lse.flatten()[0].item() == 0.0 and (out == 0).all()
