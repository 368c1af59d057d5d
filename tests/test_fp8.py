"""FP8 KV caches: the spec names them, the problem stores codes and scales, the oracle reads
exactly what they denote, and a backend claims them or is told why not (issue 18)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from conformance.backends.base import Capabilities
from conformance.bench import select_shapes
from conformance.checks import Trial
from conformance.dtypes import FP8_DTYPES, fp8_max, fp8_smallest_normal, widened
from conformance.materialise import logical_kv, materialise
from conformance.references import decode_reference, kept_tokens
from conformance.references.decode import token_scales
from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import Case, SpecError, default_spec, parse_spec
from tests.small_specs import one_family_spec, small_case


def fp8_case(**fields) -> Case:
    return small_case(**{"dtype": "float16", "context_lens": (10, 0, 7),
                         "kv_dtype": "float8_e4m3fn", **fields})


def spec_with(**fields) -> dict:
    return one_family_spec(**{"dtypes": ["float16"], **fields})


def test_kv_dtypes_cross_like_dtypes_and_the_id_names_format_and_layout():
    spec = parse_spec(spec_with(kv_dtypes=["float8_e4m3fn", "float8_e5m2"],
                                kv_scale="per-head", kv_scaling="saturate"))
    ids = [case.id for case in spec.cases("p")]
    assert ids == ["f/q4kv2-d16-ps4-f16-kv-e4m3-per-head-saturate/ctx[5]-normal",
                   "f/q4kv2-d16-ps4-f16-kv-e5m2-per-head-saturate/ctx[5]-normal"]
    plain = parse_spec(spec_with()).cases("p")[0]
    assert plain.kv_dtype is None and "-kv-" not in plain.id


@pytest.mark.parametrize("fields,fragment", [
    ({"kv_dtypes": ["float8_e4m3"]}, "field 'kv_dtypes' names 'float8_e4m3'"),
    ({"kv_dtypes": "float8_e4m3fn"}, "field 'kv_dtypes' must be a non-empty list"),
    ({"kv_scale": "per-head"}, "field 'kv_scale' needs 'kv_dtypes'"),
    ({"kv_dtypes": ["float8_e5m2"], "kv_scale": "per-page"}, "field 'kv_scale' is 'per-page'"),
    ({"kv_dtypes": ["float8_e5m2"], "kv_scaling": "huge"}, "field 'kv_scaling' is 'huge'"),
    ({"kv_dtypes": ["float8_e5m2"], "kv_scaling": "spread", "num_kv_heads": 1,
      "num_qo_heads": 4}, "'spread' needs num_kv_heads >= 2, got 1"),
    ({"q_dtypes": ["float16"]}, "field 'q_dtypes' names 'float16'"),
])
def test_a_bad_fp8_field_is_refused_naming_the_field_and_value(fields, fragment):
    with pytest.raises(SpecError, match=fragment.replace("[", r"\[")):
        parse_spec(spec_with(**fields))


@pytest.mark.parametrize("mode,shape", [("per-tensor", (1,)), ("per-head", (2,)),
                                        ("per-token", (None, 4, 2))])
def test_scales_have_the_documented_layout_and_codes_the_format(mode, shape):
    problem = materialise(fp8_case(kv_scale=mode))
    assert problem.k_pages.dtype == ml_dtypes.float8_e4m3fn == problem.v_pages.dtype
    assert problem.kv_scale == mode and problem.k_scale.dtype == np.float32
    want = tuple(problem.k_pages.shape[0] if n is None else n for n in shape)
    assert problem.k_scale.shape == want == problem.v_scale.shape
    assert not np.array_equal(problem.k_scale, problem.v_scale)  # drawn apart
    assert {"k_scale", "v_scale"} <= set(problem.arrays())  # purity covers them


def test_per_token_scales_travel_with_their_tokens_through_a_relayout():
    """The scale read at a token's physical page and slot is that token's, in any layout."""
    case = fp8_case(kv_scale="per-token", context_lens=(30, 9))
    logical = logical_kv(case)
    for seed in (1, 2):
        problem = logical.lay_out(case.page_size, seed)
        for b, n in enumerate(case.context_lens):
            kept = kept_tokens(n, None, 0)
            pages = problem.block_table[b, kept // case.page_size]
            slots = kept % case.page_size
            assert np.array_equal(problem.k_scale[pages, slots], logical.k_scales[b][kept])
            assert np.array_equal(problem.k_pages[pages, slots].view(np.uint8),
                                  logical.keys[b][kept].view(np.uint8))


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_saturate_and_subnormal_scalings_reach_the_formats_ends(kv_dtype):
    top, normal = fp8_max(kv_dtype), fp8_smallest_normal(kv_dtype)
    saturated = logical_kv(fp8_case(kv_dtype=kv_dtype, kv_scaling="saturate"))
    codes = np.abs(saturated.keys[0].astype(np.float64))
    assert codes.max() == top and np.isfinite(codes).all()  # saturated, never NaN or inf
    low = logical_kv(fp8_case(kv_dtype=kv_dtype, kv_scaling="subnormal"))
    codes = np.abs(low.values[0].astype(np.float64))
    assert codes.max() <= normal and (codes[codes > 0] < normal).mean() > 0.5


def test_spread_puts_the_per_head_scales_1000x_apart_and_keeps_the_scores():
    case = fp8_case(kv_scale="per-head", kv_scaling="spread")
    problem, plain = materialise(case), materialise(case, quantized=False)
    ratio = problem.k_scale[1] / problem.k_scale[0]
    assert 300 < ratio < 3000, ratio
    # the query shrank as the keys grew: scores stay O(1)
    _, lse = decode_reference(plain.q, plain.k_pages, plain.v_pages, plain.block_table,
                              plain.context_lens, sm_scale=plain.sm_scale)
    assert np.nanmax(np.abs(lse[np.isfinite(lse)])) < 20


@pytest.mark.parametrize("name", FP8_DTYPES)
@pytest.mark.parametrize("target", [np.float32, np.float64])
def test_codes_widen_to_the_bits_ml_dtypes_gives_them(name, target):
    """The table that widens codes fast holds every code's value, NaN and inf as they are."""
    codes = np.arange(256, dtype=np.uint8).view(FP8_DTYPES[name]).reshape(8, 32)[:, ::3]
    got = widened(codes, target)
    assert got.dtype == target and got.shape == codes.shape
    assert got.tobytes() == codes.astype(target).tobytes()


@pytest.mark.parametrize("mode", ["per-tensor", "per-head", "per-token"])
def test_the_oracle_reads_codes_times_scales(mode):
    """The oracle on codes and scales equals the oracle on float64 pages holding the values
    the codes denote, each slot times its own scale."""
    problem = materialise(fp8_case(kv_scale=mode, context_lens=(13, 6)))
    slots = problem.k_pages.shape[:3]
    pages, within = np.indices(slots[:2]).reshape(2, -1)
    k_scale = token_scales(problem.k_scale, pages, within, slots[2]).reshape(slots)
    v_scale = token_scales(problem.v_scale, pages, within, slots[2]).reshape(slots)
    denoted = (problem.k_pages.astype(np.float64) * k_scale[..., None],
               problem.v_pages.astype(np.float64) * v_scale[..., None])
    common = dict(sm_scale=problem.sm_scale)
    want = decode_reference(problem.q, *denoted, problem.block_table, problem.context_lens,
                            **common)
    got = decode_reference(problem.q, problem.k_pages, problem.v_pages, problem.block_table,
                           problem.context_lens, k_scale=problem.k_scale,
                           v_scale=problem.v_scale, **common)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_an_fp8_case_is_judged_at_the_query_dtypes_budget_not_the_formats():
    """The exact oracle holds a float16-output kernel to float16's budget, though storing
    the cache in e4m3 moves the answer a hundred times further."""
    backend = open_backend("numpy", isolated=False)
    trial = Trial(backend.connect(isolated=False), fp8_case(kv_scale="per-head"))
    out_budget, _ = trial.budget
    assert out_budget.value < 0.01
    assert trial.quantization_error > 10 * out_budget.value
    assert materialise(fp8_case()).q.dtype == np.float16


def test_a_backend_that_claims_no_fp8_is_told_why():
    reason = Capabilities().unsupported_reason(fp8_case())
    assert reason.startswith("kv dtype float8_e4m3fn not in capabilities (none")
    some = Capabilities(kv_dtypes=frozenset({"float8_e4m3fn"}),
                        kv_scales=frozenset({"per-tensor"}))
    assert some.unsupported_reason(fp8_case()) is None
    assert "kv scale per-token" in some.unsupported_reason(fp8_case(kv_scale="per-token"))
    assert "query dtype float8_e5m2" in some.unsupported_reason(fp8_case(q_dtype="float8_e5m2"))
    assert Capabilities.from_data(some.as_data()) == some


@pytest.mark.parametrize("fields,fragment", [
    ({"kv_dtypes": frozenset({"fp8"}), "kv_scales": frozenset({"per-tensor"})}, "kv_dtypes"),
    ({"kv_dtypes": frozenset({"float8_e5m2"})}, "needs both"),
    ({"kv_scales": frozenset({"per-block"}), "kv_dtypes": frozenset({"float8_e5m2"})},
     "kv_scales"),
    ({"q_dtypes": "float8_e5m2"}, "q_dtypes must be a set"),
])
def test_malformed_fp8_claims_are_refused(fields, fragment):
    with pytest.raises(ValueError, match=fragment):
        Capabilities(**fields)


def test_the_ci_profile_holds_both_formats_in_every_layout_and_numpy_passes_them():
    cases = [c for c in select_cases(default_spec(), "ci") if c.kv_dtype is not None]
    assert {(c.kv_dtype, c.kv_scale) for c in cases} == {
        (f, m) for f in ("float8_e4m3fn", "float8_e5m2")
        for m in ("per-tensor", "per-head", "per-token")}
    assert {c.kv_scaling for c in cases} == {"fit", "spread", "saturate", "subnormal"}
    assert any(c.q_dtype for c in cases)
    report = run([open_backend("numpy")], cases, RunSettings(profile="ci"))
    assert report.failures == [] and {r.status for r in report.results} == {"passed"}
    checks = {r.check for r in report.results}
    assert "invariance/kv-scale" in checks and "poison/masked-nan" in checks
    notes = [r.message for r in report.results if r.check == "oracle/output"]
    assert all("fp8 storage moves the float64 answer by" in n for n in notes)


def test_the_gpu_bench_shapes_time_an_e4m3_twin_on_half_the_bytes():
    shapes = {s.name: s for s in select_shapes("gpu")}
    twin = shapes["1x131072-32/8-kv-e4m3"]
    assert twin.kv_dtype == "float8_e4m3fn" and twin.case().kv_scale == "per-tensor"
    assert twin.kv_bytes * 2 == shapes["1x131072-32/8"].kv_bytes
    assert math.isclose(len(shapes) / 2, sum(1 for s in shapes.values() if s.kv_dtype))
