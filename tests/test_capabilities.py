"""What a backend claims: refused when malformed, narrowed to kernel instances when it has
kernels for only some shapes (an ahead-of-time build), and explained when a case is left out."""

from __future__ import annotations

import json

import pytest

from conformance.backends.base import Capabilities
from conformance.backends.tvm import backends as tvm_backends
from conformance.backends.tvm import kernels
from conformance.spec import Case

ONE = frozenset({(8, 2, 64, 16, "float16")})


def case(**fields) -> Case:
    base = dict(family="t", num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                dtype="float16", context_lens=(5,), distribution="normal")
    return Case(**{**base, **fields})


@pytest.mark.parametrize("instances", [frozenset(), frozenset({(8, 2, 64, 16)}),
                                       frozenset({(8, 2, 64, 16, "float8")}),
                                       frozenset({(8, 0, 64, 16, "float16")})])
def test_malformed_instances_are_refused_naming_the_field(instances):
    with pytest.raises(ValueError, match=r"Capabilities\.instances"):
        Capabilities(instances=instances)


def test_a_case_outside_the_instances_is_unsupported_with_its_shape():
    claims = Capabilities(instances=ONE)
    assert claims.unsupported_reason(case()) is None
    reason = claims.unsupported_reason(case(num_qo_heads=6))
    assert "6/2 heads, head_dim 64, page_size 16, float16" in reason
    assert claims.describe()["instances"] == 1 and Capabilities().describe()["instances"] == "any"


def test_runtime_only_tvm_claims_exactly_the_decode_kernels_of_its_build(tmp_path, monkeypatch):
    built = [kernels.KernelKey("decode", "cuda", 6, 2, 40, "float16", 3, sliding)
             for sliding in (False, True)]
    built += [kernels.KernelKey("merge", "cuda", 6, 6, 40, "float16"),
              kernels.KernelKey("decode", "llvm", 4, 4, 8, "float32", 1),
              kernels.KernelKey("mla", "cuda", 16, 1, 64, "float16", 4, rope_dim=32)]
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"keys": [k.filename for k in built] + ["not-a-kernel.so"], "failures": {}}))
    assert [kernels.KernelKey.from_filename(k.filename) for k in built] == built
    monkeypatch.setenv(kernels.AOT_ENV_NAME, str(tmp_path))
    monkeypatch.setattr(kernels, "has_compiler", lambda: False)
    base = tvm_backends.TvmCuda.capabilities
    claimed = tvm_backends.claims(base, "cuda")
    # an MLA key's instance counts the key's whole width, latent and rope
    assert claimed.instances == frozenset({(6, 2, 40, 3, "float16"), (16, 1, 96, 4, "float16")})
    assert claimed.features == base.features
    monkeypatch.setattr(kernels, "has_compiler", lambda: True)  # compiles the rest on demand
    assert tvm_backends.claims(base, "cuda").instances is None


def explore_build(out) -> list[Case]:
    """`build tvm --target llvm --explore 2 --seed 5` into ``out``; the cases drawn."""
    pytest.importorskip("tvm", reason="apache-tvm is not installed (the tvm extra)")
    from conformance.strategies import draw_instances
    from tests.run_cli import cli

    done = cli("build", "tvm", "--target", "llvm", "--explore", "2", "--seed", "5",
               "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    return draw_instances(tvm_backends.TvmCpu.capabilities, 2, seed=5)


def test_an_explore_build_holds_every_kernel_of_the_shapes_explore_draws(tmp_path):
    """`build tvm --explore N`: the same seed draws the same shapes, and each is built with
    what any case of it may ask (window or not, as MHA, at twice the page size, the causal
    and tree kernels of several query tokens, the merge)."""
    from conformance.strategies import draw_instances
    from tests.run_cli import cli

    drawn = explore_build(tmp_path)
    assert [c.id for c in drawn] == [c.id for c in draw_instances(
        tvm_backends.TvmCpu.capabilities, 2, seed=5)]
    built = kernels.built_keys(tmp_path)
    for case in drawn:
        for key in kernels.keys_for_case(case, "llvm", whole_instance=True):
            assert key in built, key.filename
    refused = cli("build", "tvm", "--explore", "0", "--out", tmp_path)
    assert refused.returncode == 2 and "--explore" in refused.stderr


def test_build_k_builds_the_kernels_of_the_cases_it_selects_and_no_others(tmp_path,
                                                                          monkeypatch):
    """`build tvm -k A -k B` narrows the profile as `run -k` does (ids containing both)."""
    from conformance.cli import _parser
    from conformance.commands import build as build_command
    from conformance.selection import select_cases
    from conformance.session import RunSettings

    built = {}

    def record(keys, out, fatbins):
        built["keys"] = set(keys)
        return {"compile_seconds": 0.0, "nvcc_seconds": 0.0, "failures": {}}

    monkeypatch.setattr(build_command, "build", record)
    args = _parser().parse_args(["build", "tvm", "--target", "llvm", "--profile", "ci",
                                 "-k", "basic/", "-k", "f16/", "--out", str(tmp_path)])
    assert build_command.handle_build(args) == 0
    claims = tvm_backends.TvmCpu.capabilities
    cases = select_cases(RunSettings(profile="ci").spec(), "ci")
    wanted = [c for c in cases if "basic/" in c.id and "f16/" in c.id
              and claims.unsupported_reason(c) is None]
    every = {k for c in cases if claims.unsupported_reason(c) is None
             for k in kernels.keys_for_case(c, "llvm")}
    assert wanted and built["keys"] == {k for c in wanted
                                        for k in kernels.keys_for_case(c, "llvm")}
    assert built["keys"] < every
    both = _parser().parse_args(["build", "tvm", "--explore", "2", "-k", "basic/", "--out",
                                 str(tmp_path)])
    assert build_command.handle_build(both) == 2


def test_runtime_only_tvm_refuses_a_shape_its_build_lacks_and_takes_one_it_has(
        tmp_path, monkeypatch):
    from dataclasses import replace

    drawn = explore_build(tmp_path)
    monkeypatch.setenv(kernels.AOT_ENV_NAME, str(tmp_path))
    monkeypatch.setattr(kernels, "has_compiler", lambda: False)
    backend = tvm_backends.TvmCpu()
    assert backend.unsupported_reason(drawn[0]) is None
    other = replace(drawn[0], head_dim=drawn[0].head_dim + 8)
    assert "not in the ahead-of-time build" in backend.unsupported_reason(other)
    # a kernel TVM failed to build is refused in TVM's own words, from the build's manifest
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    failed = kernels.KernelKey.for_case(other, "llvm").filename
    manifest["failures"][failed] = "InternalError: variable cse_v16 has been used before"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    backend = tvm_backends.TvmCpu()  # a backend reads its build's manifest when it starts
    assert backend.unsupported_reason(other) == (f"TVM could not build {failed}: InternalError: "
                                                 f"variable cse_v16 has been used before")
