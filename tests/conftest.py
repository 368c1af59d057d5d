"""The suite's own test runs leave nothing in the user's working tree."""

from __future__ import annotations

import tempfile

import pytest

DEFAULT_BENCHMARK_STORAGE = "file://./.benchmarks"


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark makes its storage folder
def pytest_configure(config: pytest.Config) -> None:
    """pytest-benchmark creates ``.benchmarks/`` in the current folder at every session;
    the suite's own tests save nothing there (``tests/test_bench_gate.py`` names its own
    storage), so unless a run asks to save or compare, the folder goes to a temporary one."""
    option = config.option
    if getattr(option, "benchmark_storage", None) != DEFAULT_BENCHMARK_STORAGE:
        return
    if getattr(option, "benchmark_save", None) or getattr(option, "benchmark_autosave", None) \
            or getattr(option, "benchmark_compare", None):
        return
    option.benchmark_storage = "file://" + tempfile.mkdtemp(prefix="pytest-benchmark-")
