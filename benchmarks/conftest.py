"""Options of the benchmark suite (pytest-benchmark): which backend, which shapes."""

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("decode benchmarks")
    group.addoption("--bench-backend", default="numpy",
                    help="backend to time (registered name or module:Class); default numpy")
    group.addoption("--bench-shapes", default="cpu", help="shape set of bench.toml: cpu or gpu")
    group.addoption("--harness-profile", default="smoke",
                    help="profile the harness benchmark runs (test_harness_bench.py); "
                         "default smoke, ci for issue 22's figures")
