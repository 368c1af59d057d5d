"""Compiled PyTorch flex_attention fails to compile when K/V hold more than 2^31 elements.

A paged KV pool viewed as one long key sequence (slots = pages x page size) passes 2^31
elements at about 131072 pages of 8 KV heads x 128 x 16 tokens: a 4 GiB bfloat16 pool, a
size serving stacks allocate on an 80-141 GB GPU. The same call on a pool of 2^31 - 2^21
elements compiles and runs.

Run: python docs/findings/torch_flex_large_kv_compile.py   (torch with CUDA and Triton, a GPU
with 12 GB free)
"""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HEADS_Q, HEADS_KV, DIM, LIVE = 32, 8, 128, 300
flex = torch.compile(flex_attention, dynamic=False)


def attend(slots: int) -> str:
    q = torch.randn(1, HEADS_Q, 1, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HEADS_KV, slots, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    first = slots - LIVE  # the sequence owns the last LIVE slots of the pool

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx >= first

    mask = create_block_mask(mask_mod, 1, None, 1, slots, device="cuda")
    try:
        out = flex(q, k, v, block_mask=mask, enable_gqa=True)
    except Exception as exc:  # the finding is this exception
        lines = str(exc).splitlines()
        cause = next((line for line in lines if "Error(" in line), lines[0] if lines else "")
        return f"{type(exc).__name__}: {cause.strip()[:200]}"
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k[:, :, first:].float().repeat_interleave(HEADS_Q // HEADS_KV, 1),
        v[:, :, first:].float().repeat_interleave(HEADS_Q // HEADS_KV, 1))
    return f"ok, max error {(out.float() - want).abs().max().item():.3g}"


small = (2**31 - 2**21) // (HEADS_KV * DIM)
large = 2**31 // (HEADS_KV * DIM) + 4096
print(f"torch {torch.__version__}")
small_result = attend(small)
print(f"{HEADS_KV * small * DIM} elements per K/V (< 2^31): {small_result}")
large_result = attend(large)
print(f"{HEADS_KV * large * DIM} elements per K/V (> 2^31): {large_result}")
assert small_result.startswith("ok") and not large_result.startswith("ok")
