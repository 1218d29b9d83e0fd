#!/usr/bin/env python3
"""Builds make targets in parallel with a progress bar: how many of those out of date are
built, and which are being built now (`make kernels` runs its code objects through this: a
fresh machine spends minutes compiling them).

    python tools/make_progress.py LABEL TARGET...

Asks ``make -q`` which targets are out of date, runs ``make -jN`` on those (N: the CPU count)
and counts a target built once its file is newer than the start. make's own lines (the
compiler commands, any warning) are printed as they come. On a terminal a bar (tqdm) shows
the count; elsewhere (a log, CI) a plain line on stderr says it every 10 s
(``RF_PROGRESS_EVERY``): ``AMD code objects (clang-19): 3/18 objects, prefill.gfx942.hsaco,
..., 40 s`` (rocmforge_raw.common.progress). The exit status is make's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from rocmforge_raw.common import progress


def out_of_date(targets: list[str], make: str = "make") -> list[str]:
    """The targets ``make -q`` says need building (status 1; 0 is up to date)."""
    env = _without_jobserver(os.environ)
    return [t for t in targets
            if subprocess.run([make, "-q", "--no-print-directory", t], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode]


def _built(target: str, since: float) -> bool:
    try:
        return Path(target).stat().st_mtime >= since
    except OSError:
        return False


def build(label: str, targets: list[str], make: str = "make", jobs: int | None = None) -> int:
    """Build ``targets`` (those out of date) with a bar labelled ``label``; make's status."""
    todo = out_of_date(targets, make)
    if not todo:
        print(f"{label}: all {len(targets)} up to date")
        return 0
    print(f"{label}: building {len(todo)} of {len(targets)} (minutes on a fresh machine)")
    start = time.time() - 1  # file systems keep mtimes to the second at worst
    command = [make, "--no-print-directory", f"-j{jobs or os.cpu_count() or 1}", *todo]
    runner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_without_jobserver(os.environ))
    shown = progress.bar(len(todo), label, unit="objects", leave=True)
    echo = threading.Thread(target=_echo, args=(runner, shown), daemon=True)
    echo.start()
    with shown:
        while runner.poll() is None:
            _advance(shown, todo, start)
            time.sleep(0.5)
        echo.join()
        _advance(shown, todo, start)
    return runner.returncode


def _without_jobserver(env: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    """``env`` with the parent make's jobserver left out of MAKEFLAGS (its pipes are not
    passed on, and -jN here sets the parallelism); variable overrides stay."""
    flags = [w for w in env.get("MAKEFLAGS", "").split()
             if not w.startswith(("--jobserver", "-j")) and w != "j"]
    return {**env, "MAKEFLAGS": " ".join(flags)}


def _echo(runner: subprocess.Popen[str], shown: progress.Display) -> None:
    assert runner.stdout is not None
    for line in runner.stdout:
        shown.write(line.rstrip("\n"), file=sys.stdout)


def _advance(shown: progress.Display, todo: list[str], start: float) -> None:
    left = [Path(t).name for t in todo if not _built(t, start)]
    shown.set_postfix_str(", ".join(left[:3]) + (" ..." if len(left) > 3 else ""),
                          refresh=False)
    shown.update(len(todo) - len(left) - shown.n)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(build(sys.argv[1], sys.argv[2:], os.environ.get("MAKE", "make")))
