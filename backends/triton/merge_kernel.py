"""Merge two attention states (output + natural-log LSE), safe when either or both are empty."""

from __future__ import annotations

import triton
import triton.language as tl

from conformance.backends.triton.kernel_common import rows_per_program
from conformance.backends.triton.validation import check_tensor


@triton.jit
def _merge_states_kernel(out_a, lse_a, out_b, lse_b, out, lse, rows, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (sequence, head) rows
    r_mask = r < rows
    d = tl.arange(0, BLOCK_D)
    mask = r_mask[:, None] & (d[None, :] < HEAD_DIM)
    la = tl.load(lse_a + r, mask=r_mask, other=float("-inf"))
    lb = tl.load(lse_b + r, mask=r_mask, other=float("-inf"))
    top = tl.maximum(la, lb)
    empty = top == float("-inf")
    base = tl.where(empty, 0.0, top)
    wa = tl.where(la == float("-inf"), 0.0, tl.exp(la - base))
    wb = tl.where(lb == float("-inf"), 0.0, tl.exp(lb - base))
    total = tl.where(empty, 1.0, wa + wb)
    offsets = r[:, None] * HEAD_DIM + d[None, :]
    oa = tl.load(out_a + offsets, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(out_b + offsets, mask=mask, other=0.0).to(tl.float32)
    merged = (oa * wa[:, None] + ob * wb[:, None]) / total[:, None]
    tl.store(out + offsets, merged.to(out.dtype.element_ty), mask=mask)
    tl.store(lse + r, tl.where(empty, float("-inf"), base + tl.log(total)), mask=r_mask)


def merge_states(out_a, lse_a, out_b, lse_b, out, lse) -> None:
    """``out, lse = merge((out_a, lse_a), (out_b, lse_b))``; outputs ``(batch, heads, dim)``,
    LSE ``(batch, heads)`` float32, all contiguous on one device."""
    check_tensor("out_a", out_a, ndim=3)
    shape = tuple(out_a.shape)
    for name, tensor in (("out_b", out_b), ("out", out)):
        check_tensor(name, tensor, shape=shape, dtype=out_a.dtype, device=out_a.device)
    for name, tensor in (("lse_a", lse_a), ("lse_b", lse_b), ("lse", lse)):
        check_tensor(name, tensor, shape=shape[:2], float32=True, device=out_a.device)
    rows = shape[0] * shape[1]
    if rows == 0:
        return
    block_d = triton.next_power_of_2(shape[2])
    block_r = triton.next_power_of_2(rows_per_program(out, block_d))
    _merge_states_kernel[(triton.cdiv(rows, block_r),)](
        out_a, lse_a, out_b, lse_b, out, lse, rows, HEAD_DIM=shape[2], BLOCK_D=block_d,
        BLOCK_R=block_r)
