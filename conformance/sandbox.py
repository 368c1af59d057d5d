"""Where the code under test runs: a worker process by default, this process when debugging.

A backend is untrusted code. ``IsolatedBackend`` hosts it in a ``Worker`` process of its own
(its stdout and stderr captured through a pipe, its calls over a socket, ``conformance.wire``);
``InProcessBackend`` calls it here, for debugging with a debugger. Both give the backend
copies of its inputs and compare them with the harness's own afterwards, and both return
plain data that the harness validates before any check reads it.

Whatever the backend does in the worker (a signal, ``exit``, ``os._exit``, ``SystemExit``,
a hang, an out-of-memory kill, a lost CUDA context) surfaces as ``BackendError`` on the call
that held it. After a death or a timeout the rest of that case fails fast and the next case
gets a fresh worker; after an error that lost the device, the next call does.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.backends.base import AttentionState, Backend, Capabilities, Conventions
from conformance.bulk import same_bytes
from conformance.declared import Declared
from conformance.interrupts import interrupted, noting_interrupts
from conformance.problem import Problem
from conformance.replies import REPLIES, check_merged, merged_arrays
from conformance.wire import PeerGoneError, Segment, WireError
from conformance.worker import (
    CALLS,
    BackendError,
    Captured,
    ContractError,
    describe_exception,
    device_lost,
)
from conformance.worker_process import DEPTH, OUTPUT_TAIL, Worker, take_ahead

# --- what a call handed over, as the backend left it ---------------------------------------------


class Handed:
    """The arrays a call handed to the backend, as the backend left them: ``current`` is the
    backend's copy of one of the harness's arrays, ``changed`` whether it differs from it."""

    def __init__(self, current: Callable[[np.ndarray], np.ndarray],
                 changed: Callable[[np.ndarray], bool]):
        self.current = current
        self.changed = changed


# --- handles: what the harness holds -----------------------------------------------------------


class BackendHandle:
    """The harness's view of one backend: its declared data, and calls that cannot hurt it."""

    def __init__(self, declared: Declared, target: str):
        self.declared = declared
        self.label = declared.name
        self.target = target
        self.capabilities: Capabilities = declared.capabilities
        self.conventions: Conventions = declared.conventions
        self._reasons: dict[str, str | None] = {}

    def call(self, name: str, *args: Any) -> Any:
        value, _ = self.submit(name, *args)()
        return REPLIES[name](self.label, value)

    def submit(self, name: str, *args: Any) -> Callable[[], tuple[Any, Handed]]:
        """Start a call; the returned function waits for its plain-data result and what the
        backend left of the arrays it was handed (or raises its fault)."""
        raise NotImplementedError

    def submit_decode(self, problem: Problem, out: np.ndarray, lse: np.ndarray,
                      num_splits: int | None
                      ) -> Callable[[], tuple[np.ndarray, np.ndarray, tuple[str, ...]]]:
        """Start a decode; the harness may work (on the oracle, say) while it runs. The
        result names the inputs the call changed, as the harness saw them."""
        waiting = self.submit("decode", problem, out, lse, num_splits)

        def result() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
            value, handed = waiting()
            REPLIES["decode"](self.label, value)
            out[...], lse[...] = handed.current(out), handed.current(lse)
            mutated = tuple(name for name, array in problem.arrays().items()
                            if handed.changed(array))
            return out, lse, mutated
        return result

    def merges(self, pairs: list[tuple[AttentionState, AttentionState]]
               ) -> list[AttentionState | BackendError | ContractError]:
        """Independent merges in one request (more only where one loses the device): each the
        merged state, or the fault a call of its own would have raised. Each pair gets its
        own copies, so a merge that writes its inputs is caught on its own."""
        own = [tuple(AttentionState(s.out.copy(), s.lse.copy()) for s in pair) for pair in pairs]
        done: list[AttentionState | BackendError | ContractError] = []
        while len(done) < len(own):
            rest = own[len(done):]
            try:
                value, handed = self.submit("merges", rest)()
            except (BackendError, ContractError) as exc:  # died, timed out: all that is left
                return done + [exc] * len(rest)
            if not (isinstance(value, list) and 0 < len(value) <= len(rest) and all(
                    isinstance(r, list) and len(r) == 3 for r in value)):
                fault = ContractError(f"{self.label}'s merges sent back {str(value)[:120]}, "
                                      f"not a reply for each merge")
                return done + [fault] * len(rest)
            done += [self._merged(a, b, reply, handed)
                     for (a, b), reply in zip(rest, value, strict=False)]
        return done

    def _merged(self, a: AttentionState, b: AttentionState, reply: list, handed: Handed
                ) -> AttentionState | BackendError | ContractError:
        kind, value, lost = reply
        if kind != "ok":
            return self._fault("merge", kind, value, lost)
        inputs = {"a.out": a.out, "a.lse": a.lse, "b.out": b.out, "b.lse": b.lse}
        changed = [name for name, array in inputs.items() if handed.changed(array)]
        if changed:
            return ContractError(f"{self.label}'s merge modified its inputs: "
                                 f"{', '.join(changed)}")
        try:
            return check_merged(self.label, a, *merged_arrays(self.label, value))
        except ContractError as exc:
            return exc

    def _fault(self, what: str, kind: str, value: Any, lost: Any
               ) -> BackendError | ContractError:
        """A reply that is not ``ok``, as the exception its call raises."""
        if kind == "contract":
            return ContractError(str(value))
        return BackendError(str(value) + self._lost(what, lost, str(value)))

    def _lost(self, what: str, lost: Any, error: str) -> str:
        """What a call's ``error`` adds when it lost the device (``lost``: the worker's word;
        the isolated handle replaces its worker)."""
        return ""

    def unsupported_reason(self, case: Any) -> str | None:
        if not self.declared.own_limits:
            return self.capabilities.unsupported_reason(case)
        if case.id not in self._reasons:
            self._reasons[case.id] = self.call("unsupported_reason", case)
        return self._reasons[case.id]

    def notes(self) -> list[str]:
        return []

    def device(self) -> str | None:
        """Where the backend runs ("cpu", "cuda"), asked once; None if it cannot say."""
        if not hasattr(self, "_device"):
            try:
                self._device = self.call("device")
            except (BackendError, ContractError):
                return None
        return self._device

    def begin_case(self, timeout: float | None, case: str | None = None) -> None:
        """Start the clock of a case; ``timeout`` None or 0 means none. ``case`` names it, so
        that a case that timed out is not called again when its next family starts it."""

    def end_case(self) -> Captured | None:
        """What the backend printed during the case (None when nothing or not captured)."""
        return None

    def take_restarts(self) -> list[str]:
        """Why the worker was replaced during the case, once each (it lost its device)."""
        return []

    def close(self) -> None:
        pass


class InProcessBackend(BackendHandle):
    """The backend in this process (``--in-process``): for debuggers; no isolation, no timeout,
    no capture. It still gets copies of its inputs, compared with the harness's afterwards."""

    def __init__(self, declared: Declared, target: str):
        super().__init__(declared, target)
        self._instance: Backend | None = None

    @property
    def instance(self) -> Backend:
        if self._instance is None:
            from conformance.backends.registry import resolve

            try:
                self._instance = resolve(self.target)()
            except Exception as exc:
                raise BackendError(f"constructor raised {describe_exception(exc)}") from exc
        return self._instance

    def submit(self, name: str, *args: Any) -> Callable[[], tuple[Any, Handed]]:
        instance = self.instance
        copies: dict[int, Any] = {}
        given = copy.deepcopy(args, copies)
        try:
            with noting_interrupts():
                result = CALLS[name](instance, *given)
        except ContractError:
            raise
        except BaseException as exc:  # SystemExit too; a real Ctrl-C still stops the run
            if isinstance(exc, KeyboardInterrupt) and interrupted():
                raise
            raise BackendError(f"{name} raised {describe_exception(exc)}") from exc
        if name == "merges":  # plain arrays, as a worker would send them
            result = copy.deepcopy(result)

        def changed(array: np.ndarray) -> bool:
            mine = copies[id(array)]
            return mine.shape != array.shape or mine.dtype != array.dtype or not same_bytes(
                mine, array)
        handed = Handed(lambda array: copies[id(array)], changed)
        return lambda: (result, handed)

    def notes(self) -> list[str]:
        try:
            return self.call("notes") if self._instance is not None else []
        except (BackendError, ContractError) as exc:
            return [str(exc)]


class IsolatedBackend(BackendHandle):
    """The backend in a worker process of its own, started on first use and after a fault."""

    def __init__(self, declared: Declared, target: str):
        super().__init__(declared, target)
        self.worker: Worker | None = None
        self.deadline: float | None = None
        self.timeout: float | None = None
        self.fault: str = ""  # why the rest of this case fails fast
        self.unavailable: str = ""  # why every case fails fast
        self.case: str | None = None  # the case the clock runs for
        self.timed_out = ""  # the case timed out: its later families are not run
        self.restarts: list[str] = []
        self.kept_output: list[Captured] = []  # of workers replaced during the case

    # - the worker's life -

    def _start(self) -> None:
        self.worker = take_ahead(self.target)
        if self.worker is not None:  # opened ahead (``parallel.Pool``): read its reply
            self._receive("loading the backend", self.worker.number)
            return
        self.worker = Worker(self.target, self.deadline)
        self._request(("open", self.target), "loading the backend")

    def _stop(self) -> None:
        if self.worker is not None:
            self.worker.end()
            self._keep_output()
        self.worker = None

    @property
    def busy(self) -> bool:
        """Whether a request is out: the worker may be stuck in it."""
        return self.worker is not None and self.worker.waiting

    def _keep_output(self) -> None:
        captured = self.worker.output.take()
        if captured is not None:
            self.kept_output.append(captured)

    def close(self) -> None:
        if self.worker is not None:
            if self.busy:
                self.worker.end()
            else:
                self.worker.close()
        self.worker = None

    # - cases -

    def begin_case(self, timeout: float | None, case: str | None = None) -> None:
        if case is None or case != self.case:
            self.timed_out = ""
            self.restarts = []
            self.kept_output = []
            if self.worker is not None:
                self.worker.output.take()
        self.case = case
        self.timeout = timeout or None
        self.deadline = time.monotonic() + timeout if timeout else None
        self.fault = self.timed_out

    def end_case(self) -> Captured | None:
        parts = self.kept_output + ([self.worker.output.take()] if self.worker else [])
        self.kept_output = []
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return Captured(sum(p.total_bytes for p in parts),
                        "".join(p.tail for p in parts)[-OUTPUT_TAIL:])

    def take_restarts(self) -> list[str]:
        restarts, self.restarts = self.restarts, []
        return restarts

    # - calls -

    def submit(self, name: str, *args: Any) -> Callable[[], tuple[Any, Handed]]:
        """Up to ``DEPTH`` calls may be out (``Trial.decodes``); their results are read in the
        order they were asked. A call sent to a worker that an earlier reply had replaced
        (it lost the device) is asked again of the next worker."""
        if self.worker is not None and len(self.worker.out) >= DEPTH:
            raise RuntimeError(f"{name} asked while {DEPTH} requests to {self.label} are out: "
                               f"read a result before the next call")
        if self.unavailable or self.fault:
            raise BackendError(self.unavailable or f"not run: {self.fault}")
        if self.worker is None:
            self._start()
        worker = self.worker
        number, segment = self._send(("call", name, args), name)

        def result() -> tuple[Any, Handed]:
            if self.worker is not worker:
                return self.submit(name, *args)()
            value = self._receive(name, number)
            index = {id(array): i for i, array in enumerate(segment.originals)}
            return value, Handed(lambda array: segment.view(index[id(array)]),
                                 lambda array: segment.changed(index[id(array)]))
        return result

    def notes(self) -> list[str]:
        if self.worker is None or self.fault or self.busy:
            return []
        try:
            return self.call("notes")
        except (BackendError, ContractError) as exc:
            return [f"notes() failed: {exc}"]

    def _request(self, message: tuple, what: str) -> Any:
        number, _ = self._send(message, what)
        return self._receive(what, number)

    def _send(self, message: tuple, what: str) -> tuple[int, Segment | None]:
        if self.worker.wrote_unasked():  # it could answer this request before reading it
            self.restarts.append(f"{what}: the worker wrote to the channel unasked")
            self._stop()
            self._start()
        try:
            segment = self.worker.send(message, self.deadline)
        except TimeoutError:
            self._time_out(what)
        except OSError:
            self._fail(self.worker.death(what))
        return self.worker.number, segment

    def _receive(self, what: str, number: int) -> Any:
        try:
            reply = self.worker.receive(self.deadline, number)
        except PeerGoneError:
            self._fail(self.worker.death(what))
        except WireError as exc:
            self._fail(f"{what}: the worker broke the protocol ({exc}); the worker was killed")
        if reply is None:
            self._time_out(what)
        kind, value, lost = reply
        if kind == "ok":
            return value
        if kind == "unavailable":
            self.unavailable = f"backend {self.label} is unavailable in the worker process: {value}"
            self._fail(self.unavailable)
        raise self._fault(what, kind, value, lost)

    def _lost(self, what: str, lost: Any, error: str) -> str:
        lost = lost if isinstance(lost, str) and lost else device_lost(error)
        if not lost:
            return ""
        # every later call in that process would fail: replace it before the next
        self.restarts.append(f"{what}: {lost}")
        self._stop()
        return f"; the worker was replaced ({lost})"

    def _time_out(self, what: str) -> None:
        self.timed_out = f"the case timed out after {self.timeout:g} s in {what}"
        self._fail(f"timed out after {self.timeout:g} s (in {what}); the worker was killed")

    def _fail(self, why: str) -> None:
        self.fault = self.fault or why
        self._stop()
        raise BackendError(why)
