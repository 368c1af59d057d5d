"""What models do to the scores: soft-cap, sink logits, ALiBi — spec fields, the float64
oracle against a brute-force softmax, and the merge rule for sinks and positions (issue 19)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.backends.base import Capabilities, Conventions
from conformance.materialise import logical_kv, materialise
from conformance.references import alibi_slopes, apply_sink, decode_reference, merge_reference
from conformance.references.decode import gather_sequence
from conformance.runner import run
from conformance.selection import select_cases
from conformance.session import RunSettings, open_backend
from conformance.spec import SpecError, default_spec, parse_spec
from tests.small_specs import one_family_spec, small_case

case = small_case
spec_with = one_family_spec


def test_the_id_names_each_modifier():
    spec = parse_spec(spec_with(soft_cap=30.0, sink_logits="large", alibi=True))
    assert spec.cases("p")[0].id.endswith("-normal-softcap30-sinklogits-large-alibi")
    explicit = parse_spec(spec_with(sink_logits=[1.0, -math.inf, 0.5, 2.0],
                                    alibi=[0.5, 0.25, 0.125, 0.0])).cases("p")[0]
    assert explicit.id.endswith("-sinklogits[1,-inf,0.5,2]-alibi[0.5,0.25,0.125,0]")
    assert explicit.features == {"sink_logits", "alibi"}


@pytest.mark.parametrize("fields,fragment", [
    ({"soft_cap": 0}, "field 'soft_cap' must be a finite positive number, got 0"),
    ({"soft_cap": "30"}, "field 'soft_cap' must be a finite positive number"),
    ({"sink_logits": "huge"}, "field 'sink_logits' is 'huge'"),
    ({"sink_logits": [1.0, 2.0]}, "lists 2 values for num_qo_heads=4"),
    ({"sink_logits": [1.0, math.nan, 0.0, 0.0]}, "must list one number per query head"),
    ({"alibi": "yes"}, "field 'alibi' must be true, false or a list of slopes"),
    ({"alibi": [0.5, math.inf, 0.1, 0.1]}, "must list one finite number per query head"),
])
def test_a_bad_modifier_is_refused_naming_the_field_and_value(fields, fragment):
    with pytest.raises(SpecError, match=fragment.replace("[", r"\[")):
        parse_spec(spec_with(**fields))


def test_standard_alibi_slopes_follow_press_et_al():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    # not a power of two: the 4-head slopes, then every other slope of the 8-head ones
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                        2.0 ** -1, 2.0 ** -3]


def brute_force(problem, b: int, h: int, lse_includes_sink: bool = True):
    """One row by the textbook formula, every token written out."""
    n = int(problem.context_lens[b])
    keys, values = gather_sequence(problem.k_pages, problem.v_pages, problem.block_table[b],
                                   problem.kept(b))
    kv = h // problem.group_size
    q = problem.q[b, h].astype(np.float64)
    scores = []
    for j, position in enumerate(problem.kept(b)):
        s = float(keys[j, kv].astype(np.float64) @ q) * problem.sm_scale
        if problem.soft_cap is not None:
            s = problem.soft_cap * math.tanh(s / problem.soft_cap)
        if problem.alibi_slopes is not None:
            s += float(problem.alibi_slopes[h]) * (int(position) - (n - 1))
        scores.append(s)
    sink = None if problem.sink_logits is None else float(problem.sink_logits[h])
    terms = [math.exp(s) for s in scores]
    denominator = sum(terms) + (math.exp(sink) if sink is not None else 0.0)
    out = sum(t * values[j, kv].astype(np.float64) for j, t in enumerate(terms)) \
        if terms else np.zeros(problem.head_dim)
    out = out / denominator if denominator else out
    counted = denominator if lse_includes_sink else sum(terms)
    return out, (math.log(counted) if counted else -math.inf)


@pytest.mark.parametrize("fields", [
    {"soft_cap": 5.0}, {"sink_logits": "normal"}, {"alibi": True},
    {"soft_cap": 3.0, "sink_logits": "normal", "alibi": True, "window": 9, "sinks": 2},
    {"sink_logits": (1.0, -math.inf, 0.5, 2.0)},
])
@pytest.mark.parametrize("includes", [True, False])
def test_the_oracle_is_the_textbook_formula(fields, includes):
    problem = materialise(case(**fields))
    out, lse = decode_reference(problem.q, problem.k_pages, problem.v_pages,
                                problem.block_table, problem.context_lens,
                                sm_scale=problem.sm_scale, window=problem.window,
                                sinks=problem.sinks, soft_cap=problem.soft_cap,
                                sink_logits=problem.sink_logits,
                                alibi_slopes=problem.alibi_slopes, lse_includes_sink=includes)
    for b in range(problem.batch):
        for h in range(problem.num_qo_heads):
            want_out, want_lse = brute_force(problem, b, h, includes)
            np.testing.assert_allclose(out[b, h], want_out, rtol=1e-12, atol=1e-300)
            assert lse[b, h] == pytest.approx(want_lse, rel=1e-12) or lse[b, h] == want_lse


def test_an_empty_row_with_a_sink_logit_has_output_0_and_lse_the_sink():
    problem = materialise(case(sink_logits="normal"))
    out, lse = decode_reference(problem.q, problem.k_pages, problem.v_pages,
                                problem.block_table, problem.context_lens,
                                sm_scale=problem.sm_scale, sink_logits=problem.sink_logits)
    assert (out[1] == 0).all()
    np.testing.assert_array_equal(lse[1], problem.sink_logits.astype(np.float64))


def test_a_sink_joined_once_to_merged_halves_equals_the_whole():
    """The merge rule the merge checks rest on: halves decoded without the sink, merged,
    then the sink applied once, give the oracle with the sink; joined to each half it is
    counted twice."""
    c = case(sink_logits="normal", context_lens=(30, 12))
    logical = logical_kv(c)

    def oracle(logical_part, sink):
        p = logical_part.lay_out(c.page_size, 7)
        return decode_reference(p.q, p.k_pages, p.v_pages, p.block_table, p.context_lens,
                                sm_scale=p.sm_scale, sink_logits=sink)

    whole = oracle(logical, logical.sink_logits)
    halves = [oracle(logical.take([np.arange(n)[part(n)] for n in c.context_lens]), None)
              for part in (lambda n: slice(0, n // 2), lambda n: slice(n // 2, n))]
    merged = merge_reference(*halves[0], *halves[1])
    out, lse = apply_sink(*merged, logical.sink_logits)
    np.testing.assert_allclose(out, whole[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-12)
    twice = merge_reference(*apply_sink(*halves[0], logical.sink_logits),
                            *apply_sink(*halves[1], logical.sink_logits))
    assert np.abs(twice[1] - whole[1]).max() > 1e-3


def test_the_ci_profile_holds_every_modifier_alone_and_together_and_numpy_passes():
    cases = [c for c in select_cases(default_spec(), "ci") if c.features & {
        "soft_cap", "sink_logits", "alibi"}]
    kinds = {frozenset(c.features & {"soft_cap", "sink_logits", "alibi"}) for c in cases}
    assert {frozenset({"soft_cap"}), frozenset({"sink_logits"}), frozenset({"alibi"}),
            frozenset({"soft_cap", "sink_logits", "alibi"})} <= kinds
    assert any(c.kv_dtype for c in cases) and any(c.window and c.sinks for c in cases)
    report = run([open_backend("numpy")], cases, RunSettings(profile="ci"))
    assert report.failures == [] and {r.status for r in report.results} == {"passed"}


def test_a_backend_without_a_modifier_is_told_which():
    reason = Capabilities(features=frozenset({"lse"})).unsupported_reason(
        case(soft_cap=30.0, alibi=True))
    assert reason == "feature alibi, soft_cap not in capabilities"


def test_a_backend_whose_lse_leaves_the_sink_out_declares_it():
    assert Conventions.from_data(Conventions(lse_includes_sink=False).as_data()) == \
        Conventions(lse_includes_sink=False)
    with pytest.raises(ValueError, match="lse_includes_sink must be True or False"):
        Conventions(lse_includes_sink="no")


def test_flashinfer_claims_each_modifier_alone_standard_slopes_only_and_not_alibi_capped():
    from conformance.backends.flashinfer.backends import FlashInferTensorCores

    claims = FlashInferTensorCores.__new__(FlashInferTensorCores).unsupported_reason
    fields = dict(dtype="float16", head_dim=64)
    assert claims(case(soft_cap=30.0, **fields)) is None
    assert claims(case(sink_logits="normal", **fields)) is None
    assert claims(case(alibi=True, **fields)) is None
    assert "explicit ALiBi slopes" in claims(case(alibi=(0.5,) * 4, **fields))
    assert "scales the score twice" in claims(case(alibi=True, soft_cap=30.0, **fields))


def test_compiled_flex_attention_is_not_given_head_dims_below_16(monkeypatch):
    from conformance.backends.torch import backends as torch_backends

    flex = torch_backends.TorchFlex.__new__(torch_backends.TorchFlex)
    monkeypatch.setattr(torch_backends, "device", lambda: "cuda")
    assert "NYI" in flex.unsupported_reason(case(head_dim=8))
    assert flex.unsupported_reason(case(head_dim=16)) is None
    monkeypatch.setattr(torch_backends, "device", lambda: "cpu")
    assert flex.unsupported_reason(case(head_dim=8)) is None
