"""Shards: a deterministic, cost-balanced share per CI job, merged into the report one run
would have written."""

from __future__ import annotations

import json
import re

import pytest

from conformance.shards import parse_shard, shard_cases
from conformance.spec import default_spec
from tests.run_cli import cli

VOLATILE = {"created", "command", "shard", "durations"}  # durations: timings, compared apart


def test_shards_partition_the_cases_deterministically_and_balance_their_cost():
    cases = default_spec().cases("full")
    shares = [shard_cases(cases, (k, 4)) for k in range(1, 5)]
    ids = [c.id for share in shares for c in share]
    assert sorted(ids) == sorted(c.id for c in cases) and len(set(ids)) == len(ids)
    assert shares == [shard_cases(cases, (k, 4)) for k in range(1, 5)]  # the same every time
    costs = [sum(c.problem_bytes for c in share) for share in shares]
    # balanced by cost, not by count: apart by at most the costliest case (the large-offset
    # case alone outweighs a quarter of the others)
    assert max(costs) - min(costs) <= max(c.problem_bytes for c in cases), costs
    ci = default_spec().cases("ci")  # no case dominates there: the shares are close
    ci_costs = [sum(c.problem_bytes for c in shard_cases(ci, (k, 4))) for k in range(1, 5)]
    assert max(ci_costs) <= 1.2 * min(ci_costs), ci_costs
    for share in shares:  # each share keeps spec order
        order = [cases.index(c) for c in share]
        assert order == sorted(order)


@pytest.mark.parametrize("text", ["0/3", "4/3", "3", "a/b", "1/0"])
def test_a_bad_shard_is_refused(text):
    with pytest.raises(ValueError, match="want K/N"):
        parse_shard(text)
    result = cli("run", "--backend", "numpy", "--profile", "smoke", "--shard", text)
    assert result.returncode == 2 and "--shard" in result.stderr


def test_merged_shards_report_exactly_what_one_run_reports(tmp_path):
    manifests = tmp_path / "expectations"
    manifests.mkdir()
    (manifests / "bug-window-off-by-one.toml").write_text(
        '[[expect]]\ncase = "sinks/*"\ncheck = "oracle"\nreason = "known"\n'
        '[[expect]]\ncase = "no-such-family/*"\ncheck = "oracle"\nreason = "stale"\n')
    args = ("run", "--backend", "numpy", "--backend", "tests.planted:WindowOffByOne",
            "--profile", "smoke", f"--expectations={manifests}")
    one = cli(*args, "--report-json", tmp_path / "one.json", "--junit-xml",
              tmp_path / "one.xml", "--summary-md", tmp_path / "one.md")
    shards = []
    for k in (1, 2, 3):
        shards.append(tmp_path / f"shard{k}.json")
        cli(*args, "--shard", f"{k}/3", "--report-json", shards[-1])
    merged = cli("merge", *shards, "--report-json", tmp_path / "merged.json", "--junit-xml",
                 tmp_path / "merged.xml", "--summary-md", tmp_path / "merged.md")
    assert one.returncode == merged.returncode == 1, merged.stdout[-2000:] + merged.stderr
    single = json.loads((tmp_path / "one.json").read_text())
    joined = json.loads((tmp_path / "merged.json").read_text())
    assert {k: v for k, v in single.items() if k not in VOLATILE} == \
        {k: v for k, v in joined.items() if k not in VOLATILE}
    assert single["stale_expectations"] and not single["ok"]  # the verdict is the union's
    timed = [{(d["backend"], d["case"]) for d in report["durations"]} for report in (
        single, joined)]
    assert timed[0] == timed[1] == {(r["backend"], r["case"]) for r in single["results"]}
    untimed = re.compile(r' time="[0-9.]+"')  # JUnit times: this run's, not the shards'
    for suffix in ("xml", "md"):
        assert untimed.sub("", (tmp_path / f"one.{suffix}").read_text()) == \
            untimed.sub("", (tmp_path / f"merged.{suffix}").read_text())
    missing = cli("merge", shards[0], shards[2])
    assert missing.returncode == 2 and "exactly once" in missing.stderr


def test_a_merge_keeps_the_machine_and_backends_the_shards_ran_on(tmp_path):
    """Shards made on a GPU machine and merged on a laptop still say where they ran, and
    merge without loading their backends: it judges by the declarations the shards recorded
    (here the backend's module does not exist where they are merged)."""
    args = ("run", "--backend", "numpy", "--profile", "smoke")
    shards = []
    for k in (1, 2):
        shards.append(tmp_path / f"shard{k}.json")
        cli(*args, "--shard", f"{k}/2", "--report-json", shards[-1])
        report = json.loads(shards[-1].read_text())
        report["machine"] = {"platform": "the GPU machine"}
        report["backends"][0]["notes"] = ["ran there"]
        report["backends"][0]["available"] = k == 2  # one shard may have failed to load it
        report["backends"][0]["target"] = "a_module_not_installed_here:NumpyOnTheGpuBox"
        shards[-1].write_text(json.dumps(report))
    result = cli("merge", *shards, "--report-json", tmp_path / "merged.json")
    assert result.returncode == 0, result.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["machine"] == {"platform": "the GPU machine"}
    assert merged["backends"][0]["notes"] == ["ran there"]
    assert merged["backends"][0]["available"] is True
    assert merged["backends"][0]["target"] == "a_module_not_installed_here:NumpyOnTheGpuBox"
    assert merged["backends"][0]["declared"]["name"] == "numpy"
    assert {r["backend"] for r in merged["results"]} == {"numpy"} and merged["ok"]
