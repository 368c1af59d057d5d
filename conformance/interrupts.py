"""Ctrl-C and TERM during a run: stop, keep what finished, write the reports whole."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_signalled = False


def interrupted() -> bool:
    """Whether a real Ctrl-C or TERM came (a ``KeyboardInterrupt`` a backend raises itself is
    that backend's fault, not a stop)."""
    return _signalled


@contextlib.contextmanager
def noting_interrupts() -> Iterator[None]:
    """While a backend runs in this process, a real Ctrl-C is noted before it is handled, so
    that ``interrupted`` tells it from a ``KeyboardInterrupt`` the backend raised."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def note(signum, frame) -> None:
        global _signalled
        _signalled = True
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, previous)


def _interrupt(signum, frame) -> None:
    """The first Ctrl-C or TERM stops the run; later ones are ignored while reports are written."""
    global _signalled
    _signalled = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """A timeout's TERM, like Ctrl-C, interrupts the run (which then reports what finished)."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def protect_reports() -> None:
    """From here on the reports are written whole: a further signal waits for them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
