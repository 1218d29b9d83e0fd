"""What the commands share: the target the flags name, how output names it, and the one
place output is printed (text, or one JSON document under ``--json``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..runtime import Backend, get_backend


def target(args: argparse.Namespace) -> tuple[Backend, int]:
    """The backend and device the flags name (``BackendUnavailableError`` if absent)."""
    backend = get_backend(args.backend)
    return backend, backend.resolve_device(args.device)


def where(backend: Backend, device: int, forced: str | None) -> str:
    """The target as output names it: ``cuda:0``, or the host backend and why it runs (no GPU
    answered, or what forced it), so that host figures are never read as a GPU's."""
    if backend.name != "host":
        return f"{backend.name}:{device}"
    if forced == "host":
        return "host backend (--backend host)"
    chosen = os.environ.get("RF_BACKEND", "").strip()
    return f"host backend (RF_BACKEND={chosen})" if chosen else "host backend (no GPU answered)"


def emit(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    """``result`` as JSON under ``--json``, else ``text``, on stdout."""
    print(json.dumps(result, indent=2, default=str) if args.json else text)
    sys.stdout.flush()  # a reader that went away is found here, inside main's handler


def note(line: str) -> None:
    """``line`` on stderr at once: what a command says beside its output (never stdout,
    whose ``--json`` document stays whole)."""
    print(line, file=sys.stderr, flush=True)
