"""FlashInfer's CUDA-core paged decode with a sliding window: NaN in KV slots left of the window
reaches the output, although the window excludes them.

Run on a CUDA GPU: python docs/findings/flashinfer_window_masked_nan.py   (flashinfer, torch)
"""

import flashinfer
import torch

torch.manual_seed(0)
page_size, heads, dim, context, window = 16, 8, 64, 30, 5
k = torch.randn(4, page_size, heads, dim, dtype=torch.float16, device="cuda")
v = torch.randn_like(k)
q = torch.randn(1, heads, dim, dtype=torch.float16, device="cuda")
indptr = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
indices = torch.tensor([1, 2], dtype=torch.int32, device="cuda")  # pages of the sequence
last_page_len = torch.tensor([context - page_size], dtype=torch.int32, device="cuda")


def decode(k_cache, v_cache, use_tensor_cores):
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=use_tensor_cores)
    wrapper.plan(indptr, indices, last_page_len, heads, heads, dim, page_size,
                 window_left=window - 1, q_data_type=torch.float16)
    return wrapper.run(q, (k_cache, v_cache))


clean = decode(k, v, False)
# Positions 0 .. context - window - 1 are outside the window: make them NaN.
for position in range(context - window):
    page = indices[position // page_size]
    k[page, position % page_size] = float("nan")
    v[page, position % page_size] = float("nan")
print(f"flashinfer {flashinfer.__version__}")
for tensor_cores in (False, True):
    out = decode(k, v, tensor_cores)
    print(f"use_tensor_cores={tensor_cores}: NaN in output {out.isnan().any().item()}, "
          f"max change vs finite data {(out - clean).abs().max().item():.3g} (want False, ~0)")
