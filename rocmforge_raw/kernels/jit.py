"""Run-time compilation of the packaged kernel sources (NVRTC, hiprtc) into an on-disk cache.

An entry is one file, ``<cache_dir>/<backend>/<stem>.<arch>.<key>.bin``: a one-line header
``rfjit1 <sha256 of the image> <image bytes> <compile seconds> <compiler version>`` and then
the image. ``key`` hashes everything that decides the image: the source and every header it
includes (their text), the options, the arch and the compiler's version. An entry is written to
a temporary file of its own beside its place and renamed into it (``os.replace``, atomic on
POSIX): processes compiling at once each leave a whole entry and a reader never sees part of
one. An entry whose header, size or checksum does not match is compiled again and replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..common import progress
from ..errors import KernelNotAvailableError

_log = logging.getLogger(__name__)

#: What every run-time compilation passes, besides the arch and the source's folder (``-I``).
OPTIONS = ("-std=c++17", "-DRF_RUNTIME_COMPILED=1")

_MAGIC = "rfjit1"
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class Compiler:
    """One run-time compiler: ``compile(source, name, arch, options)`` returns a loadable
    image; ``version`` names the compiler exactly enough to key the cache with it."""

    backend: str
    version: str
    compile: Callable[[str, str, str, list[str]], bytes]


def compiler_for(backend: str) -> Compiler:
    """The run-time compiler of ``backend`` (``cuda``: NVRTC, ``hip``: hiprtc). Needs the
    compiler's library, not a GPU; raises ``KernelNotAvailableError`` without it."""
    if backend == "cuda":
        from ..runtime.cuda_compile import nvrtc_compile, nvrtc_version

        return Compiler("cuda", nvrtc_version(), nvrtc_compile)
    if backend == "hip":
        from ..runtime.hip_compile import hiprtc_compile, hiprtc_version

        return Compiler("hip", hiprtc_version(), hiprtc_compile)
    raise KernelNotAvailableError(f"the {backend} backend cannot compile kernels at run time")


def cache_dir() -> Path:
    """Where run-time compiled kernels are kept: ``RF_CACHE_DIR`` or ~/.cache/rocmforge_raw."""
    root = os.environ.get("RF_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rocmforge_raw")
    return Path(root)


def source_texts(source: Path) -> list[tuple[str, str]]:
    """(name, text) of ``source`` and of every header it includes with ``#include "name"``
    from its folder, recursively, each once, in the order first met."""
    texts: dict[str, str] = {}
    pending = [source.name]
    while pending:
        name = pending.pop(0)
        if name not in texts:
            texts[name] = (source.parent / name).read_text()
            pending += [n for n in _INCLUDE.findall(texts[name])
                        if (source.parent / n).exists()]
    return list(texts.items())


def cache_key(version: str, arch: str, options: tuple[str, ...] | list[str],
              texts: list[tuple[str, str]]) -> str:
    """24 hex digits of the SHA-256 of the compiler version, arch, options and each file's
    (name, text): a change to any of them is a different entry."""
    digest = hashlib.sha256()
    for part in (version, arch, *options, *(p for pair in texts for p in pair)):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:24]


@dataclass(frozen=True)
class Compiled:
    """A compiled image and where it came from: ``cached`` if read from the entry at
    ``path``, else compiled now; ``seconds`` is the compile time (now, or when the entry was
    made)."""

    image: bytes
    path: Path
    cached: bool
    seconds: float
    compiler: str


def compile_cached(compiler: Compiler, source: Path, arch: str, root: Path | None = None
                   ) -> Compiled:
    """``source`` compiled for ``arch``: from its cache entry under ``root`` (default
    ``cache_dir()``) when a valid one exists, else compiled now and stored."""
    texts = source_texts(source)
    key = cache_key(compiler.version, arch, OPTIONS, texts)
    path = (root or cache_dir()) / compiler.backend / f"{source.stem}.{arch}.{key}.bin"
    entry = read_entry(path)
    if entry is not None:
        return entry
    name = "NVRTC" if compiler.backend == "cuda" else "hiprtc"
    _log.info("compiling %s for %s with %s (%s), to be kept in %s", source.name, arch, name,
              compiler.version, path)
    start = time.perf_counter()
    with progress.ticking(f"compiling {source.name} for {arch} ({name}, once: then cached)"):
        image = compiler.compile(texts[0][1], source.name, arch,
                                 [*OPTIONS, f"-I{source.parent}"])
    seconds = time.perf_counter() - start
    try:
        write_entry(path, image, seconds, compiler.version)
    except OSError as exc:  # e.g. a read-only home: the kernel still runs, it is not kept
        warnings.warn(f"could not store a compiled kernel in {path.parent}: {exc}",
                      RuntimeWarning, stacklevel=2)
    return Compiled(image, path, False, seconds, compiler.version)


def write_entry(path: Path, image: bytes, seconds: float, version: str) -> None:
    """Store ``image`` at ``path`` atomically (a unique temporary file, then ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(image).hexdigest()
    header = f"{_MAGIC} {digest} {len(image)} {seconds:.3f} {version}\n".encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(header + image)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_entry(path: Path) -> Compiled | None:
    """The entry at ``path``, or ``None`` if it is missing, truncated or corrupt."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    header, _, image = data.partition(b"\n")
    fields = header.decode(errors="replace").split(" ", 4)
    if len(fields) != 5 or fields[0] != _MAGIC:
        return None
    _, digest, size, seconds, version = fields
    if size != str(len(image)) or hashlib.sha256(image).hexdigest() != digest:
        return None
    try:
        return Compiled(image, path, True, float(seconds), version)
    except ValueError:
        return None


def cache_entries(root: Path | None = None) -> list[Compiled]:
    """Every valid entry under ``root`` (default ``cache_dir()``), by path."""
    paths = sorted((root or cache_dir()).glob("*/*.bin"))
    return [entry for entry in map(read_entry, paths) if entry is not None]
