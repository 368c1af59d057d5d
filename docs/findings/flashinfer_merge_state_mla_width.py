"""FlashInfer's ``cascade.merge_state`` on MLA states: the output of the MLA wrapper is
``(rows, heads, 512)`` (DeepSeek's latent width), and merging two such states can fail to
launch ("MergeState kernel launch failed: invalid argument", cascade.cu), which also leaves
the CUDA context unusable. This maps which (rows, heads, head_dim) launch.

Run on a CUDA GPU: python docs/findings/flashinfer_merge_state_mla_width.py   (flashinfer, torch)
"""

import subprocess
import sys

SHAPES = [(rows, heads, dim) for dim in (128, 512) for heads in (16, 128)
          for rows in (1, 2, 64)]

if len(sys.argv) == 4:  # one shape, in a process of its own (a failed launch poisons CUDA)
    import flashinfer
    import torch

    rows, heads, dim = map(int, sys.argv[1:])
    torch.manual_seed(0)
    v_a = torch.randn(rows, heads, dim, dtype=torch.bfloat16, device="cuda")
    v_b = torch.randn_like(v_a)
    s_a = torch.randn(rows, heads, dtype=torch.float32, device="cuda")
    s_b = torch.randn_like(s_a)
    v, s = flashinfer.merge_state(v_a, s_a, v_b, s_b)
    w_a = torch.sigmoid((s_a - s_b) * 0.6931471805599453)[..., None]  # base-2 LSEs
    truth = w_a * v_a.double() + (1 - w_a) * v_b.double()
    torch.cuda.synchronize()
    print(f"max error {(v.double() - truth).abs().max().item():.3g}")
else:
    import flashinfer

    print(f"flashinfer {flashinfer.__version__}")
    for shape in SHAPES:
        done = subprocess.run([sys.executable, __file__, *map(str, shape)], capture_output=True,
                              text=True, timeout=300)
        lines = (done.stdout + done.stderr).strip().splitlines()
        failed = next((line for line in lines if "failed" in line or "Error" in line), None)
        print(f"rows {shape[0]:3} heads {shape[1]:3} head_dim {shape[2]}: "
              f"{failed[:120] if failed else lines[-1] if lines else '(no output)'}")
