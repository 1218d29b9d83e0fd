"""Spawned worker processes that report over a pipe (the disaggregated demo's prefill
process, ``bench --transfer``'s sender): a worker runs its body under ``reporting(conn)``,
which sends a failure as ``("error", traceback)`` before it re-raises; the parent takes each
message with ``receive``, which raises ``WorkerError`` where the worker failed (its last
line; the whole traceback is logged and kept), ended before it sent, or sent nothing in
time. Below the runtime: no device is touched here.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from typing import Any

_log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A spawned worker failed (the message ends with its last line, ``traceback`` holds
    its whole traceback), ended before it sent, or sent nothing in time (``traceback``
    None)."""

    def __init__(self, message: str, traceback: str | None = None) -> None:
        super().__init__(message)
        self.traceback = traceback


@contextlib.contextmanager
def reporting(conn: Any) -> Iterator[None]:
    """Run a worker's body: a failure goes to the parent as ``("error", traceback)`` (then
    raises on here, so the worker's exit status says it failed too)."""
    try:
        yield
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def receive(conn: Any, process: Any, name: str, timeout: float,
            error: type[WorkerError] = WorkerError) -> Any:
    """The next message of worker ``process`` (called ``name`` in errors, say "the sender
    process") from ``conn``, within ``timeout`` seconds; ``error`` (a ``WorkerError``) if
    it failed, ended first or stayed silent."""
    if not conn.poll(timeout):
        raise error(f"{name} sent nothing in {timeout:g} s")
    try:
        message = conn.recv()
    except EOFError:
        process.join(timeout)
        raise error(f"{name} ended (exit status {process.exitcode}) before it said it was "
                    "done") from None
    if isinstance(message, tuple) and message[:1] == ("error",):
        _log.error("%s failed:\n%s", name, message[1])
        lines = message[1].strip().splitlines() or ["(no traceback)"]
        raise error(f"{name} failed: {lines[-1]}", message[1])
    return message
