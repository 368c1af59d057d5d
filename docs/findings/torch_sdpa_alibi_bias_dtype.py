"""PyTorch SDPA takes a float ``attn_mask`` only in the query's dtype, so an ALiBi bias passed to
it with float16 inputs is rounded to float16 before the kernel adds it to its float32 scores.
The logsumexp the op returns (float32) then matches the bias as rounded, not the bias meant.

Run: python docs/findings/torch_sdpa_alibi_bias_dtype.py   (torch, CPU: the flash op that
F.scaled_dot_product_attention takes there and that returns its logsumexp)
"""

import math

import torch

heads, dim, tokens = 32, 8, 41
slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64)
offsets = torch.arange(tokens, dtype=torch.float64) - (tokens - 1)  # key position - query's
bias = slopes[:, None] * offsets[None, :]  # (heads, tokens): up to 39 * 0.84 = 33

g = torch.Generator().manual_seed(0)
q = torch.randn(1, heads, 1, dim, generator=g).half()
k = torch.randn(1, heads, tokens, dim, generator=g).half()
v = torch.randn(1, heads, tokens, dim, generator=g).half()
out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
    q, k, v, 0.0, False, attn_mask=bias.half()[None, :, None])  # the query's dtype, as required

scores = torch.einsum("hd,htd->ht", q[0, :, 0].double(), k[0].double()) / math.sqrt(dim)
for name, b in (("the ALiBi bias", bias), ("that bias rounded to float16", bias.half().double())):
    want = torch.logsumexp(scores + b, dim=1)
    print(f"largest |logsumexp - float64 with {name}|: "
          f"{(lse[0, :, 0].double() - want).abs().max().item():.3g}")
print(f"torch {torch.__version__}: the first is the rounding of the bias; the second, what is left")
