"""Ctrl-C and TERM during a run: stop, keep what finished, write the reports whole."""

from __future__ import annotations

import signal


def _interrupt(signum, frame) -> None:
    """The first Ctrl-C or TERM stops the run; later ones are ignored while reports are written."""
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
