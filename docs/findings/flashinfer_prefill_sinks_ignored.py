"""FlashInfer's paged prefill wrapper (fa2, the path speculative verification takes):
``run(sinks=...)`` is accepted, and the output with large sink logits equals the output
without them, as on the decode wrappers (flashinfer_decode_sinks_ignored.py).

Run on a CUDA GPU: python docs/findings/flashinfer_prefill_sinks_ignored.py   (flashinfer, torch)
"""

import flashinfer
import torch

torch.manual_seed(0)
page_size, qo_heads, kv_heads, dim, context, drafts = 16, 8, 2, 128, 40, 4
pages = -(-context // page_size)
k = torch.randn(pages, page_size, kv_heads, dim, dtype=torch.float16, device="cuda")
v = torch.randn_like(k)
q = torch.randn(drafts, qo_heads, dim, dtype=torch.float16, device="cuda")
qo_indptr = torch.tensor([0, drafts], dtype=torch.int32, device="cuda")
indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
indices = torch.arange(pages, dtype=torch.int32, device="cuda")
last_page_len = torch.tensor([context - (pages - 1) * page_size], dtype=torch.int32,
                             device="cuda")
sinks = torch.full((qo_heads,), 12.0, dtype=torch.float32, device="cuda")
scale = dim ** -0.5

# float64 truth: draft t (at position context - drafts + t) sees positions up to its own,
# softmax over those scores and the sink logit, output the weighted values
group = qo_heads // kv_heads
keys = k.reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(group, 1)
values = v.reshape(-1, kv_heads, dim)[:context].double().repeat_interleave(group, 1)
truth = []
for t in range(drafts):
    seen = context - drafts + t + 1
    scores = torch.einsum("hd,thd->ht", q[t].double(), keys[:seen]) * scale
    weights = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=1), dim=1)
    truth.append(torch.einsum("ht,thd->hd", weights[:, :seen], values[:seen]))
truth = torch.stack(truth)

print(f"flashinfer {flashinfer.__version__}")
workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
wrapper.plan(qo_indptr, indptr, indices, last_page_len, qo_heads, kv_heads, dim, page_size,
             causal=True, q_data_type=torch.float16)
plain = wrapper.run(q, (k, v))
sunk = wrapper.run(q, (k, v), sinks=sinks)
print(f"prefill fa2: max |out(sinks) - out(no sinks)| {(sunk - plain).abs().max().item():.3g} "
      f"(want about {(truth - plain.double()).abs().max().item():.3g}); "
      f"max |out(sinks) - truth| {(sunk.double() - truth).abs().max().item():.3g} (want < 1e-3)")
