"""The Triton wrappers refuse bad input with a ValueError naming the argument, before launch."""

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("triton or torch is not installed (pip install -e '.[triton]')",
                allow_module_level=True)

from conformance.backends.triton import runtime

runtime.select_mode()  # the interpreter on a CPU machine, before triton is imported
import torch  # noqa: E402

from conformance.backends.tensors import to_torch  # noqa: E402
from conformance.backends.triton.merge_kernel import merge_states  # noqa: E402
from conformance.backends.triton.mla_kernel import mla_decode  # noqa: E402
from conformance.backends.triton.paged_kernel import paged_decode  # noqa: E402
from conformance.backends.triton.splitkv_kernel import splitkv_decode  # noqa: E402
from conformance.materialise import materialise  # noqa: E402
from conformance.spec import Case  # noqa: E402

CASE = Case(family="t", num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
            dtype="float16", context_lens=(5, 9))


def inputs():
    problem = materialise(CASE)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in
               problem.arrays().items()}
    tensors["out"] = torch.empty(problem.q.shape, dtype=torch.float16)
    tensors["lse"] = torch.empty(problem.q.shape[:2], dtype=torch.float32)
    return problem, tensors


def call(kernel, tensors, **kwargs):
    kernel(tensors["q"], tensors["k_pages"], tensors["v_pages"], tensors["block_table"],
           tensors["context_lens"], tensors["out"], tensors["lse"], sm_scale=0.25, **kwargs)


@pytest.mark.parametrize("kernel", [splitkv_decode, paged_decode])
@pytest.mark.parametrize("change,fragment", [
    (lambda t: t.update(q=t["q"].float()), "k_pages: expected dtype float32"),
    (lambda t: t.update(v_pages=t["v_pages"][:, :, :1].contiguous()), "v_pages: expected shape"),
    (lambda t: t.update(block_table=t["block_table"].long()), "block_table: expected dtype int32"),
    (lambda t: t["block_table"].__setitem__((0, 0), 10_000), "block id 10000 is past the pool"),
    (lambda t: t["context_lens"].__setitem__(0, 10_000), "context_lens: 10000 tokens"),
    (lambda t: t.update(out=t["out"][:1]), "out: expected shape"),
    (lambda t: t.update(lse=t["lse"].half()), "lse: expected dtype float32"),
    (lambda t: t.update(k_pages=t["k_pages"].transpose(1, 2)), "must be contiguous"),
])
def test_bad_argument_is_named(kernel, change, fragment):
    _, tensors = inputs()
    change(tensors)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        call(kernel, tensors)


MLA_CASE = Case(family="t", num_qo_heads=4, num_kv_heads=1, head_dim=24, page_size=4,
                dtype="float16", context_lens=(5, 9), kv_lora_rank=16)


@pytest.mark.parametrize("change,fragment", [
    (lambda t: t.update(kv_lora_rank=24), "kv_lora_rank: 24, want 0 < kv_lora_rank < q's width"),
    (lambda t: t.update(pages=t["pages"][..., :16].contiguous()),
     "pages: want (pages, page_size, 1, 24)"),
    (lambda t: t.update(pages=t["pages"].float()), "pages: expected dtype float16"),
    (lambda t: t.update(out=t["out"][..., :8].contiguous()), "out: expected shape (2, 4, 16)"),
    (lambda t: t["block_table"].__setitem__((1, 0), 10_000), "block id 10000 is past the pool"),
    (lambda t: t.update(window=0), "window: 0"),
])
def test_bad_mla_argument_is_named(change, fragment):
    problem = materialise(MLA_CASE)
    tensors = {"q": torch.from_numpy(problem.q), "pages": torch.from_numpy(problem.k_pages),
               "block_table": torch.from_numpy(problem.block_table),
               "context_lens": torch.from_numpy(problem.context_lens),
               "out": torch.empty((2, 4, 16), dtype=torch.float16),
               "lse": torch.empty((2, 4), dtype=torch.float32), "kv_lora_rank": 16,
               "window": None}
    change(tensors)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        mla_decode(tensors["q"], tensors["pages"], tensors["block_table"],
                   tensors["context_lens"], tensors["out"], tensors["lse"],
                   kv_lora_rank=tensors["kv_lora_rank"], sm_scale=0.25,
                   window=tensors["window"])


def test_bad_window_and_split_count_are_named():
    _, tensors = inputs()
    with pytest.raises(ValueError, match="window: 0"):
        call(splitkv_decode, tensors, window=0)
    with pytest.raises(ValueError, match="num_splits: 0"):
        call(splitkv_decode, tensors, num_splits=0)


def test_merge_names_mismatched_states():
    out = torch.zeros((2, 3, 16), dtype=torch.float16)
    lse = torch.zeros((2, 3), dtype=torch.float32)
    with pytest.raises(ValueError, match="lse_b: expected shape"):
        merge_states(out, lse, out.clone(), lse[:1].contiguous(), out.clone(), lse.clone())


FP8_CASE = Case(family="t", num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                dtype="float16", context_lens=(5, 9), kv_dtype="float8_e4m3fn",
                kv_scale="per-token")


def fp8_inputs():
    problem = materialise(FP8_CASE)
    tensors = {k: to_torch(v, "cpu") for k, v in problem.arrays().items()}
    tensors["out"] = torch.empty(problem.q.shape, dtype=torch.float16)
    tensors["lse"] = torch.empty(problem.q.shape[:2], dtype=torch.float32)
    return problem, tensors


@pytest.mark.parametrize("kernel", [splitkv_decode, paged_decode])
@pytest.mark.parametrize("scales,fragment", [
    ({}, "k_pages: expected dtype float16, got float8_e4m3fn"),
    ({"kv_scale": "per-head"}, "k_scale: expected shape (2,)"),
    ({"kv_scale": "per-page"}, "kv_scale: 'per-page' is not one of"),
    ({"kv_scale": "per-token", "v_scale": None}, "v_scale: expected a torch.Tensor"),
    ({"kv_scale": "per-token", "q_scale": "q"}, "q_scale: given for a q of dtype float16"),
])
def test_bad_fp8_scales_are_named(kernel, scales, fragment):
    from conformance.backends.triton.validation import Scales

    _, tensors = fp8_inputs()
    given = {"k_scale": tensors["k_scale"], "v_scale": tensors["v_scale"], **scales}
    if given.get("q_scale") == "q":
        given["q_scale"] = torch.ones(1)
    kwargs = {"scales": Scales(**given)} if scales else {}
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(kernel, tensors, **kwargs)


@pytest.mark.parametrize("kernel", [splitkv_decode, paged_decode])
@pytest.mark.parametrize("modifiers,fragment", [
    ({"sink_logits": torch.zeros(3)}, "sink_logits: expected shape (4,)"),
    ({"alibi_slopes": torch.zeros(4, dtype=torch.float16)}, "alibi_slopes: expected dtype float32"),
    ({"soft_cap": -1.0}, "soft_cap: -1.0 must be positive"),
])
def test_bad_score_modifiers_are_named(kernel, modifiers, fragment):
    from conformance.backends.triton.validation import ScoreModifiers

    _, tensors = inputs()
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(kernel, tensors, modifiers=ScoreModifiers(**modifiers))


@pytest.mark.parametrize("starts,max_len,empty_first,fragment", [
    ([1, 1, 2], 1, False, "query_start: runs from 1 to 2; want 0 to q's 2 rows"),
    ([0, 2, 2], 2, False, "query_start: sequence 1 has 0 query tokens"),
    ([0, 1, 2], 1, True, "sequence 0 has 1 query tokens; want 1 to its context length 0"),
    ([0, 1, 2], 2, False, "max_query_len: 2, but the longest sequence has 1"),
])
def test_bad_query_tokens_are_named(starts, max_len, empty_first, fragment):
    from conformance.backends.triton.validation import Queries

    _, tensors = inputs()
    if empty_first:
        tensors["context_lens"][0] = 0
    queries = Queries(torch.tensor(starts, dtype=torch.int32), max_len)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(splitkv_decode, tensors, queries=queries)
