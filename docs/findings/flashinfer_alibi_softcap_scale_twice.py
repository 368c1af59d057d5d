"""FlashInfer's decode with ``pos_encoding_mode="ALIBI"`` and ``logits_soft_cap`` together:
``variants.cuh`` scales the score by sm_scale, adds the bias, then multiplies by
``sm_scale / cap`` inside the tanh, so the score is scaled twice. This prints which formula the
output follows.

Run on a CUDA GPU: python docs/findings/flashinfer_alibi_softcap_scale_twice.py
"""

import flashinfer
import torch

torch.manual_seed(0)
page_size, heads, dim, context, cap = 16, 8, 128, 40, 30.0
pages = -(-context // page_size)
k = torch.randn(pages, page_size, heads, dim, dtype=torch.float16, device="cuda") * 4
v = torch.randn_like(k)
q = torch.randn(1, heads, dim, dtype=torch.float16, device="cuda") * 4
indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
indices = torch.arange(pages, dtype=torch.int32, device="cuda")
last_page_len = torch.tensor([context - (pages - 1) * page_size], dtype=torch.int32,
                             device="cuda")
scale = dim ** -0.5
slopes = flashinfer.utils.get_alibi_slopes(heads).double().cuda()

keys = k.reshape(-1, heads, dim)[:context].double()
values = v.reshape(-1, heads, dim)[:context].double()
raw = torch.einsum("hd,thd->ht", q[0].double(), keys)
bias = slopes[:, None] * (torch.arange(context, device="cuda") - (context - 1)).double()
candidates = {
    "cap(s*scale) + bias (the spec's order)": cap * torch.tanh(raw * scale / cap) + bias,
    "cap(s*scale + bias)": cap * torch.tanh((raw * scale + bias) / cap),
    "cap((s*scale + bias) * scale) (scaled twice)":
        cap * torch.tanh((raw * scale + bias) * scale / cap),
}
workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
wrapper.plan(indptr, indices, last_page_len, heads, heads, dim, page_size,
             q_data_type=torch.float16, pos_encoding_mode="ALIBI", logits_soft_cap=cap)
out = wrapper.run(q, (k, v))[0].double()
print(f"flashinfer {flashinfer.__version__}")
for name, scores in candidates.items():
    expected = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=1), values)
    print(f"max |out - softmax({name}) v| = {(out - expected).abs().max().item():.3g}")
