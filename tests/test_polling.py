"""Waiting on the channel: a side polls while a CPU is spare, else sleeps at once; a
parallel run turns polling off where a job's two processes cannot each have a CPU."""

from __future__ import annotations

import socket
import threading
import time

from conformance import parallel, polling


def test_a_waiting_side_polls_only_with_a_cpu_to_spare(monkeypatch):
    """A frame that comes during the poll is seen without sleeping; with no CPU to spare, or
    polling turned off, the caller is sent to sleep at once."""
    ours, theirs = socket.socketpair()
    try:
        monkeypatch.setattr(polling, "spare_cpu", lambda: True)
        later = threading.Timer(0.002, lambda: theirs.send(b"x"))
        later.start()
        assert polling.poll_readable(ours, 5.0)
        later.join()
        ours.recv(1)
        started = time.monotonic()
        assert not polling.poll_readable(ours, 0.01)  # nothing comes: it gives up in time
        assert time.monotonic() - started < 1.0
        theirs.send(b"x")
        monkeypatch.setattr(polling, "spare_cpu", lambda: False)
        assert not polling.poll_readable(ours, 5.0)  # readable, but not polled: the caller sleeps
        monkeypatch.setattr(polling, "spare_cpu", lambda: True)
        monkeypatch.setenv(polling.POLL_VARIABLE, "0")
        assert polling.poll_seconds() == 0
        assert not polling.poll_readable(ours, polling.poll_seconds())
    finally:
        ours.close()
        theirs.close()


def test_a_parallel_run_polls_only_when_each_job_has_two_cpus(monkeypatch):
    monkeypatch.setattr(parallel, "CPUS", 4)
    assert parallel.polling_environment(2) == {}
    assert parallel.polling_environment(3) == {parallel.POLL_VARIABLE: "0"}
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")  # pytest -n: the same rule
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    assert parallel.xdist_worker_environment().get(parallel.POLL_VARIABLE) == "0"
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert parallel.POLL_VARIABLE not in parallel.xdist_worker_environment()
