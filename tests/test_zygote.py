"""Workers forked from a zygote that loaded the backend once (``conformance.zygote``): the
same workers as spawned ones, to the backend inside and to the harness outside, and spawned
after all wherever forking is not safe."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conformance.worker_process import Worker
from conformance.zygote import ForkedProcess, fork_note, zygotes
from tests.run_cli import cli

SINKS = ("--profile", "smoke", "-k", "sinks/")
REPORTS = "tests.forked:Reports"


def run_marked(tmp_path, backend, *extra, fork="1"):
    mark = tmp_path / f"mark-{fork}"
    result = cli("run", "--backend", backend, *SINKS, *extra,
                 env={**os.environ, "FORKED_MARK": str(mark), "CONFORMANCE_FORK": fork})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result, [json.loads(line) for line in mark.read_text().splitlines()]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_workers_are_forked_from_the_zygote_and_look_spawned(tmp_path, jobs):
    result, forked = run_marked(tmp_path, REPORTS, "-j", jobs)
    assert "spawned, not forked" not in result.stdout
    assert all(seen["preloaded"] and "conformance.zygote" in seen["parent"] for seen in forked)
    _, spawned = run_marked(tmp_path, REPORTS, "-j", jobs, fork="0")
    assert not any(seen["preloaded"] or "conformance.zygote" in seen["parent"]
                   for seen in spawned)
    for seen in forked + spawned:
        assert seen["own_session"] and seen["threads"] == 1
        assert seen["argv"][0].endswith("worker.py") and int(seen["argv"][1]) in seen["fds"]
    # nothing of the zygote's left open: the same descriptors as a spawned worker's
    assert {len(s["fds"]) for s in forked} == {len(s["fds"]) for s in spawned}


@pytest.mark.parametrize("backend,why", [
    ("tests.forked:ThreadOnPreload", "left 2 threads"),
    ("tests.forked:RaisesOnPreload", "RuntimeError: no preloading here"),
])
def test_a_zygote_that_cannot_fork_safely_leaves_the_workers_spawned(tmp_path, backend, why):
    result, seen = run_marked(tmp_path, backend)
    assert "its workers were spawned, not forked" in result.stdout and why in result.stdout
    assert seen and not any(s["preloaded"] or "conformance.zygote" in s["parent"]
                            for s in seen)


@pytest.mark.parametrize("backend,kept,why", [
    ("tests.forked:Staged", [1, 2], None),
    ("tests.forked:StagedThreadAfter", [1], "stage 2 of its preload was not kept (loading "
                                           "the backend left 2 threads in the zygote)"),
    ("tests.forked:StagedCrashAfter", [1], "stage 2 of its preload was not kept (it ended "
                                          "its process, exit status -11)"),
])
def test_a_staged_preload_is_kept_up_to_its_last_safe_stage(tmp_path, backend, kept, why):
    result, seen = run_marked(tmp_path, backend, "-j", "2")
    # each stage ran with torch counting GPUs by NVML, and no worker inherits that switch
    assert seen and all(s["preloaded"] and "conformance.zygote" in s["parent"]
                        and s["stages"] == kept and s["threads"] == 1
                        and s["nvml_check"] is None for s in seen)
    assert "spawned, not forked" not in result.stdout
    if why:
        assert f"its workers were forked after part of its preload: {why}" in result.stdout
    else:
        assert "forked after part" not in result.stdout


def test_a_requester_whose_environment_differs_is_spawned(monkeypatch):
    with zygotes([REPORTS], env={"FORKED_EXTRA": "1"}):
        monkeypatch.setenv("FORKED_EXTRA", "2")  # a library may have read the first at import
        worker = Worker(REPORTS)
        try:
            assert not isinstance(worker.process, ForkedProcess)
            assert "differs in FORKED_EXTRA" in fork_note(REPORTS)
        finally:
            worker.end()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_a_dead_forked_worker_keeps_its_pid_until_its_owner_lets_go():
    with zygotes([REPORTS]):
        worker = Worker(REPORTS)
        assert isinstance(worker.process, ForkedProcess)
        pid = worker.process.pid
        assert os.getpgid(pid) == pid  # a session, and so a group, of its own
        os.kill(pid, signal.SIGSEGV)
        deadline = time.monotonic() + 10
        while not worker.exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.exited() and os.path.exists(f"/proc/{pid}")  # not reaped: the group
        assert "killed by SIGSEGV" in worker.death("a test")        # id is still its
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(f"/proc/{pid}")  # released: reaped


def test_exit_statuses_come_back_through_the_zygote():
    with zygotes([REPORTS]):
        killed, ended = Worker(REPORTS), Worker(REPORTS)
        os.kill(killed.process.pid, signal.SIGKILL)
        assert "killed by SIGKILL" in killed.death("a test")
        ended.sock.close()  # the worker's loop ends on the closed channel: a normal exit
        assert isinstance(ended.process, ForkedProcess) and ended.exit_status(10.0) == 0


def test_a_worker_outlives_its_zygote_and_says_its_status_is_unknown():
    with zygotes([REPORTS]):
        worker = Worker(REPORTS)
        zygote = _parent(worker.process.pid)
        os.kill(zygote, signal.SIGKILL)
        time.sleep(0.2)
        assert not worker.exited()
        os.kill(worker.process.pid, signal.SIGKILL)
        assert "exit status went with the zygote" in worker.death("a test")
        assert Worker(REPORTS).process is not None  # the next one is spawned


def test_a_zygote_too_slow_for_the_deadline_is_passed_by_and_its_late_fork_serves_nobody():
    slow = "tests.forked:SlowPreload"
    with zygotes([slow]):
        worker = Worker(slow, time.monotonic() + 0.5)
        try:
            assert not isinstance(worker.process, ForkedProcess)
            assert "timed out" in fork_note(slow)
            worker.send(("open", slow), None)
            assert worker.receive(time.monotonic() + 30) == ["ok", None, None]
            time.sleep(4)  # the zygote has loaded, and forked for the request it was sent
            for _ in range(8):  # all answered by the opened backend, none by a late fork
                worker.send(("call", "device", ()), None)
                assert worker.receive(time.monotonic() + 30) == ["ok", "cpu", None]
        finally:
            worker.end()


def test_gpus_counted_apart_leave_no_thread_behind(monkeypatch):
    """NVML leaves a thread in the process that asks it (an H100): a zygote asks a fork."""
    import threading

    from conformance import parallel

    def counting_with_a_thread() -> int:
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        return 3

    monkeypatch.setattr(parallel, "gpu_count", counting_with_a_thread)
    before = set(threading.enumerate())
    assert parallel.gpu_count_apart() == 3
    assert set(threading.enumerate()) - before == set()
