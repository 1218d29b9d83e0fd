#!/usr/bin/env python3
"""What `make` needs from the system: the machine's GPU, and the Debian packages a goal needs,
installed where they are missing (the Makefile lists them).

    python3 tools/system_deps.py gpu        # amd, nvidia or none
    python3 tools/system_deps.py build-requires   # pyproject.toml's [build-system] requires
    python3 tools/system_deps.py check [--goal 'make demo'] [--quiet] [--name-hiprtc] NEED...

A NEED is ``PACKAGE:KIND=NAME``: the Debian package that provides NAME, found as KIND:

- ``lib``: a shared library in the dynamic linker's cache, read with ldconfig by its absolute
  path (/sbin is not on an ordinary user's PATH), else a file in the usual library folders;
- ``cmd``: a command on PATH, where make will look for it;
- ``py``: of this Python: ``venv`` (it can create virtual environments: ensurepip),
  ``headers`` (its Python.h) or ``compiler`` (the C compiler it builds extensions with).

Missing packages are installed with apt-get: as root directly, otherwise through sudo where
there is one. Where neither can be, or the install fails, the apt-get command an administrator
must run is printed and the status is 1: nothing else was changed, so the next run starts
where this one stopped. Standard library only: it runs before the virtual environment exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

LDCONFIGS = ("/sbin/ldconfig", "/usr/sbin/ldconfig")
LIBRARY_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib")


def libraries() -> dict[str, str]:
    """Library file name -> path, from ldconfig's cache (the first entry of each name)."""
    ldconfig = next((p for p in LDCONFIGS if os.access(p, os.X_OK)), shutil.which("ldconfig"))
    found: dict[str, str] = {}
    if ldconfig:
        listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
        for name, path in re.findall(r"^\s+(\S+) \(.*\) => (\S+)$", listing, re.MULTILINE):
            found.setdefault(name, path)
    return found


def find_library(name: str, cache: dict[str, str]) -> str | None:
    """Where ``name`` (``libnuma.so.1``) is: ldconfig's cache, else the usual folders."""
    if name in cache:
        return cache[name]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    folders = [*os.environ.get("LD_LIBRARY_PATH", "").split(":"), *LIBRARY_DIRS,
               *(f"{d}/{multiarch}" for d in LIBRARY_DIRS if multiarch)]
    return next((str(Path(d) / name) for d in folders if d and (Path(d) / name).exists()), None)


def _python_has(what: str) -> bool:
    if what == "venv":
        return importlib.util.find_spec("ensurepip") is not None
    if what == "headers":
        return (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    if what == "compiler":
        compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        return shutil.which(shlex.split(compiler)[0]) is not None
    raise SystemExit(f"system_deps: unknown py check {what!r} (venv, headers, compiler)")


def present(kind: str, name: str, cache: dict[str, str]) -> bool:
    if kind == "lib":
        return find_library(name, cache) is not None
    if kind == "cmd":
        return shutil.which(name) is not None
    if kind == "py":
        return _python_has(name)
    raise SystemExit(f"system_deps: unknown kind {kind!r} in {kind}={name} (lib, cmd, py)")


def _answers(command: list[str], pattern: str) -> bool:
    """Whether ``command`` runs and prints something matching ``pattern``."""
    if shutil.which(command[0]) is None:
        return False
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(pattern, out, re.MULTILINE) is not None


def gpu() -> str:
    """amd, nvidia or none, in the order the package's default backend tries them."""
    if Path("/dev/kfd").exists() or _answers(["rocminfo"], r"^\s*Name:\s+gfx\d"):
        return "amd"
    if (Path("/dev/nvidia0").exists() or _answers(["nvidia-smi", "-L"], r"^GPU \d")
            or find_library("libcuda.so.1", libraries())):
        return "nvidia"
    return "none"


def build_requires(pyproject: Path) -> list[str]:
    """The ``[build-system]`` requires of ``pyproject`` (a regular expression where Python
    3.10 has no tomllib: a list of quoted strings)."""
    text = pyproject.read_text()
    try:
        import tomllib
    except ImportError:
        table = re.search(r"^\[build-system\]$(.*?)(^\[|\Z)", text, re.MULTILINE | re.DOTALL)
        listed = re.search(r"^requires\s*=\s*\[(.*?)\]", table.group(1) if table else "",
                           re.MULTILINE | re.DOTALL)
        return re.findall(r"[\"']([^\"']+)[\"']", listed.group(1)) if listed else []
    return list(tomllib.loads(text)["build-system"]["requires"])


def _as_root(command: list[str]) -> list[str] | None:
    """``command`` as root: itself for root, through sudo otherwise; None without sudo."""
    if os.geteuid() == 0:
        return command
    sudo = shutil.which("sudo") or next(
        (p for p in ("/usr/bin/sudo", "/bin/sudo") if os.access(p, os.X_OK)), None)
    return [sudo, *command] if sudo else None


def _run_as_root(commands: list[list[str]], shown: str, goal: str, why: str) -> bool:
    """Run ``commands`` as root; where that cannot be or fails, say that an administrator
    must run ``shown`` (the same, as one types it) and return False."""
    runnable = [_as_root(c) for c in commands]
    if None in runnable:
        reason = "not root, and no sudo here"
    else:
        print(f"[make] {why}{'' if os.geteuid() == 0 else ' through sudo'}", flush=True)
        status = next((s for c in runnable
                       if (s := subprocess.run(c, stdout=subprocess.DEVNULL).returncode)), 0)
        if status == 0:
            return True
        reason = f"it failed (status {status})"
    print(f"[make] {reason}: an administrator must run, as root,\n    {shown}\n"
          f"[make] then run `{goal}` again.", file=sys.stderr)
    return False


def _unnamed_hiprtc(cache: dict[str, str]) -> str | None:
    """Debian's ROCm 5.2 keeps hiprtc inside libamdhip64.so.5 (later ROCm split it out) and
    hip-python loads it as libhiprtc.so: that library's path, where nothing has the name."""
    lib = cache.get("libamdhip64.so.5")
    if lib is None or find_library("libhiprtc.so", cache) or (Path(lib).parent
                                                             / "libhiprtc.so").exists():
        return None
    nm = shutil.which("nm")
    symbols = subprocess.run([nm, "-D", lib], capture_output=True, text=True).stdout if nm else ""
    return lib if re.search(r" T hiprtcCreateProgram$", symbols, re.MULTILINE) else None


def _parse(need: str) -> tuple[str, str, str]:
    package, _, what = need.partition(":")
    kind, _, name = what.partition("=")
    if not (package and kind and name):
        raise SystemExit(f"system_deps: {need!r} is not PACKAGE:KIND=NAME")
    return package, kind, name


def _missing(needs: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    """Package -> the names of it that are missing here."""
    cache = libraries()
    missing: dict[str, list[str]] = {}
    for package, kind, name in needs:
        if not present(kind, name, cache):
            missing.setdefault(package, []).append(name)
    return missing


def check(needs: list[str], goal: str, quiet: bool, name_hiprtc: bool) -> int:
    parsed = [_parse(n) for n in needs]
    missing = _missing(parsed)
    if missing:
        listed = "; ".join(f"{', '.join(names)} (Debian: {p})" for p, names in missing.items())
        print(f"[make] `{goal}` needs, and this system lacks: {listed}", flush=True)
        if shutil.which("apt-get") is None:
            print(f"[make] no apt-get here: install what provides them (Debian: "
                  f"{' '.join(missing)}), then run `{goal}` again.", file=sys.stderr)
            return 1
        env = ["env", "DEBIAN_FRONTEND=noninteractive"]
        install = [[*env, "apt-get", "update", "-qq"],
                   [*env, "apt-get", "install", "-y", "-qq", *missing]]
        shown = f"apt-get update && apt-get install -y {' '.join(missing)}"
        if not _run_as_root(install, shown, goal, f"installing {' '.join(missing)} with apt-get"):
            return 1
        still = _missing(parsed)
        if still:
            print(f"[make] still missing after apt-get: "
                  f"{', '.join(n for names in still.values() for n in names)}", file=sys.stderr)
            return 1
    lib = _unnamed_hiprtc(libraries()) if name_hiprtc else None
    if lib is not None:
        link = ["ln", "-s", Path(lib).name, str(Path(lib).parent / "libhiprtc.so")]
        if not _run_as_root([link], shlex.join(link), goal,
                            f"naming Debian's hiprtc (in {lib}) libhiprtc.so for hip-python"):
            return 1
    if not (missing or quiet):
        print(f"[make] system: everything `{goal}` needs is installed "
              f"({' '.join(dict.fromkeys(p for p, _, _ in parsed))})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("gpu", help="print amd, nvidia or none")
    commands.add_parser("build-requires", help="print pyproject.toml's build requirements")
    checking = commands.add_parser("check", help="find NEEDs, install the missing packages")
    checking.add_argument("needs", nargs="*", metavar="NEED", help="PACKAGE:KIND=NAME")
    checking.add_argument("--goal", default="make", help="what they are for (messages)")
    checking.add_argument("--quiet", action="store_true", help="say nothing when all is there")
    checking.add_argument("--name-hiprtc", action="store_true",
                          help="give Debian's hiprtc the name hip-python loads")
    args = parser.parse_args(argv)
    if args.command == "gpu":
        print(gpu())
        return 0
    if args.command == "build-requires":
        root = Path(__file__).resolve().parents[1]
        print(" ".join(shlex.quote(r) for r in build_requires(root / "pyproject.toml")))
        return 0
    return check(args.needs, args.goal, args.quiet, args.name_hiprtc)


if __name__ == "__main__":
    sys.exit(main())
