"""PyTorch flex_attention (uncompiled) turns NaN in a masked-out key/value slot into NaN output.

A paged KV pool holds slots no sequence owns (freed pages, the tail of a partial last page);
serving stacks allocate it with torch.empty, so those slots may hold any bit pattern, NaN
included. A mask_mod that excludes them should make them irrelevant.

Run: python docs/findings/torch_flex_eager_masked_nan.py   (torch, CPU only)
"""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)
q = torch.randn(1, 2, 1, 8)
k = torch.randn(1, 2, 16, 8)
v = torch.randn(1, 2, 16, 8)
LIVE = 5  # the sequence owns slots 0..4; slots 5..15 belong to no one


def mask_mod(b, h, q_idx, kv_idx):
    return kv_idx < LIVE


mask = create_block_mask(mask_mod, 1, None, 1, 16, device="cpu")
clean = flex_attention(q, k, v, block_mask=mask)
k[:, :, LIVE:], v[:, :, LIVE:] = float("nan"), float("nan")  # garbage where nothing may be read
dirty = flex_attention(q, k, v, block_mask=mask)
print(f"torch {torch.__version__}: NaN in the output: {dirty.isnan().any().item()} "
      f"(want False: only masked slots changed); clean output finite: "
      f"{clean.isfinite().all().item()}")
assert dirty.isnan().all() and clean.isfinite().all()
