"""Compiled PyTorch flex_attention finds no kernel for DeepSeek-V3's MLA decode at 128 heads.

MLA decode with absorbed weights is attention of many query heads on one shared KV head:
keys of 576 (latent 512 + rope 64), values of 512 (the latent). flex_attention takes a
value width of its own, so serving code can call it for MLA. At 16, 32 and 64 query heads
it compiles and matches a float32 reference; at 128 heads (DeepSeek-V3 unsharded) Inductor
finds no configuration of its flex template that fits the GPU's shared memory.

Run: python docs/findings/torch_flex_mla_shared_memory.py   (torch with CUDA and Triton)
"""

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

RANK, ROPE, TOKENS = 512, 64, 1024
flex = torch.compile(flex_attention, dynamic=False)


def attend(heads: int) -> str:
    q = torch.randn(1, heads, 1, RANK + ROPE, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, TOKENS, RANK + ROPE, device="cuda", dtype=torch.float16)
    v = k[..., :RANK]  # the value is the key's latent
    try:
        out, _ = flex(q, k, v, scale=0.1352, enable_gqa=True, return_aux=AuxRequest(lse=True))
    except Exception as exc:  # the finding is this exception
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        cause = next((line for line in lines if "resource" in line), lines[0] if lines else "")
        return f"{type(exc).__name__}: {cause[:200]}"
    scores = (q.float() @ k.float().transpose(-1, -2)) * 0.1352
    want = scores.softmax(-1) @ v.float()
    return f"ok, max error {(out.float() - want).abs().max().item():.3g}"


print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
results = {heads: attend(heads) for heads in (16, 64, 128)}
for heads, result in results.items():
    print(f"{heads} query heads on one latent (key {RANK + ROPE}, value {RANK}): {result}")
assert results[16].startswith("ok") and not results[128].startswith("ok")
