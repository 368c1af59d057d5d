"""Launch options that change how the split-KV kernel reads the same pages (what
``benchmarks/sweep_splitkv.py`` times) give the same bits as the adapter's launch."""

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("triton or torch is not installed (pip install -e '.[triton]')",
                allow_module_level=True)

from conformance.backends.triton import runtime

runtime.select_mode()  # the interpreter on a CPU machine, before triton is imported
import torch  # noqa: E402

from benchmarks.sweep_splitkv import paged  # noqa: E402
from conformance.backends.tensors import to_torch  # noqa: E402
from conformance.backends.triton.splitkv_kernel import splitkv_decode  # noqa: E402
from conformance.backends.triton.validation import Scales  # noqa: E402
from conformance.materialise import materialise  # noqa: E402
from conformance.spec import Case  # noqa: E402


def decode(problem, config: dict) -> tuple:
    tensors = {k: to_torch(v, "cpu") for k, v in problem.arrays().items()}
    out = torch.full(problem.q.shape, float("nan"), dtype=torch.float16)
    lse = torch.full(problem.q.shape[:2], float("nan"), dtype=torch.float32)
    scales = Scales(problem.kv_scale, tensors.get("k_scale"), tensors.get("v_scale"))
    k_pages, v_pages = paged(tensors, config.get("head_major", False))
    splitkv_decode(tensors["q"], k_pages, v_pages, tensors["block_table"],
                   tensors["context_lens"], out, lse, sm_scale=problem.sm_scale,
                   validate=False, num_splits=2, scales=scales, config=config)
    return out, lse


@pytest.mark.parametrize("kv_dtype,kv_scale", [(None, None), ("float8_e4m3fn", "per-token")])
@pytest.mark.parametrize("config", [{"head_major": True}, {"loop_stages": 3},
                                    {"head_major": True, "loop_stages": 3}])
def test_head_major_pages_and_a_pipelined_loop_give_the_same_bits(kv_dtype, kv_scale, config):
    """Head-major pages are read at other offsets while the per-token scales keep theirs."""
    problem = materialise(Case(family="t", num_qo_heads=4, num_kv_heads=2, head_dim=16,
                               page_size=4, dtype="float16", context_lens=(5, 0, 23),
                               kv_dtype=kv_dtype, kv_scale=kv_scale))
    out, lse = decode(problem, {})
    changed_out, changed_lse = decode(problem, config)
    assert not torch.isnan(out[[0, 2]]).any()
    assert torch.equal(out.view(torch.int16), changed_out.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), changed_lse.view(torch.int32))
