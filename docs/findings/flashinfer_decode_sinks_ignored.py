"""FlashInfer's paged decode wrapper (the default fa2 kernels, CUDA cores and tensor cores):
``run(sinks=...)`` is documented as per-head sink logits "appended to each row of the softmax
denominator", yet the output with large sink logits equals the output without them.

Run on a CUDA GPU: python docs/findings/flashinfer_decode_sinks_ignored.py   (flashinfer, torch)
"""

import flashinfer
import torch

torch.manual_seed(0)
page_size, qo_heads, kv_heads, dim, context = 16, 8, 2, 128, 40
pages = -(-context // page_size)
k = torch.randn(pages, page_size, kv_heads, dim, dtype=torch.float16, device="cuda")
v = torch.randn_like(k)
q = torch.randn(1, qo_heads, dim, dtype=torch.float16, device="cuda")
indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
indices = torch.arange(pages, dtype=torch.int32, device="cuda")
last_page_len = torch.tensor([context - (pages - 1) * page_size], dtype=torch.int32,
                             device="cuda")
sinks = torch.full((qo_heads,), 12.0, dtype=torch.float32, device="cuda")
scale = dim ** -0.5

# float64 truth: softmax over the scores and the sink logit, output the weighted values
keys = k.reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(qo_heads // kv_heads, 1)
values = v.reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(qo_heads // kv_heads, 1)
scores = torch.einsum("hd,thd->ht", q[0].double(), keys) * scale
with_sink = torch.cat([scores, sinks.double()[:, None]], dim=1)
weights = torch.softmax(with_sink, dim=1)[:, :context]
truth = torch.einsum("ht,thd->hd", weights, values)

print(f"flashinfer {flashinfer.__version__}")
for tensor_cores in (False, True):
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, indices, last_page_len, qo_heads, kv_heads, dim, page_size,
                 q_data_type=torch.float16)
    plain = wrapper.run(q, (k, v))
    sunk, lse = wrapper.run(q, (k, v), sinks=sinks, return_lse=True)
    print(f"use_tensor_cores={tensor_cores} backend={getattr(wrapper, '_backend', '?')}: "
          f"max |out(sinks) - out(no sinks)| {(sunk - plain).abs().max().item():.3g} "
          f"(want about {(truth - plain[0].double()).abs().max().item():.3g}); "
          f"max |out(sinks) - truth| {(sunk[0].double() - truth).abs().max().item():.3g} "
          f"(want < 1e-3)")
