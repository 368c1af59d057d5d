"""FlashInfer's paged decode with ``pos_encoding_mode="ALIBI"``: the output matches ALiBi
biased by the distance back from the query, but the returned LSE is that of scores biased by
``slope * key position`` (from the first token), off by ``slope * (kv_len - 1)``.

Run on a CUDA GPU: python docs/findings/flashinfer_alibi_lse_absolute.py   (flashinfer, torch)
"""

import math

import flashinfer
import torch

torch.manual_seed(0)
page_size, qo_heads, kv_heads, dim, context = 16, 8, 2, 128, 300
pages = -(-context // page_size)
k = torch.randn(pages, page_size, kv_heads, dim, dtype=torch.float16, device="cuda")
v = torch.randn_like(k)
q = torch.randn(1, qo_heads, dim, dtype=torch.float16, device="cuda")
indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
indices = torch.arange(pages, dtype=torch.int32, device="cuda")
last_page_len = torch.tensor([context - (pages - 1) * page_size], dtype=torch.int32,
                             device="cuda")
scale = dim ** -0.5
slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / qo_heads) for h in range(qo_heads)],
                      dtype=torch.float64, device="cuda")  # the standard slopes, 8 heads

# float64 truth: ALiBi bias slope_h * (key position - query position), the query last
keys = k.reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(qo_heads // kv_heads, 1)
values = v.reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(qo_heads // kv_heads, 1)
offsets = torch.arange(context, device="cuda", dtype=torch.float64) - (context - 1)
scores = torch.einsum("hd,thd->ht", q[0].double(), keys) * scale + slopes[:, None] * offsets
truth = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=1), values)
truth_lse = torch.logsumexp(scores, dim=1)

print(f"flashinfer {flashinfer.__version__}")
for tensor_cores in (False, True):
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, indices, last_page_len, qo_heads, kv_heads, dim, page_size,
                 q_data_type=torch.float16, pos_encoding_mode="ALIBI", sm_scale=scale)
    out, lse2 = wrapper.run(q, (k, v), return_lse=True)
    lse = lse2[0].double() * math.log(2.0)  # FlashInfer's LSE is base 2
    print(f"use_tensor_cores={tensor_cores}: max |out - truth| "
          f"{(out[0].double() - truth).abs().max().item():.3g} (want < 1e-2); "
          f"max |lse - truth| {(lse - truth_lse).abs().max().item():.4g} (want < 1e-2); "
          f"max |lse - (truth + slope * (kv_len - 1))| "
          f"{(lse - truth_lse - slopes * (context - 1)).abs().max().item():.3g}")
