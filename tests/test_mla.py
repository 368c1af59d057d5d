"""Multi-head latent attention: the spec names it, the problem stores the latent once, the
oracle reads it as key and value, a GQA-only backend is told why not, and explore draws it
for a backend that claims it (issue 21)."""

from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conformance.backends.base import Capabilities
from conformance.materialise import materialise
from conformance.references import decode_reference, kept_tokens
from conformance.spec import Case, SpecError, parse_spec
from conformance.strategies import cases
from conformance.wire import pack_message, unpack_message


def mla_spec(**fields) -> dict:
    family = {"name": "mla/f", "profiles": ["p"], "set": {
        "num_qo_heads": 4, "kv_lora_rank": 16, "rope_dim": 8, "page_size": 4,
        "context_lens": [9, 0, 5], "dtypes": ["float32"], **fields}}
    defaults = {"num_kv_heads": 2, "head_dim": 64}  # what GQA families inherit
    return {"profiles": {"p": {}}, "defaults": defaults, "family": [family]}


def mla_case(**fields) -> Case:
    return parse_spec(mla_spec(**fields)).cases("p")[0]


def test_an_mla_case_is_one_latent_of_rank_plus_rope_and_its_id_starts_with_the_kind():
    case = mla_case()
    assert (case.kind, case.num_kv_heads, case.head_dim, case.head_dim_v, case.rope_dim) == \
        ("mla", 1, 24, 16, 8)
    assert case.id == "mla/f/h4-r16-rope8-ps4-f32/ctx[9,0,5]-normal"
    assert case.features == frozenset()  # a kind, not a feature


@pytest.mark.parametrize("fields,fragment", [
    ({"head_dim": 24}, "field 'head_dim' is set by an MLA case"),
    ({"num_kv_heads": 1}, "field 'num_kv_heads' is set by an MLA case"),
    ({"kv_dtypes": ["float8_e4m3fn"]}, "field 'kv_dtypes' with kv_lora_rank"),
    ({"soft_cap": 30.0}, "field 'soft_cap' with kv_lora_rank"),
    ({"query_lens": 2}, "field 'query_lens' with kv_lora_rank"),
    ({"distribution": "constant-v"}, "field 'distribution' is 'constant-v'"),
])
def test_what_mla_does_not_combine_with_is_refused_naming_the_field(fields, fragment):
    with pytest.raises(SpecError, match=fragment):
        parse_spec(mla_spec(**fields))


def test_a_latent_without_its_rotary_width_is_refused():
    spec = mla_spec()
    del spec["family"][0]["set"]["rope_dim"]
    with pytest.raises(SpecError, match="field 'rope_dim' is missing"):
        parse_spec(spec)


def test_the_value_is_the_stored_latent_and_travels_as_a_view_of_it():
    problem = materialise(mla_case())
    assert np.shares_memory(problem.v_pages, problem.k_pages)
    assert (problem.v_pages == problem.k_pages[..., :16]).all()
    assert "v_pages" not in problem.arrays()
    for copy in (pickle.loads(pickle.dumps(problem)), unpack_message(*_packed(problem))):
        assert np.shares_memory(copy.v_pages, copy.k_pages)
        assert copy.ckv_pages.shape == (problem.k_pages.shape[0], 4, 16)
        assert copy.kpe_pages.shape == (problem.k_pages.shape[0], 4, 8)


def _packed(problem):
    payload, segment = pack_message(problem)  # as the harness sends it to a worker
    return payload, os.dup(segment.arena.fd)


def test_the_oracle_scores_latent_and_rope_and_returns_the_weighted_latents():
    problem = materialise(mla_case(context_lens=[9, 0, 5], sm_scale=0.2))
    out, lse = decode_reference(problem.q, problem.k_pages, problem.v_pages,
                                problem.block_table, problem.context_lens,
                                sm_scale=problem.sm_scale)
    assert out.shape == (3, 4, 16)
    for b, n in enumerate(problem.context_lens):
        positions = kept_tokens(int(n), None, 0)
        pages = problem.block_table[b, positions // 4]
        latent = problem.ckv_pages[pages, positions % 4].astype(np.float64)
        rope = problem.kpe_pages[pages, positions % 4].astype(np.float64)
        for h in range(4):
            scores = 0.2 * (latent @ problem.q_nope[b, h] + rope @ problem.q_pe[b, h])
            if n == 0:
                assert lse[b, h] == -math.inf and not out[b, h].any()
                continue
            weights = np.exp(scores - scores.max())
            np.testing.assert_allclose(out[b, h], weights @ latent / weights.sum(), rtol=1e-12)
            np.testing.assert_allclose(lse[b, h], scores.max() + np.log(weights.sum()))


def test_a_gqa_backend_is_told_why_not_and_an_mla_backend_names_its_latents():
    case = mla_case()
    assert "problem kind mla not in capabilities (gqa only)" in \
        Capabilities().unsupported_reason(case)
    only_deepseek = Capabilities(kinds=frozenset({"mla"}), latent_dims=frozenset({(512, 64)}))
    assert "kv_lora_rank 16, rope_dim 8 not in capabilities" in \
        only_deepseek.unsupported_reason(case)
    gqa = Case(family="t", num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
               dtype="float32", context_lens=(3,))
    assert "problem kind gqa" in only_deepseek.unsupported_reason(gqa)


@pytest.mark.parametrize("kinds", [frozenset(), frozenset({"mqa"}), "mla"])
def test_a_kind_no_one_knows_is_refused(kinds):
    with pytest.raises(ValueError, match=r"Capabilities\.kinds"):
        Capabilities(kinds=kinds)


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(cases(Capabilities(kinds=frozenset({"mla"}), features=frozenset({"lse"}))))
def test_explore_draws_mla_cases_for_a_backend_that_claims_only_mla(case):
    assert case.kind == "mla" and case.num_kv_heads == 1
    assert case.head_dim == case.kv_lora_rank + case.rope_dim
    assert case.kv_dtype is None and case.query_lens is None and case.soft_cap is None


def test_tvm_reads_each_kept_token_of_a_sequence_from_its_merged_latent_page():
    """TVM's MLA cache (backends/tvm/layout.py): page-list position ``i`` of sequence ``b``
    holds its ``i``-th kept token, latent then rope; every other slot is NaN."""
    from conformance.backends.tvm.layout import page_list_positions, tvm_layout

    for fields in ({}, {"context_lens": [13, 0, 3], "window": 4, "sinks": 2}):
        problem = materialise(mla_case(**fields))
        kv = tvm_layout(problem)
        assert kv.pages.shape[1:] == (problem.page_size, 24)
        kept = 0
        for b, n in enumerate(problem.context_lens):
            tokens, positions, _, _ = page_list_positions(int(n), problem.window, problem.sinks,
                                                          problem.page_size)
            mine = kv.page_values[kv.page_indptr[b]:kv.page_indptr[b + 1]]
            stored = kv.pages[mine[positions // problem.page_size],
                              positions % problem.page_size]
            source = problem.k_pages[problem.block_table[b, tokens // problem.page_size],
                                     tokens % problem.page_size, 0]
            np.testing.assert_array_equal(stored, source)
            kept += len(tokens)
        assert np.isfinite(kv.pages).all(axis=-1).sum() == kept


def test_tvm_builds_its_mla_kernel_for_every_page_size_a_case_needs():
    """The keys of an MLA case: TVM's MLA kernel at its page size and twice it, with and
    without the window, and the merge at the latent's width; no GQA decode."""
    from conformance.backends.tvm import kernels

    case = mla_case(window=4, sinks=1)
    keys = kernels.keys_for_case(case, "cuda")
    assert {(k.kernel, k.page_size, k.sliding_window) for k in keys} == {
        ("mla", 4, True), ("mla", 4, False), ("mla", 8, True), ("mla", 8, False),
        ("merge", 0, False)}
    for key in keys:
        assert kernels.KernelKey.from_filename(key.filename) == key
        assert key.head_dim == 16 and key.rope_dim == (8 if key.kernel == "mla" else 0)
    pytest.importorskip("tvm", reason="apache-tvm is not installed (the tvm extra)")
    if not kernels.has_compiler():
        pytest.skip("this tvm has no compiler library")
    mla = kernels.KernelKey.for_case(case, "cuda")
    assert "mla_sliding_window" in kernels.cuda_sources(kernels.compile_kernel(mla))[0]
