"""What a case's trials share in one process: its problem, values and oracle, computed once."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from conformance.spec import DEFAULT_MAX_CASE_MIB, Case


class SharedWork:
    """What a case's trials compute that depends on the case alone (its problem, its values,
    the values its codes denote) or on the case and a backend's declared precision and LSE
    convention (its oracle, budget, trivial answers), kept for the next trial of the case in
    this process: every backend of a run, and every run of a process (the planted-bug tests
    judge 40-odd backends on one profile), computes them once (docs/design.md principle 5).

    Least recently used cases go first past ``max_bytes`` of ``Case.problem_bytes``; a case
    larger than an eighth of it is never kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[Case, dict] = OrderedDict()
        self.held = 0
        self.lock = threading.Lock()

    def get(self, case: Case, key: tuple, compute: Callable[[], Any]) -> Any:
        """The value of ``key`` for ``case``, computed (outside the lock: threads may compute
        a large case's parts side by side, ``oracle.side_by_side``) unless kept."""
        if case.problem_bytes > self.max_bytes // 8:
            return compute()
        with self.lock:
            entry = self._entry(case)
            if key in entry:
                return entry[key]
        value = compute()
        with self.lock:
            return self._entry(case).setdefault(key, value)

    def _entry(self, case: Case) -> dict:
        entry = self.entries.get(case)
        if entry is None:
            entry = self.entries[case] = {}
            self.held += case.problem_bytes
            while self.held > self.max_bytes and len(self.entries) > 1:
                old, _ = self.entries.popitem(last=False)
                self.held -= old.problem_bytes
        self.entries.move_to_end(case)
        return entry


SHARED = SharedWork(max_bytes=DEFAULT_MAX_CASE_MIB * 2**20 // 6)
