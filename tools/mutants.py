"""Mutation checks that mutmut cannot make: named source changes, and operator mutations of
the compiled core (mutmut mutates ``.py`` files only; the core is Cython ``.pyx``).

Each mutant is applied, alone, to a scratch copy of the tree (never to the work tree); a
``.pyx`` mutant is rebuilt there first. Then the tests named for it run; the mutant is
killed when they fail (or it no longer builds, or time runs out). Usage:

    python tools/mutants.py named        # the issue's list: each with the test that kills it
    python tools/mutants.py core         # operators in the core's .pyx/.pxd files
    python tools/mutants.py core --limit 20 --only pool.pyx

Prints one line per mutant and a summary; exits 1 if any survived.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = "tests/test_cache_contracts.py::"
SCHED = "tests/test_scheduler.py::"
POOL_TESTS = ("tests/test_pool.py", "tests/test_pool_streams.py", "tests/test_buffer.py",
              "tests/test_core.py")


@dataclass(frozen=True)
class Mutant:
    """Replace ``old`` by ``new`` in ``path``: at offset ``at``, or else the first ``old``
    after ``anchor``. Running ``tests`` must kill it."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    anchor: str = ""
    at: int = -1

    def apply(self, text: str) -> str:
        at = self.at if self.at >= 0 else text.index(self.old, text.index(self.anchor))
        if not text.startswith(self.old, at):
            raise ValueError(f"{self.name}: {self.old!r} is not at offset {at}")
        return text[:at] + self.new + text[at + len(self.old):]


def _unlocked(path: str, function: str, test: str) -> Mutant:
    return Mutant(f"lock removed from {function}", path, "with self._lock:", "if True:",
                  (test,), f"def {function}(")


KV, ROWS = "rocmforge_raw/cache/kv_cache.py", "rocmforge_raw/cache/rows.py"
POOL_PY, SCHED_PY = "rocmforge_raw/cache/block_pool.py", "rocmforge_raw/cache/scheduler.py"
CACHE_LOCK = CONTRACTS + "test_every_cache_operation_holds_the_lock_throughout"
SCHED_LOCK = CONTRACTS + "test_every_scheduler_operation_holds_its_lock_throughout"

NAMED = [
    _unlocked(KV, "add_sequence", CACHE_LOCK),
    _unlocked(KV, "append", CACHE_LOCK),
    _unlocked(KV, "batch", CACHE_LOCK),
    _unlocked(KV, "fork", CACHE_LOCK),
    _unlocked(KV, "finish", CACHE_LOCK),
    _unlocked(KV, "stats", CACHE_LOCK),
    _unlocked(SCHED_PY, "step", SCHED_LOCK),
    _unlocked(SCHED_PY, "advance", SCHED_LOCK),
    _unlocked(SCHED_PY, "try_submit", SCHED_LOCK),
    Mutant("BlockPool.share of a block not held", POOL_PY, 'self._check_held(ids, "share")',
           "pass", (CONTRACTS + "test_sharing_a_block_not_held_is_refused_and_changes_nothing",)),
    Mutant("block-id upper bound >= to >", POOL_PY, "ids.max() >= self.num_blocks",
           "ids.max() > self.num_blocks",
           (CONTRACTS + "test_a_block_id_past_the_last_is_refused_naming_it",)),
    Mutant("num_blocks past int32", "rocmforge_raw/cache/config.py",
           "MAX_BLOCKS = (1 << 31) - 1", "MAX_BLOCKS = (1 << 32) - 1",
           (CONTRACTS + "test_num_blocks_stops_at_the_largest_int32_block_id",)),
    Mutant("allocate beyond the free count", POOL_PY, "if count > self._top:",
           "if count > self._top + 1:",
           (CONTRACTS + "test_allocating_more_blocks_than_are_free_returns_none_and_changes_"
            "nothing",)),
    Mutant("can_append ignoring its argument", KV, "ids = list(seq_ids)",
           "ids = list(self._rows.index)",
           (CONTRACTS + "test_can_append_answers_for_the_sequences_it_is_given",),
           "def can_append("),
    Mutant("finished records pruned only when read", "rocmforge_raw/cache/records.py",
           "self.prune()", "pass",
           (CONTRACTS + "test_finished_records_are_pruned_when_added_not_only_when_read",),
           "def add("),
    Mutant("times() reporting creation twice", KV, "float(rows.accessed[row])",
           "float(rows.created[row])",
           (CONTRACTS + "test_times_record_creation_and_every_access",)),
    Mutant("append not refreshing recency", ROWS, "self.touch(rows, now)", "pass",
           (CONTRACTS + "test_append_makes_a_sequence_the_most_recently_used",),
           "def extend("),
    Mutant("preemption taking batch members first", KV, "least_recent(exclude=batch)",
           "least_recent(exclude=())",
           (CONTRACTS + "test_preemption_takes_sequences_outside_the_append_before_its_"
            "members",)),
    Mutant("last slot without % block_size after add_sequence", KV,
           "(num_tokens - 1) % bs", "(num_tokens - 1)",
           (CONTRACTS + "test_the_plan_after_add_sequence_maps_the_last_prompt_slot",)),
    Mutant("row memo ignoring the version", ROWS,
           "memo[0] == self.version and memo[1] == ids", "memo[1] == ids",
           (CONTRACTS + "test_a_plan_after_remove_never_reuses_the_freed_rows",)),
    Mutant("append docstring deleted", KV, '"""Reserve one more token slot', '"""""" and """',
           (CONTRACTS + "test_every_public_class_and_method_of_the_cache_has_a_docstring",)),
    Mutant("scheduler accepting fractional counts", SCHED_PY,
           "if isinstance(value, bool) or not isinstance(value, (int, np.integer)):",
           "if isinstance(value, bool):",
           (SCHED + "test_malformed_requests_are_refused_at_submit_naming_the_value",)),
    Mutant("scheduler accepting requests larger than the cache", SCHED_PY,
           "if blocks > config.num_blocks - 1:", "if False:",
           (SCHED + "test_a_request_larger_than_the_whole_cache_is_refused_at_submit",)),
    Mutant("max_waiting off by one", SCHED_PY, "len(self.waiting) >= self.max_waiting",
           "len(self.waiting) > self.max_waiting",
           (SCHED + "test_a_full_queue_refuses_submit_and_try_submit_returns_false",)),
    Mutant("unbounded overtaking", SCHED_PY,
           "len(admitted) + self.max_overtakes - request.overtaken)", "math.inf)",
           (SCHED + "test_a_stream_of_small_requests_cannot_starve_a_large_one",)),
    Mutant("advance of a plan twice", SCHED_PY, "self._pending = None", "pass",
           (SCHED + "test_advance_refuses_a_plan_twice_a_stale_plan_and_a_foreign_one",),
           "def advance("),
    Mutant("max_running=0 accepted", SCHED_PY, '"max_running", 1)', '"max_running", 0)',
           (SCHED + "test_bad_limits_are_refused",)),
]

# Operator swaps for the generated core mutants: (pattern, replacement), one site at a time.
OPERATORS = [(" < ", " <= "), (" <= ", " < "), (" > ", " >= "), (" >= ", " > "),
             (" == ", " != "), (" != ", " == "), (" + ", " - "), (" - ", " + "),
             (" += ", " -= "), (" -= ", " += "), (" and ", " or "), (" or ", " and "),
             ("if not ", "if "), ("return True", "return False"), ("return False", "return True")]
CORE = {"_freelist.pxd": POOL_TESTS, "pool.pyx": POOL_TESTS,
        "_registry.pyx": ("tests/test_buffer.py", "tests/test_core.py", "tests/test_pool.py"),
        "buffer.pyx": ("tests/test_buffer.py", "tests/test_core.py")}

#: Where a .pxd's inline code is compiled (its .c and .so are put back after a mutant).
COMPILED_INTO = {"rocmforge_raw/_freelist.pxd": "rocmforge_raw/pool"}


def core_mutants(only: str | None) -> list[Mutant]:
    """One mutant per operator site in the core's code lines (not comments or docstrings)."""
    mutants = []
    for name, tests in CORE.items():
        if only and name != only:
            continue
        path = f"rocmforge_raw/{name}"
        text = (ROOT / path).read_text()
        in_doc = False
        offset = 0
        for number, line in enumerate(text.splitlines(keepends=True), 1):
            code = line.split("#", 1)[0]
            if code.count('"""') % 2:
                in_doc = not in_doc
            elif not in_doc and '"""' not in code and "f\"" not in code and "raise " not in code:
                for old, new in OPERATORS:
                    for match in re.finditer(re.escape(old), code):
                        at = offset + match.start()
                        mutants.append(Mutant(f"{name}:{number}: {old.strip()} -> "
                                              f"{new.strip()}: {line.strip()}", path, old,
                                              new, tests, at=at))
            offset += len(line)
    return mutants


def scratch_copy() -> Path:
    """The tree as git sees it plus the built core and kernels, in a temporary folder."""
    where = Path(tempfile.mkdtemp(prefix="rf-mutants-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    built = [p.relative_to(ROOT) for pattern in ("rocmforge_raw/**/*.so", "rocmforge_raw/**/*.c",
                                                 "rocmforge_raw/kernels/*")
             for p in ROOT.glob(pattern)]
    for rel in {*map(Path, files), *built}:
        if (ROOT / rel).is_file() and not str(rel).startswith("mutants/"):
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, where / rel)
    return where


def run(mutant: Mutant, tree: Path, timeout: float) -> str:
    """'killed', 'survived', 'timeout' or 'no build' for ``mutant`` in ``tree``."""
    target = tree / mutant.path
    original = target.read_text()
    compiled = mutant.path.endswith((".pyx", ".pxd"))
    saved = {}
    if compiled:  # keep the built module to put back rather than rebuild it
        stem = tree / COMPILED_INTO.get(mutant.path, mutant.path[:-len(".pyx")])
        saved = {p: p.read_bytes() for p in stem.parent.glob(stem.name + ".*")
                 if p.suffix in (".so", ".c")}
    try:
        target.write_text(mutant.apply(original))
        if compiled:
            build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                                   cwd=tree, capture_output=True, timeout=timeout)
            if build.returncode:
                return "no build"
        tests = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                "no:cacheprovider", *mutant.tests], cwd=tree,
                               capture_output=True, timeout=timeout)
        return "survived" if tests.returncode == 0 else "killed"
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        target.write_text(original)
        for path, data in saved.items():
            path.write_bytes(data)
        if compiled:  # older than the module again: no rebuild next time
            when = min(p.stat().st_mtime for p in saved) - 10
            os.utime(target, (when, when))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=["named", "core"])
    parser.add_argument("--only", help=f"core: one file ({', '.join(CORE)})")
    parser.add_argument("--limit", type=int, default=0, help="core: at most this many")
    parser.add_argument("--match", help="only the mutants whose name matches this regex")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    args = parser.parse_args()
    mutants = NAMED if args.which == "named" else core_mutants(args.only)
    if args.match:
        mutants = [m for m in mutants if re.search(args.match, m.name)]
    if args.limit > 0:
        mutants = mutants[:args.limit]
    tree = scratch_copy()
    counts: dict[str, int] = {}
    try:
        baseline = sorted({test for mutant in mutants for test in mutant.tests})
        clean = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                *baseline], cwd=tree, capture_output=True, text=True)
        if clean.returncode:
            print(clean.stdout[-3000:])
            raise SystemExit("the tests fail without any mutant: fix them first")
        for mutant in mutants:
            began = time.monotonic()
            result = run(mutant, tree, args.timeout)
            counts[result] = counts.get(result, 0) + 1
            print(f"{result:9s} {time.monotonic() - began:5.1f}s  {mutant.name}", flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    survived = counts.get("survived", 0)
    print(f"{len(mutants) - survived} of {len(mutants)} killed ({counts})")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
