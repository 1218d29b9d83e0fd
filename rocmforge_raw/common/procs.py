"""Processes and the shared-memory names of this package, for memory shared between processes.

A process is named by its pid *and* its start time (``/proc/<pid>/stat``, clock ticks since
boot), so a pid the kernel reused names another process; a host by its boot id. Every file
this package puts in ``/dev/shm`` (host segments, IPC leases) is named
``rocmforge_raw-<pid>-<start>-<n>.<kind>`` after the process that made it, so that
``sweep()`` can remove what a killed process left behind. Linux only, like the IPC it serves.
Below the runtime: no device is touched here.
"""

from __future__ import annotations

import itertools
import os
import re
import select
import threading

SHM_DIR = "/dev/shm"
PREFIX = "rocmforge_raw-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-\d+\.\w+$")
_counter = itertools.count()
_swept: set[int] = set()
_lock = threading.Lock()


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if it does not run
    (no such process, or a zombie that has exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name before may hold spaces
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    return int(fields[19])  # field 22 of proc(5), counted from field 3


def identity() -> tuple[int, int]:
    """(pid, start ticks) of this process: what names it, whatever pids get reused."""
    pid = os.getpid()
    start = start_ticks(pid)
    if start is None:  # pragma: no cover - /proc is always there on Linux
        raise OSError("/proc/self/stat cannot be read: IPC needs Linux's /proc")
    return pid, start


def alive(pid: int, start: int) -> bool:
    """Whether the process that ``identity()`` named (pid, start) still runs."""
    return start_ticks(pid) == start


class Exit:
    """Watches for the end of the process ``identity()`` named (pid, start): a pidfd
    (Linux 5.3+) opened once, which turns readable when the process exits, so ``alive()``
    is one ``poll`` instead of reading ``/proc/<pid>/stat``. The pidfd is checked against
    the start time once it is open (a pid reused before it was opened names another
    process: ``alive()`` is then False). Where pidfds are unavailable, ``alive()`` asks
    ``/proc`` each time. ``close()`` lets the pidfd go; ``alive()`` asks ``/proc`` then."""

    def __init__(self, pid: int, start: int) -> None:
        self.pid, self.start = pid, start
        self._poll: select.poll | None = None
        self._fd = -1
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
            return
        except (OSError, AttributeError):  # no pidfds here (an old kernel, a sandbox)
            self._gone = not alive(pid, start)
            return
        self._gone = not alive(pid, start)  # after the open: the pidfd names this process
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)

    def alive(self) -> bool:
        """Whether the process still runs (a zombie that exited does not)."""
        if self._gone:
            return False
        if self._poll is None:
            self._gone = not alive(self.pid, self.start)
        else:
            self._gone = bool(self._poll.poll(0))
        return not self._gone

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd, self._poll = -1, None


def boot_id() -> str:
    """This host's boot id: handles carry it, so one taken to another host is refused."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def unique_name(kind: str) -> str:
    """A fresh ``/dev/shm`` file name owned by this process (``kind``: ``seg``, ``lease``)."""
    pid, start = identity()
    return f"{PREFIX}{pid}-{start}-{next(_counter)}.{kind}"


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def sweep() -> list[str]:
    """Remove this package's ``/dev/shm`` files whose process no longer runs (one killed
    before it could unlink them); once per process, the first time it shares memory.
    Returns the names removed. Mappings other processes hold stay valid: only the names go."""
    with _lock:
        if os.getpid() in _swept:
            return []
        _swept.add(os.getpid())
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match and not alive(int(match[1]), int(match[2])):
            try:
                os.unlink(shm_path(name))
                removed.append(name)
            except OSError:  # another process swept it first
                pass
    return removed
