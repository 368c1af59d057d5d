"""The spec expands deterministically, covers every family per dtype, and rejects bad entries."""

import tomllib

import pytest

from conformance.dtypes import DTYPES
from conformance.spec import SPEC_PATH, Case, SpecError, default_spec, load_spec, parse_spec

REQUIRED_FAMILIES = {
    "empty-context", "short-context", "partial-last-page", "page-size-1", "wide-table",
    "shared-pages", "split-edges", "group-sizes", "head-dims", "sliding-window", "sinks",
    "distributions", "sm-scale", "batch-size", "model-shapes",
}


def test_expansion_is_deterministic_and_ids_unique():
    first = [c.id for c in load_spec().cases("full")]
    second = [c.id for c in load_spec().cases("full")]
    assert first == second
    assert len(first) == len(set(first))


def test_ci_covers_every_edge_case_family_in_every_dtype():
    seen = {(c.family, c.dtype) for c in default_spec().cases("ci")}
    for family in REQUIRED_FAMILIES:
        for dtype in DTYPES:
            assert (family, dtype) in seen, (family, dtype)


def test_ci_holds_the_edge_values_of_design_section_7():
    cases = default_spec().cases("ci")
    group_sizes = {c.group_size for c in cases}
    assert {1, 2, 7, 8, 16, 71} <= group_sizes
    assert any(c.num_kv_heads == 1 for c in cases)
    assert {64, 96, 128, 256} <= {c.head_dim for c in cases}
    windows = [(c.window, c.context_lens, c.page_size) for c in cases if c.window]
    assert any(w == 1 for w, _, _ in windows)
    assert any(w > max(lens) for w, lens, _ in windows)
    assert {0, 1} <= {c.sinks for c in cases if c.window}
    assert any(c.sinks > c.page_size for c in cases)
    assert {"peaked", "uniform", "large", "very-negative", "constant-v"} <= {
        c.distribution for c in cases}
    assert any(1 in c.context_lens and c.page_size > 1 for c in cases)
    assert any(len(c.context_lens) == 1 for c in cases) and any(c.batch > 30 for c in cases)
    assert any(all(n == 0 for n in c.context_lens) for c in cases)
    assert any(c.sm_scale is not None for c in cases)
    assert any(c.num_splits and max(c.context_lens) < c.num_splits for c in cases)


def test_model_shapes_are_the_named_models():
    shapes = {c.tag: (c.num_qo_heads, c.num_kv_heads, c.head_dim)
              for c in default_spec().cases("full") if c.tag}
    assert shapes["llama-3.1-8b"] == (32, 8, 128)
    assert shapes["falcon-7b"] == (71, 1, 64)
    assert shapes["phi-3-mini"] == (32, 32, 96)
    assert any(c.tag == "mistral-7b" and c.window == 4096 for c in default_spec().cases("full"))


def test_case_id_is_readable():
    case = Case(family="demo", num_qo_heads=32, num_kv_heads=4, head_dim=128, page_size=16,
                dtype="float16", context_lens=(0, 17, 300), window=64, sinks=4,
                distribution="peaked")
    assert case.id == "demo/q32kv4-d128-ps16-f16/ctx[0,17,300]-window64+sink4-peaked"
    assert case.group_size == 8


def test_multi_token_case_id_carries_query_lengths_and_mask():
    case = Case(family="demo", num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                dtype="float16", context_lens=(37, 5, 80), query_lens=(1, 4, 2), mask="tree")
    assert case.id == "demo/q8kv2-d64-ps16-f16/ctx[37,5,80]-qlen[1,4,2]-tree-normal"
    assert case.tokens == 7 and {"multi_token", "draft_mask"} <= case.features


def _spec_with(**family):
    data = tomllib.loads(SPEC_PATH.read_text())
    data["family"] = [{"name": "probe", "profiles": ["ci"], **family}]
    return data


@pytest.mark.parametrize("family,fragments", [
    ({"variants": [{"contxt_lens": [3]}]}, ["'probe'", "variant 1", "'contxt_lens'"]),
    ({"variants": [{"head_dim": "64"}]}, ["'probe'", "'head_dim'", "integer", "'64'"]),
    ({"variants": [{"num_qo_heads": 6, "num_kv_heads": 4}]},
     ["'probe'", "num_qo_heads=6", "num_kv_heads=4"]),
    ({"set": {"dtypes": ["float8"]}}, ["'probe'", "'dtypes'", "'float8'"]),
    ({"profiles": ["nightly"]}, ["'probe'", "'profiles'", "'nightly'"]),
    ({"variants": [{"distribution": "spiky"}]}, ["'probe'", "'distribution'", "'spiky'"]),
    ({"variants": [{"context_lens": [-1]}]}, ["'probe'", "'context_lens'", "-1"]),
    ({"variants": [{"sinks": 2}]}, ["'probe'", "'sinks'", "window"]),
    ({"variants": [{"page_size": 0}]}, ["'probe'", "'page_size'", ">= 1"]),
    ({"grid": {"head_dim": 64}}, ["'probe'", "'head_dim'", "list"]),
    ({"colour": "red"}, ["'probe'", "'colour'"]),
    ({"variants": [{"query_lens": [1, 2], "context_lens": [5, 6, 7]}]},
     ["'probe'", "'query_lens'", "one per sequence (3)"]),
    ({"variants": [{"query_lens": [4], "context_lens": [3]}]},
     ["'probe'", "'query_lens'", "is 4 for sequence 0", "context of 3"]),
    ({"variants": [{"query_lens": 65, "context_lens": [100]}]},
     ["'probe'", "'query_lens'", "65", "at most 64"]),
    ({"variants": [{"query_lens": 0, "context_lens": [3]}]}, ["'probe'", "'query_lens'", "0"]),
    ({"variants": [{"mask": "tree"}]}, ["'probe'", "'mask'", "'query_lens'"]),
    ({"variants": [{"mask": "diagonal", "query_lens": 2}]}, ["'probe'", "'mask'", "'diagonal'"]),
])
def test_bad_spec_names_the_entry_and_the_field(family, fragments):
    with pytest.raises(SpecError) as error:
        parse_spec(_spec_with(**family), source="bad.toml")
    message = str(error.value)
    assert message.startswith("bad.toml")
    for fragment in fragments:
        assert fragment in message


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(SpecError, match="known: smoke, ci, full"):
        default_spec().cases("nightly")


def test_invalid_toml_is_reported_with_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[defaults\n")
    with pytest.raises(SpecError, match=r"broken\.toml': not valid TOML"):
        load_spec(path)


def readme_families() -> list[dict]:
    """The ``[[family]]`` examples of the README, parsed."""
    text = (SPEC_PATH.parents[1] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```toml\n")[1:]]
    return [tomllib.loads(b)["family"][0] for b in blocks if b.startswith("[[family]]")]


def test_the_readme_spec_examples_load_and_the_built_in_ones_match_the_spec():
    spec_text = tomllib.loads(SPEC_PATH.read_text())
    built_in = {f["name"]: f for f in spec_text["family"]}
    examples = readme_families()
    assert len(examples) >= 2
    for example in examples:
        renamed = {**example, "name": f"readme-{example['name']}"}
        spec = parse_spec({**spec_text, "family": [*spec_text["family"], renamed]})
        assert any(c.family == renamed["name"] for p in example["profiles"]
                   for c in spec.cases(p)), example["name"]
        if example["name"] in built_in:  # shown as the spec has it, but for its doc
            same = {k: v for k, v in built_in[example["name"]].items() if k != "doc"}
            assert {k: v for k, v in example.items() if k != "doc"} == same
