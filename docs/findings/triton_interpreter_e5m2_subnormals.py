"""Reproducer: the Triton interpreter converts e5m2 subnormals to float16 wrongly.

e5m2 and float16 share their exponent (5 bits, bias 15), so every e5m2 value is a float16
value and the conversion is exact on a GPU. Under TRITON_INTERPRET=1, `x.to(tl.float16)`
of the e5m2 subnormals 2^-15 and 2^-16 gives 0 and 3 * 2^-16 gives 2^-15; `x.to(tl.float32)`
of the same codes is right. Run: python docs/findings/triton_interpreter_e5m2_subnormals.py
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl


@triton.jit
def upcast(codes, as_half, as_float, size: tl.constexpr):
    i = tl.arange(0, size)
    x = tl.load(codes + i)
    tl.store(as_half + i, x.to(tl.float16))
    tl.store(as_float + i, x.to(tl.float32))


def main() -> int:
    want = torch.tensor([2.0**-14, 2.0**-15, 2.0**-16, 3 * 2.0**-16, -(2.0**-15), 2.0**-7,
                         0.5, 57344.0])
    codes = want.to(torch.float8_e5m2)
    assert torch.equal(codes.float(), want), "every value above is an e5m2 value"
    half, single = torch.empty(len(want), dtype=torch.float16), torch.empty(len(want))
    upcast[(1,)](codes, half, single, size=len(want))
    print("e5m2 codes   ", want.tolist())
    print("to(float16)  ", half.float().tolist())
    print("to(float32)  ", single.tolist())
    wrong = (half.float() != want).sum().item()
    print(f"{wrong} of {len(want)} wrong through float16 (triton {triton.__version__})")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
