"""The backend under test is untrusted: whatever it does costs its own case, never the run.

Each hostile backend (tests/hostile.py) misbehaves on the two smoke cases that have attention
sinks and computes correctly on the third sinks-family case. Every run must end with the
right exit status, the misbehaving cases as ``error`` (or ``failed``), the other case
passed, and every report written and well formed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from xml.etree import ElementTree as ET

import pytest

from conformance.spec import DEFAULT_MAX_CASE_MIB
from tests.run_cli import ROOT, cli

SINKS = ("--profile", "smoke", "-k", "sinks/")
BAD = "window8+sink"  # the two cases the hostile backends misbehave on
GOOD = "window8-normal"


def run_with_reports(tmp_path, backend, *extra, env=None):
    paths = {name: tmp_path / f"report.{name}" for name in ("json", "xml", "md")}
    result = cli("run", "--backend", f"tests.hostile:{backend}", *SINKS,
                 "--report-json", paths["json"], "--junit-xml", paths["xml"],
                 "--summary-md", paths["md"], *extra, env=env)
    report = json.loads(paths["json"].read_text())
    ET.parse(paths["xml"])  # well formed
    assert paths["md"].read_text().startswith("## Conformance")
    return result, report


def statuses(report, case_part):
    return {r["status"] for r in report["results"] if case_part in r["case"]}


def messages(report, case_part):
    return {r["message"] for r in report["results"] if case_part in r["case"]}


@pytest.mark.parametrize("backend,what", [
    ("Segfaults", "killed by SIGSEGV"),
    ("Aborts", "killed by SIGABRT"),
    ("HardExit", "exited with status 0"),
    ("ExitsZero", "SystemExit: 0"),
    ("ExitsThree", "SystemExit: 3"),
    ("RaisesKeyboardInterrupt", "KeyboardInterrupt"),
])
def test_a_dying_or_exiting_backend_costs_only_its_cases(tmp_path, backend, what):
    result, report = run_with_reports(tmp_path, backend)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert statuses(report, BAD) == {"error"}
    assert statuses(report, GOOD) == {"passed"}
    assert all(what in m for m in messages(report, BAD) if not m.startswith("not run"))
    assert not report["ok"] and not report["interrupted"]


def test_a_native_crash_names_the_frame_that_crashed(tmp_path):
    _, report = run_with_reports(tmp_path, "Segfaults")
    first = next(r for r in report["results"] if BAD in r["case"])
    assert "Fatal Python error: Segmentation fault" in first["message"]
    assert "hostile.py" in first["message"] and "misbehave" in first["message"]


@pytest.mark.parametrize("backend", ["HangsInPython", "HangsInNativeCode"])
def test_a_hanging_backend_is_killed_at_the_case_timeout(tmp_path, backend):
    started = time.monotonic()
    # a timeout a correct case stays well inside on a loaded 2-core machine
    result, report = run_with_reports(tmp_path, backend, "--case-timeout", "8")
    assert result.returncode == 1
    assert time.monotonic() - started < 90
    assert statuses(report, BAD) == {"error"}
    assert statuses(report, GOOD) == {"passed"}
    assert any("timed out after 8 s" in m for m in messages(report, BAD))


def test_a_parallel_run_isolates_the_same_faults(tmp_path):
    result, report = run_with_reports(tmp_path, "Segfaults", "-j", "2")
    assert result.returncode == 1
    assert statuses(report, BAD) == {"error"} and statuses(report, GOOD) == {"passed"}
    assert any("SIGSEGV" in m for m in messages(report, BAD))


def test_the_oracle_never_sees_what_the_backend_did_to_its_inputs(tmp_path):
    # The backend empties every context before computing: zero output, -inf LSE. Judged
    # against arrays it was handed, that would pass oracle and merge; judged against the
    # harness's own copies it fails oracle, even with purity not selected.
    result = cli("run", "--backend", "tests.hostile:MutatesBeforeComputing", *SINKS,
                 "--check", "oracle", "--check", "merge", "--report-json", tmp_path / "r.json")
    assert result.returncode == 1
    report = json.loads((tmp_path / "r.json").read_text())
    oracle = {r["status"] for r in report["results"] if BAD in r["case"]
              and r["check"].startswith("oracle/")}
    assert oracle == {"failed"}
    assert statuses(report, GOOD) == {"passed"}


def test_backend_output_is_captured_per_case_and_kept_out_of_the_terminal(tmp_path):
    result, report = run_with_reports(tmp_path, "Floods")
    assert result.returncode == 0, result.stdout[-2000:]
    assert "flood flood" not in result.stdout + result.stderr
    captured = {c["case"]: c for c in report["captured_output"]}
    assert {case for case in captured} == {r["case"] for r in report["results"]
                                           if BAD in r["case"]}
    for entry in captured.values():
        assert entry["bytes"] > 8_000_000  # counted in full ...
        assert len(entry["tail"]) <= 4096  # ... kept as a tail
        assert "LAST LINE OF THE FLOOD" in entry["tail"]


def test_a_backend_unavailable_in_its_worker_errs_and_fails_the_run(tmp_path):
    result, report = run_with_reports(tmp_path, "UnavailableInWorkers")
    assert result.returncode == 1
    assert {r["status"] for r in report["results"]} == {"error"}
    assert all("unavailable in the worker process: no device" in r["message"]
               for r in report["results"])
    parallel = cli("run", "--backend", "tests.hostile:UnavailableInWorkers", *SINKS, "-j", "2")
    assert parallel.returncode == 1 and "ok" not in parallel.stdout.split("verdict")[1][:200]


@pytest.mark.parametrize("backend,what", [
    ("MergeReturnsNone", "returned NoneType, not an AttentionState"),
    ("MergeReturnsScalars", "whose out is float32, not a NumPy array"),
    ("MergeReturnsWrongDtypes", "output dtype float64, want float32; lse dtype float16"),
])
def test_a_merge_outside_the_contract_fails_the_merge_checks(tmp_path, backend, what):
    result, report = run_with_reports(tmp_path, backend, "--check", "merge")
    assert result.returncode == 1
    merge = [r for r in report["results"] if r["check"].startswith("merge/")]
    assert merge and {r["status"] for r in merge} == {"failed"}
    assert all(what in r["message"] and "merge" in r["message"] for r in merge)


@pytest.mark.parametrize("backend,status,what", [
    ("MergeRaisesOnEmpties", "error", "division by zero"),
    ("MergeLosesDeviceOnEmpties", "error", "the worker was replaced"),
    ("MergeWritesEmptyInputs", "failed", "modified its inputs"),
])
def test_a_faulty_merge_costs_only_the_sub_checks_that_asked_it(tmp_path, backend, status,
                                                               what):
    # The merge check sends a round of merges to the worker in one request. These backends
    # misbehave on merge(empty, empty) only: merge/both-empty asks it (merge/associative
    # may, when two segments are empty); every other sub-check, whose merges went in the
    # same request, before it or after it, must pass.
    result, report = run_with_reports(tmp_path, backend, "--check", "merge")
    assert result.returncode == 1
    merge = [r for r in report["results"] if r["check"].startswith("merge/")]
    asked = [r for r in merge if r["check"] == "merge/both-empty"]
    assert asked and {r["status"] for r in asked} == {status}
    assert all(what in r["message"] for r in asked)
    others = [r for r in merge if r["check"] not in ("merge/both-empty", "merge/associative")]
    assert len({r["check"] for r in others}) == 6
    assert {r["status"] for r in others} == {"passed"}


def test_a_call_sent_ahead_to_a_worker_that_lost_its_device_is_asked_again(tmp_path):
    # Trial.decodes sends invariance/split-count-8 while split-count-3 (which loses the
    # device) is still out; the old worker fails it, but its verdict comes from a fresh one
    result, report = run_with_reports(tmp_path, "LosesDeviceOnThreeSplits", "--check",
                                      "invariance")
    assert result.returncode == 1
    lost = [r for r in report["results"] if r["check"] == "invariance/split-count-3"]
    assert lost and all(r["status"] == "error" and "the worker was replaced" in r["message"]
                        for r in lost)
    others = [r for r in report["results"] if r["check"] != "invariance/split-count-3"]
    assert {r["check"] for r in others} >= {"invariance/split-count-8", "invariance/page-size"}
    assert {r["status"] for r in others} == {"passed"}


@pytest.mark.parametrize("backend,what", [
    ("EmptyAvailability", "availability() returned ''"),
    ("FalseAvailability", "availability() returned False"),
])
def test_a_falsy_availability_is_an_unavailability_with_a_reason(backend, what):
    result = cli("run", "--backend", f"tests.hostile:{backend}", *SINKS)
    assert result.returncode == 2 and what in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("backend,what", [
    ("UnnamedSubclass", "does not set its own `name` (it would be reported as 'numpy'"),
    ("PathLikeName", "name '../..' must be letters, digits"),
])
def test_a_backend_cannot_take_another_name_or_a_path(backend, what):
    result = cli("run", "--backend", f"tests.hostile:{backend}", *SINKS)
    assert result.returncode == 2 and what in result.stderr, result.stderr
    update = cli("expectations", "update", "--backend", f"tests.hostile:{backend}")
    assert update.returncode == 2 and what in update.stderr


def test_two_backends_with_one_name_are_refused(tmp_path):
    source = tmp_path / "twin.py"
    source.write_text("from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "class Twin(NumpySplitK):\n    name = 'twin'\n\n"
                      "class Other(NumpySplitK):\n    name = 'twin'\n")
    result = cli("run", "--backend", f"{source}:Twin", "--backend", f"{source}:Other", *SINKS)
    assert result.returncode == 2 and "both named 'twin'" in result.stderr


def test_a_typo_in_capabilities_is_refused_when_the_backend_loads(tmp_path):
    source = tmp_path / "typo.py"
    source.write_text("from conformance.backends.base import Capabilities\n"
                      "from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "class Typo(NumpySplitK):\n    name = 'typo'\n"
                      "    capabilities = Capabilities(dtypes={'fp32'})\n")
    result = cli("run", "--backend", f"{source}:Typo", *SINKS)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Capabilities.dtypes: unknown ['fp32']" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_backend_that_claims_no_case_fails_unless_allowed(tmp_path):
    source = tmp_path / "narrow.py"
    source.write_text("from conformance.backends.base import Capabilities\n"
                      "from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "class Narrow(NumpySplitK):\n    name = 'narrow'\n"
                      "    capabilities = Capabilities(dtypes={'bfloat16'}, features={'lse'})\n")
    result = cli("run", "--backend", f"{source}:Narrow", *SINKS, "--report-json",
                 tmp_path / "r.json")
    assert result.returncode == 1
    assert "narrow claims no check of this run" in result.stdout
    assert "dtypes ['bfloat16']" in result.stdout
    assert not json.loads((tmp_path / "r.json").read_text())["ok"]
    assert cli("run", "--backend", f"{source}:Narrow", *SINKS, "--allow-empty").returncode == 0


def test_the_probe_worker_ends_beside_the_run_and_is_killed_if_it_lingers(tmp_path):
    """Reading the declaration does not wait for the probe's worker to exit; one whose exit
    hangs is still killed after the grace period, so no worker outlives the harness."""
    from conformance.worker_process import Probe

    source = tmp_path / "lingers.py"
    source.write_text("import atexit, time\n"
                      "from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "atexit.register(time.sleep, 600)\n\n"
                      "class Lingers(NumpySplitK):\n    name = 'lingers'\n")
    probe = Probe(f"{source}:Lingers", 120)
    assert probe.result().name == "lingers"
    closing = [t for t in threading.enumerate() if t.name == f"closing probe {source}:Lingers"]
    assert len(closing) == 1 and probe.worker.process.poll() is None  # not waited for
    closing[0].join(timeout=60)
    assert not closing[0].is_alive()
    assert probe.worker.process.returncode == -signal.SIGKILL


def test_a_backend_file_that_fails_to_import_is_one_line_and_exit_2(tmp_path):
    source = tmp_path / "broken.py"
    source.write_text("import numpy\nraise RuntimeError('no CUDA here')\n")
    result = cli("run", "--backend", f"{source}:Broken", *SINKS)
    assert result.returncode == 2
    assert "failed to import: RuntimeError: no CUDA here" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_interrupted_run_is_not_ok_anywhere_and_a_second_signal_loses_nothing(tmp_path):
    paths = {name: tmp_path / f"report.{name}" for name in ("json", "xml", "md")}
    hanging = tmp_path / "hanging"
    process = subprocess.Popen(
        [sys.executable, "-m", "conformance", "run", "--backend", "tests.hostile:HangsInPython",
         *SINKS, "--case-timeout", "0", "--report-json", paths["json"], "--junit-xml",
         paths["xml"], "--summary-md", paths["md"]],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "HOSTILE_MARK": str(hanging)})
    # the first case passes; the second hangs for good: wait until it hangs, not a guess
    deadline = time.monotonic() + 120
    while not hanging.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hanging.exists()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 130, stdout
    report = json.loads(paths["json"].read_text())
    assert report["interrupted"] and not report["ok"]
    assert "INTERRUPTED" in stdout
    junit = ET.parse(paths["xml"]).getroot()
    assert any(e.tag == "error" and "interrupted" in e.get("message") for e in junit.iter())
    assert "**FAIL**" in paths["md"].read_text()


def test_reports_stay_well_formed_whatever_the_backend_prints(tmp_path):
    source = tmp_path / "noisy.py"
    source.write_text("from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "class Noisy(NumpySplitK):\n    name = 'noisy'\n\n"
                      "    def decode(self, problem, out, lse, *, num_splits=None):\n"
                      "        raise RuntimeError('\\x1b[31merror:\\x1b[0m nvcc said \\x00 | `x` "
                      "*y* <b>')\n")
    xml, md = tmp_path / "r.xml", tmp_path / "r.md"
    result = cli("run", "--backend", f"{source}:Noisy", *SINKS, "--junit-xml", xml,
                 "--summary-md", md)
    assert result.returncode == 1
    text = " ".join(e.get("message", "") + (e.text or "") for e in ET.parse(xml).iter())
    assert "\x1b" not in text and "\x00" not in text and "error: nvcc said" in text
    summary = md.read_text()
    assert "\\| \\`x\\` \\*y\\* \\<b\\>" in summary and "\x1b" not in summary


@pytest.mark.parametrize("args,what", [
    (("--report-json", "no/such/dir/r.json"), "--report-json 'no/such/dir/r.json': the "
                                              "directory 'no/such/dir' does not exist"),
    (("--junit-xml", "."), "--junit-xml '.': is a directory"),
    (("--spec", "no-such-spec.toml"), "spec 'no-such-spec.toml': no such file"),
    (("--compare-accuracy", "README.md"), "accuracy baseline 'README.md': not valid JSON"),
    (("--compare-accuracy", "pyproject.toml"), "not valid JSON"),
    (("--expectations", "no-such-dir"), "--expectations 'no-such-dir': no such directory"),
    (("-j", "-3"), "must be 0 (one per core) or more, got -3"),
    (("--case-timeout", "nan"), "must be a number of seconds >= 0"),
])
def test_bad_options_are_refused_up_front_with_exit_2(args, what):
    started = time.monotonic()
    result = cli("run", "--backend", "numpy", "--profile", "ci", *args)
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr
    assert what in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 20  # refused before the run, not after it


@pytest.mark.parametrize("entry,what", [
    ("sm_scale = nan", "field 'sm_scale' must be a finite positive number, got nan"),
    ("sm_scale = inf", "got inf"),
    ("context_lens = [1000000000]", f"over the cap of {DEFAULT_MAX_CASE_MIB:g} MiB"),
])
def test_bad_spec_values_are_refused_before_any_backend_runs(tmp_path, entry, what):
    spec = tmp_path / "spec.toml"
    if not entry.startswith("context_lens"):
        entry += "\ncontext_lens = [3]"
    spec.write_text(f'schema = 1\n[profiles.p]\ndoc = ""\n[[family]]\nname = "f"\n'
                    f'profiles = ["p"]\n[family.set]\nnum_qo_heads = 4\nnum_kv_heads = 2\n'
                    f'head_dim = 8\npage_size = 4\n{entry}\n')
    result = cli("run", "--backend", "numpy", "--spec", spec, "--profile", "p")
    assert result.returncode == 2 and what in result.stderr, result.stderr


def test_an_unknown_spec_schema_and_a_binary_spec_are_refused(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text('schema = 99\n[profiles.p]\ndoc = ""\n')
    result = cli("list", "--spec", spec, "--profile", "p")
    assert result.returncode == 2 and "field 'schema' is 99" in result.stderr
    spec.write_bytes(b"\x00\x01binary")
    result = cli("list", "--spec", spec, "--profile", "p")
    assert result.returncode == 2 and "is a binary file" in result.stderr


def test_html_refuses_a_file_that_is_not_a_report(tmp_path):
    result = cli("html", "--report-json", "pyproject.toml", "--out", tmp_path / "r.html")
    assert result.returncode == 2 and "not valid JSON" in result.stderr
    (tmp_path / "x.json").write_text("[1, 2]")
    result = cli("html", "--report-json", tmp_path / "x.json", "--out", tmp_path / "r.html")
    assert result.returncode == 2 and "not a report file of this suite" in result.stderr
    assert not (tmp_path / "r.html").exists()


def test_in_process_mode_is_the_debugging_switch(tmp_path):
    result = cli("run", "--backend", "tests.hostile:MutatesBeforeComputing", *SINKS,
                 "--in-process", "--report-json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    # the backend still gets copies: the oracle is as pristine as when isolated
    assert result.returncode == 1 and statuses(report, GOOD) == {"passed"}
    assert {r["status"] for r in report["results"] if BAD in r["case"]
            and r["check"] == "oracle/output"} == {"failed"}
    # and it did run here: no worker process, so nothing was captured from one
    assert report["captured_output"] == [] and "worker" not in " ".join(messages(report, BAD))


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_known_native_crash_can_be_listed_in_a_manifest(tmp_path, jobs):
    (tmp_path / "hostile-segfault.toml").write_text(
        '[[expect]]\ncase = "sinks/*window8+sink*"\ncheck = "*"\n'
        'reason = "segfaults when sinks are set (upstream issue 1)"\n')
    result = cli("run", "--backend", "tests.hostile:Segfaults", *SINKS, "-j", jobs,
                 f"--expectations={tmp_path}", "--report-json", tmp_path / "r.json")
    assert result.returncode == 0, result.stdout[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert statuses(report, BAD) == {"known-failure"}
    assert statuses(report, GOOD) == {"passed"}
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    (narrow / "hostile-segfault.toml").write_text(
        '[[expect]]\ncase = "sinks/*window8+sink*"\ncheck = "oracle/output"\n'
        'reason = "the crash shows first in oracle/output"\n')
    result = cli("run", "--backend", "tests.hostile:Segfaults", *SINKS, "-j", jobs,
                 f"--expectations={narrow}", "--report-json", tmp_path / "n.json")
    report = json.loads((tmp_path / "n.json").read_text())
    listed = {r["status"] for r in report["results"] if BAD in r["case"]
              and r["check"] == "oracle/output"}
    assert listed == {"known-failure"} and result.returncode == 1


# --- faults a kernel under development makes on a GPU, and what they may cost -----------------


def verdicts(report):
    return {(r["case"], r["check"]): r["status"] for r in report["results"]}


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_lost_device_costs_what_a_python_error_costs(tmp_path, jobs):
    # after the fault every call in that process fails, as CUDA's sticky errors do; with the
    # worker replaced, the verdicts are those of the same bug raised as a Python error
    plain = tmp_path / "plain"
    sticky = tmp_path / "sticky"
    plain.mkdir(), sticky.mkdir()
    _, python_error = run_with_reports(plain, "RaisesOnTrigger", "-j", jobs)
    result, lost = run_with_reports(sticky, "StickyDeviceFault", "-j", jobs)
    assert result.returncode == 1
    assert verdicts(lost) == verdicts(python_error)
    assert statuses(lost, GOOD) == {"passed"} and statuses(lost, BAD) >= {"error"}
    restarts = lost["worker_restarts"]
    assert {entry["case"] for entry in restarts} == {r["case"] for r in lost["results"]
                                                    if BAD in r["case"]}
    assert all("illegal memory access" in reason for e in restarts for reason in e["reasons"])
    assert "worker replaced" in result.stdout
    assert any("the worker was replaced" in m for m in messages(lost, BAD))


def test_a_case_out_of_device_memory_beside_others_runs_again_alone(tmp_path):
    # with -j 2 the trigger cases run out of memory while the other worker lives; its
    # verdict must be the case's own: run again once the pool has ended, they pass
    workers = tmp_path / "workers"
    workers.mkdir()
    env = {**os.environ, "HOSTILE_WORKERS": str(workers)}
    result, report = run_with_reports(tmp_path, "OutOfMemoryBesideOthers", "-j", "2", env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert statuses(report, BAD) == statuses(report, GOOD) == {"passed"}
    again = {e["case"] for e in report["worker_restarts"]
             if any("run again alone" in reason for reason in e["reasons"])}
    assert again and all(BAD in case for case in again)
    assert "run again alone" in result.stdout
    # out of memory alone too (this test's process counts as a worker that never ends): the
    # case's own error, kept after its second run; a serial run has no neighbours to blame
    for jobs, rerun in (("2", True), ("1", False)):
        (tmp_path / jobs / "workers").mkdir(parents=True)
        (tmp_path / jobs / "workers" / str(os.getpid())).touch()
        env["HOSTILE_WORKERS"] = str(tmp_path / jobs / "workers")
        result, report = run_with_reports(tmp_path / jobs, "OutOfMemoryBesideOthers",
                                          "-j", jobs, env=env)
        assert result.returncode == 1 and statuses(report, BAD) == {"error"}
        assert all("CUDA out of memory" in m for m in messages(report, BAD)
                   if not m.startswith("not run"))
        assert bool(report["worker_restarts"]) is rerun


def test_a_hang_costs_one_timeout_per_case_under_pytest(tmp_path):
    xml = tmp_path / "r.xml"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                    "conformance/test_conformance.py", "--conformance-backend",
                    "tests.hostile:HangsInPython", "--conformance-profile", "smoke", "-k", "sinks",
                    "--conformance-case-timeout", "8",
                    f"--junitxml={xml}"], cwd=ROOT, capture_output=True, timeout=300)
    elapsed = time.monotonic() - started
    texts = [e.get("message", "") for e in ET.parse(xml).iter() if e.tag == "failure"]
    assert len(texts) == 2 * 6 and all("timed out after 8 s" in t for t in texts), texts
    # the families after the first do not call the backend again
    assert sum("not run: the case timed out after 8 s in decode" in t for t in texts) >= 2
    assert elapsed < 2 * 8 * 3  # one timeout per case; six per case before


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_helpers_a_backend_forks_end_with_its_worker(tmp_path):
    pids = tmp_path / "pids"
    result, _ = run_with_reports(tmp_path, "ForksHelpers",
                                      env={**os.environ, "HOSTILE_PIDS": str(pids)})
    assert result.returncode == 0, result.stdout[-2000:]
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) >= 2 * 3  # each decode of the two trigger cases starts three
    deadline = time.monotonic() + 10
    while not all(_dead(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in started if not _dead(p)] == []


def test_a_crash_while_a_forked_child_holds_the_pipe_is_a_crash_not_a_timeout(tmp_path):
    started = time.monotonic()
    result, report = run_with_reports(tmp_path, "SegfaultsWithForkedChild", "--case-timeout",
                                      "60")
    assert result.returncode == 1 and statuses(report, GOOD) == {"passed"}
    assert any("killed by SIGSEGV" in m for m in messages(report, BAD))
    assert not any("timed out" in m for m in messages(report, BAD))
    assert time.monotonic() - started < 60


def test_a_reply_that_stops_halfway_is_bounded_by_the_case_timeout(tmp_path):
    started = time.monotonic()
    result, report = run_with_reports(tmp_path, "StallsMidReply", "--case-timeout", "8")
    assert result.returncode == 1 and statuses(report, GOOD) == {"passed"}
    assert statuses(report, BAD) == {"error"}
    assert any("timed out after 8 s" in m for m in messages(report, BAD))
    assert time.monotonic() - started < 90


def test_a_forged_reply_is_never_executed_and_never_passes(tmp_path):
    mark = tmp_path / "executed"
    result, report = run_with_reports(tmp_path, "ForgesReply",
                                      env={**os.environ, "HOSTILE_MARK": str(mark)})
    assert not mark.exists()  # the pickle it sent was never loaded
    assert result.returncode == 1 and statuses(report, GOOD) == {"passed"}
    oracle = {r["status"] for r in report["results"] if BAD in r["case"]
              and r["check"].startswith("oracle/")}
    assert oracle and "passed" not in oracle


def test_purity_is_what_the_harness_sees_not_what_it_is_told(tmp_path):
    result, report = run_with_reports(tmp_path, "ForgesPurity", "--check", "purity",
                                      "--check", "oracle")
    assert result.returncode == 1 and statuses(report, GOOD) == {"passed"}
    checks = {r["check"]: r["status"] for r in report["results"] if BAD in r["case"]}
    assert checks["purity"] == "failed", checks
    assert checks["oracle/output"] == "passed"


@pytest.mark.parametrize("body,timeout,what", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "60", "killed by SIGSEGV"),
    ("import time\ntime.sleep(1000)\n", "8", "timed out after 8 s"),
])
def test_a_backend_file_that_crashes_or_hangs_on_import_costs_only_itself(tmp_path, body,
                                                                          timeout, what):
    source = tmp_path / "broken.py"
    source.write_text(body)
    started = time.monotonic()
    result = cli("run", "--backend", "numpy", "--backend", f"{source}:Broken", *SINKS,
                 "--case-timeout", timeout)
    assert time.monotonic() - started < 60
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr
    assert "'Broken' is unavailable here" in result.stderr and what in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("backend,what", [
    ("ExitsZero", "SystemExit: 0"),
    ("RaisesKeyboardInterrupt", "KeyboardInterrupt"),
])
def test_in_process_a_backend_that_exits_costs_only_its_cases(tmp_path, backend, what):
    result, report = run_with_reports(tmp_path, backend, "--in-process")
    assert result.returncode == 1 and not report["interrupted"]
    assert statuses(report, BAD) == {"error"} and statuses(report, GOOD) == {"passed"}
    assert any(what in m for m in messages(report, BAD))


@pytest.mark.parametrize("declaration,what", [
    ('capabilities = "fast"', "capabilities is 'fast', not a Capabilities"),
    ("capabilities = Capabilities(split_counts=(0, -1))",
     "Capabilities.split_counts must be positive integers"),
    ('capabilities = Capabilities(devices=("tpu",))', "Capabilities.devices must name some"),
    ("conventions = Conventions(lse_base=1)", "Conventions.lse_base must be a finite number"),
    (f'name = "{"x" * 300}"', "at most 64 characters"),
])
def test_a_bad_declaration_is_refused_when_the_backend_loads(tmp_path, declaration, what):
    source = tmp_path / "declares.py"
    source.write_text("from conformance.backends.base import Capabilities, Conventions\n"
                      "from conformance.backends.numpy_splitk import NumpySplitK\n\n"
                      "class Declares(NumpySplitK):\n    name = 'declares'\n"
                      f"    {declaration}\n")
    result = cli("run", "--backend", f"{source}:Declares", *SINKS)
    assert result.returncode == 2 and what in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


class _FakeTensor:
    def __init__(self, value):
        self.value = value

    def __add__(self, other):
        return _FakeTensor(self.value + other)

    def sum(self):
        return self

    def cpu(self):
        return self

    def __float__(self):
        return float(self.value * 4)


class _FakeTorch:
    """Just what the device health probe touches; ``failures`` calls fail, then it works."""

    def __init__(self, failures):
        outer = self
        self.failures = failures

        class cuda:  # noqa: N801 - torch's own name
            @staticmethod
            def is_initialized():
                return True

            @staticmethod
            def synchronize():
                if outer.failures:
                    outer.failures -= 1
                    raise RuntimeError("CUDA error: invalid argument")
        self.cuda = cuda

    @staticmethod
    def ones(count, device):
        return _FakeTensor(1)


@pytest.mark.parametrize("failures,lost", [(0, False), (1, False), (2, True), (99, True)])
def test_a_pending_launch_error_is_not_a_lost_device(monkeypatch, failures, lost):
    # a non-sticky launch error (invalid argument) waits for the next call that asks: the
    # probe's first try may meet the backend's own error; a device is lost only when the
    # second fails too
    from conformance import worker

    monkeypatch.setitem(sys.modules, "torch", _FakeTorch(failures))
    health = worker.device_health()
    assert (health is not None) == lost
    if lost:
        assert "invalid argument" in health
