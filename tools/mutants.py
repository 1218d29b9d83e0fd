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


def _not_an_operation(function: str, test: str) -> Mutant:
    """A cache operation run without ``core.operation`` (its lock, open check and event
    commit): the cache's operations are decorated, not locked inline."""
    return Mutant(f"lock removed from {function}", KV, f"    @operation\n    def {function}(",
                  f"    def {function}(", (test,))


KV, ROWS = "rocmforge_raw/cache/kv_cache.py", "rocmforge_raw/cache/blocks/rows.py"
POOL_PY = "rocmforge_raw/cache/blocks/block_pool.py"
SCHED_PY = "rocmforge_raw/cache/scheduler/scheduler.py"
CACHE_LOCK = CONTRACTS + "test_every_cache_operation_holds_the_lock_throughout"
SCHED_LOCK = CONTRACTS + "test_every_scheduler_operation_holds_its_lock_throughout"

NAMED = [
    _not_an_operation("add_sequence", CACHE_LOCK),
    _not_an_operation("append", CACHE_LOCK),
    _not_an_operation("batch", CACHE_LOCK),
    _not_an_operation("fork", CACHE_LOCK),
    _not_an_operation("finish", CACHE_LOCK),
    _not_an_operation("stats", CACHE_LOCK),
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
    Mutant("append not refreshing recency", "rocmforge_raw/cache/blocks/_rows.pyx",
           "recency[row] = tick", "pass",
           (CONTRACTS + "test_append_makes_a_sequence_the_most_recently_used",),
           "def extend_rows("),
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
    Mutant("max_waiting off by one", SCHED_PY, "len(self._waiting) >= self.max_waiting",
           "len(self._waiting) > self.max_waiting",
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

# Issue 27: the mutation audit's survivors and each finding put back, with the tests that
# hold them (``python tools/mutants.py named --match "issue 27"``).
PROBE = "tests/test_bad_input.py::test_bad_input_is_refused_clearly"
PREFIX_TESTS, STEP_PY = "tests/test_prefix_cache.py::", "rocmforge_raw/cache/step/planner.py"
POOL_PYX, PLANNING = "rocmforge_raw/memory/pool.pyx", "rocmforge_raw/kernels/planning/arguments.py"
POOL_CORE = "rocmforge_raw/memory/_pool_core.pyx"
RECORDS, FP8_TESTS = "rocmforge_raw/cache/records.py", "tests/test_fp8.py::"


def _issue27(name: str, path: str, old: str, new: str, *tests: str, anchor: str = ""
             ) -> Mutant:
    return Mutant(f"issue 27: {name}", path, old, new, tests, anchor)


NAMED += [
    _issue27("a released row not given back", ROWS, "self.free.append(row)", "pass",
             "tests/test_cache_edges.py::test_freed_rows_are_reused_and_the_row_arrays_stay_"
             "bounded"),
    _issue27("block hashes not chained", "rocmforge_raw/cache/blocks/prefix.py",
             "hashlib.blake2b(parent,", "hashlib.blake2b(b'',",
             PREFIX_TESTS + "test_a_block_is_named_by_its_position_and_prefix_not_its_tokens_"
             "alone"),
    _issue27("register overwriting an indexed digest", POOL_PY,
             "if digest not in self.index and block not in self.hashes:",
             "if block not in self.hashes:",
             PREFIX_TESTS + "test_register_keeps_an_indexed_digest_and_a_named_block"),
    _issue27("register renaming a named block", POOL_PY,
             "if digest not in self.index and block not in self.hashes:",
             "if digest not in self.index:",
             PREFIX_TESTS + "test_register_keeps_an_indexed_digest_and_a_named_block"),
    _issue27("lookup continuing past a miss", POOL_PY, "break", "continue",
             PREFIX_TESTS + "test_lookup_stops_at_the_first_miss", anchor="def lookup("),
    _issue27("fp8 quantization in float16", "rocmforge_raw/kernels/reference.py",
             "scaled = x.astype(np.float32) * inverse",
             "scaled = (x.astype(np.float16) * np.float16(inverse)).astype(np.float32)",
             FP8_TESTS + "test_writes_quantize_by_the_documented_formula"),
    _issue27("close() keeping the slab", KV, "self.slab.buffer.root.close()", "pass",
             "tests/test_lifetimes.py::test_closing_a_cache_frees_its_slab_at_once_and_once"),
    _issue27("free() forgetting the pointer before checking the stream", POOL_PYX,
             "lane = None if stream is ... else self.lane(stream)  # checked before any change\n"
             "        nbytes = self.loose.pop(ptr, None)",
             "nbytes = self.loose.pop(ptr, None)\n"
             "        lane = None if stream is ... else self.lane(stream)",
             PROBE + "[pool-free-stream-int-keeps-the-block]"),
    _issue27("a closed stream the pool saw before", POOL_CORE,
             "        if not stream_is_open(stream):\n            raise "
             "BufferClosedError(f\"{stream!r} was closed\")\n        found = "
             "self.lanes.get(stream)\n        if found is not None:\n            return found\n",
             "        found = self.lanes.get(stream)\n        if found is not None:\n"
             "            return found\n",
             PROBE + "[pool-allocate-closed-seen-stream]"),
    _issue27("a new stream's lane registered before its allocation", POOL_CORE,
             "        return _Lane(stream)\n\n    cdef _Lane register",
             "        return self.register(_Lane(stream))\n\n    cdef _Lane register",
             PROBE + "[pool-over-the-limit-on-a-new-stream]"),
    _issue27("the limit releasing the cache when that cannot make room", POOL_CORE,
             "if self.reserved - self.cached + size > self.cap:", "if False:",
             PROBE + "[pool-over-the-limit-keeps-the-cache]"),
    _issue27("close() while blocks are lent", POOL_PYX, "if self.lent:", "if False:",
             "tests/test_pool.py::test_close_gives_everything_back_refuses_while_in_use_and_is_"
             "idempotent"),
    _issue27("advance() reading its clock after counting tokens", SCHED_PY,
             "            if finishing:  # every clock read before the first change\n"
             "                now, cache_now = self._finished.now(), self.cache._now()\n",
             "            if finishing:\n                now, cache_now = 0, 0\n",
             PROBE + "[scheduler-advance-clock-noon]",
             SCHED + "test_an_advance_whose_clock_fails_changes_nothing"),
    _issue27("a clock that is not callable", RECORDS, 'checks.function(clock, "clock",',
             '(lambda value, *_: value)(clock, "clock",', PROBE + "[scheduler-clock-int]"),
    _issue27("a negative or NaN finished_ttl_s", RECORDS,
             'checks.real(ttl_s, "finished_ttl_s", 0.0)', "ttl_s",
             PROBE + "[scheduler-ttl-negative]"),
    _issue27("requests writable after submit", "rocmforge_raw/cache/scheduler/requests.py",
             'if self.__dict__.get("_owner") is not None:', "if False:",
             PROBE + "[scheduler-mutate-after-submit]",
             SCHED + "test_a_submitted_request_is_read_only_until_it_finishes_or_is_aborted"),
    _issue27("negative preemptions or overtaken counts", SCHED_PY,
             '1 if f.name.endswith("tokens") else 0)', '1 if f.name.endswith("tokens") else '
             'None)', PROBE + "[scheduler-overtaken-negative]"),
    _issue27("abort() keeping the KV", SCHED_PY, "self.cache.remove(request_id)  #", "pass  #",
             SCHED + "test_abort_drops_a_request_in_any_state_frees_its_kv_once_and_records_"
             "why"),
    _issue27("step() not naming a sequence that left the cache", SCHED_PY,
             "            self._check_running(held)\n", "",
             PROBE + "[scheduler-step-after-outside-finish]"),
    _issue27("needless victims kept", ROWS, "for victim in victims[-2::-1]:",
             "for victim in []:",
             PREFIX_TESTS + "test_preemption_spares_a_sequence_whose_blocks_the_new_prompt_"
             "shares"),
    _issue27("negative token ids", "rocmforge_raw/cache/blocks/prefix.py",
             'if array.dtype.kind == "i" and int(array.min()) < 0:', "if False:",
             PROBE + "[prefix-negative-ids]"),
    _issue27("fp8 scales outside float32", PLANNING, "if not low <= number <= high:",
             "if not 0.0 < number < math.inf:", PROBE + "[fp8-scale-too-small]",
             PROBE + "[fp8-ops-k-scale-too-small]"),
    _issue27("a set as a (k, v) pair", "rocmforge_raw/cache/config.py",
             'checks.ordered(pair, f"kv_scales[{layer}]", "a (k_scale, v_scale) pair")',
             "list(pair)", PROBE + "[fp8-scale-a-set]"),
    _issue27("fp8 keys into an fp8 cache", PLANNING,
             "(cache == act and cache not in FP8_DTYPES)", "cache == act",
             PROBE + "[fp8-keys-into-an-fp8-cache]"),
    _issue27("a softmax scale past float32", PLANNING, 'checks.float32(scale, "scale")',
             'checks.real(scale, "scale")', PROBE + "[step-scale-1e300]"),
    _issue27("the first attention() planning before its checks", STEP_PY,
             "            self._check_heads(q_shape[1])\n",
             "            self._plan_attention(meta, q_shape[1])\n",
             PROBE + "[step-first-attention-bad-out-plans-nothing]"),
    _issue27("out aliasing the slab", STEP_PY,
             '            self._outside_slab("out", out_ptr, q_bytes)\n',
             "            pass\n", PROBE + "[step-out-aliases-the-slab]"),
    _issue27("out aliasing the query (ops)", "rocmforge_raw/kernels/ops.py",
             'check_disjoint(out, "out", query=query, k_cache=k_cache, v_cache=v_cache)',
             "pass", PROBE + "[ops-out-is-the-query]"),
    _issue27("a plan's stream compared before it is checked",
             "rocmforge_raw/cache/step/launches.py",
             'stream_handle(stream, "stream", self.slab.backend, self.slab.device)  # a Stream?',
             "pass", PROBE + "[step-write-stream-int]"),
    _issue27("plans writable", "rocmforge_raw/cache/step/metadata.py",
             "@dataclass(eq=False, frozen=True)",
             "@dataclass(eq=False)", PROBE + "[step-plan-frozen]"),
    _issue27("unbounded drift flags", "rocmforge_raw/cli/main.py",
             "MAX_DRIFT_MIB = float(1 << 20)",
             'MAX_DRIFT_MIB = float("inf")', PROBE + "[cli-soak-drift-1e308]"),
    _issue27("--minutes checked as seconds", "rocmforge_raw/cli/main.py",
             "type=flags.real(above=0.0, at_most=MAX_SECONDS / 60)", "type=flags.real(above=0.0)",
             PROBE + "[cli-soak-minutes-1e308]"),
]

def _issue44(name: str, path: str, old: str, new: str, *tests: str, anchor: str = ""
             ) -> Mutant:
    return Mutant(f"issue 44: {name}", path, old, new, tests, anchor)


TIERS = "rocmforge_raw/cache/tiers/"
EVENTS = "tests/test_mutants_tiers_events.py::"
NAMED += [
    _issue44("HostTier.clear forgetting blocks without freeing them", TIERS + "host_tier.py",
             "            self._free.append(block)\n        self._cached.clear()",
             "            pass\n        self._cached.clear()",
             "tests/test_cache_events.py::test_clearing_the_prefix_cache_is_one_event_and_"
             "needs_an_empty_cache"),
    _issue44("clear_prefix_cache leaving the host tier's prefixes", TIERS + "tiered.py",
             "            self._host.clear()", "            pass",
             "tests/test_cache_events.py::test_clearing_the_prefix_cache_is_one_event_and_"
             "needs_an_empty_cache"),
    _issue44("a reused prefix block unannounced without a host tier (the events' memory "
             "grows)", "rocmforge_raw/cache/core.py",
             "        for _, digest in self.pool.evicted:\n            self._events.removed(",
             "        for _, digest in ():\n            self._events.removed(",
             "tests/test_cache_events.py::test_without_a_host_tier_a_reused_prefix_block_is_"
             "announced_removed_and_forgotten"),
    _issue44("an undone allocation's removals announced all the same",
             "rocmforge_raw/cache/core.py",
             "                self._events.truncate(self._allocation_mark)\n",
             "                pass\n",
             "tests/test_atomicity.py::test_a_failed_copy_on_write_copy_undoes_the_whole_append"),
    _issue44("a failed copy-on-write copy's reused blocks keeping their prefixes",
             "rocmforge_raw/cache/core.py",
             "                for digest in self.pool.forget(dst):\n",
             "                for digest in self.pool.forget(dst[:0]):\n",
             "tests/test_atomicity.py::test_a_copy_on_write_copy_that_wrote_before_failing_"
             "leaves_no_stale_prefix"),
    _issue44("touching spans refused as overlapping", "rocmforge_raw/kernels/ops.py",
             ".sum(1) > src_start)", ".sum(1) >= src_start)",
             "tests/test_span_copies.py::test_spans_that_only_touch_in_one_buffer_copy"),
    _issue44("the overlap check by root only", "rocmforge_raw/kernels/ops.py",
             "if src.ptr < dst.ptr + dst.nbytes and dst.ptr < src.ptr + src.nbytes:",
             "if src.root is dst.root:",
             "tests/test_span_copies.py::test_two_imports_of_one_handle_are_one_memory_to_the_"
             "overlap_check"),
    _issue44("a submitted prompt kept as the caller's array", SCHED_PY,
             'prefix.token_ids(request.tokens, f"{name} tokens").copy()',
             'prefix.token_ids(request.tokens, f"{name} tokens")',
             SCHED + "test_a_submitted_prompt_is_the_schedulers_own_copy"),
    _issue44("advance taking any int64 id", SCHED_PY,
             'prefix.token_ids(ids, "token_ids", least=-1)', "ids.astype(np.int64)",
             SCHED + "test_advance_refuses_ids_that_no_later_step_could_take"),
    _issue44("a closed transport working on", "rocmforge_raw/cache/transfer/transport.py",
             "        if self._closed:\n", "        if False:\n",
             "tests/test_transfer.py::test_a_closed_transport_publishes_and_reads_no_more"),
    _issue44("a swapped request removed outside left waiting for a swap-in", SCHED_PY,
             "            self._moved_outside(held)\n", "",
             SCHED + "test_a_swapped_out_request_whose_sequence_was_moved_outside_still_"
             "finishes", SCHED + "test_a_running_request_swapped_out_outside_waits_to_be_"
             "swapped_back_in"),
    _issue44("the last importer's close keeping the lease", "rocmforge_raw/memory/ipc.py",
             "                os.close(self.fd)  # releases", "                pass  # releases",
             "tests/test_ipc.py::test_the_last_importer_letting_go_lets_the_exporter_free_"
             "while_it_lives"),
    _issue44("IpcTransport.close dropping its mappings unclosed", "rocmforge_raw/transport/ipc.py",
             "self._mapped.popitem()[1].close()", "self._mapped.popitem()",
             "tests/test_transfer.py::test_closing_an_ipc_transport_unmaps_what_it_mapped"),
    _issue44("published() listing a collected transport's endpoints",
             "rocmforge_raw/cache/transfer/transport.py",
             "if (live := transport()) is not None and not live.closed}", "if True}",
             "tests/test_transfer.py::test_endpoints_of_a_collected_transport_are_not_listed"),
    _issue44("an evicted prefix on the host tier not refreshed", TIERS + "tiered.py",
             "                host.touch(host.index[digest])", "                pass",
             "tests/test_host_tier.py::test_a_device_prefix_evicted_while_on_the_host_tier_"
             "becomes_its_most_recent"),
    _issue44("a wholly found import's shared last block taken as private",
             "rocmforge_raw/cache/transfer/sequences.py", "len(hits) == need, now)",
             "False, now)",
             "tests/test_transfer.py::test_a_sequence_the_receiver_holds_whole_reads_nothing"),
    _issue44("an undone operation's events published", "rocmforge_raw/cache/events.py",
             "        del self.pending[mark:]\n", "        pass\n",
             "tests/test_cache_events.py::test_an_undone_operation_announces_only_what_it_"
             "forgot"),
    _issue44("a description's num_blocks trusted", "rocmforge_raw/cache/transfer/sequences.py",
             "if slab != desc.num_blocks * config.block_bytes:", "if False:",
             "tests/test_transfer.py::test_altered_or_inconsistent_descriptions_are_refused"),
    _issue44("a mapped handle imported again after its exporter exited",
             "rocmforge_raw/memory/ipc.py", "            _check_alive(handle)\n        mapping",
             "            pass\n        mapping",
             "tests/test_ipc.py::test_a_handle_mapped_here_is_not_imported_anew_once_its_"
             "exporter_exited"),
    _issue44("an imported block's tokens not learnt while a tier holds it",
             "rocmforge_raw/cache/events.py", "if not known[1] and tokens is not None:",
             "if not known[2] and tokens is not None:",
             EVENTS + "test_an_imported_block_named_by_a_prompt_is_announced_with_its_tokens"),
    _issue44("a failed promotion forgetting the host blocks it read", TIERS + "tiered.py",
             "self._forget_reached(into, list(to))",
             "self._forget_reached(into, list(to) + back_from)",
             EVENTS + "test_a_failed_promotion_keeps_the_host_blocks_it_read_from_and_forgets_"
             "nothing_else"),
    _issue44("a promotion's device blocks recorded as host blocks for a restore",
             TIERS + "tiered.py", "self._reached[0].extend(into)",
             "self._reached[1].extend(into)",
             EVENTS + "test_a_restore_after_a_promotions_copies_forgets_the_device_blocks_they_"
             "wrote"),
]

# Operator swaps for the generated core mutants: (pattern, replacement), one site at a time.
OPERATORS = [(" < ", " <= "), (" <= ", " < "), (" > ", " >= "), (" >= ", " > "),
             (" == ", " != "), (" != ", " == "), (" + ", " - "), (" - ", " + "),
             (" += ", " -= "), (" -= ", " += "), (" and ", " or "), (" or ", " and "),
             ("if not ", "if "), ("return True", "return False"), ("return False", "return True")]
_ROWS_TESTS = ("tests/test_steprows.py", "tests/test_cache.py", "tests/test_cache_contracts.py",
               "tests/test_step_plans.py", "tests/test_plan_reference.py")
CORE = {"memory/_freelist.pxd": POOL_TESTS, "memory/_pool_core.pyx": POOL_TESTS,
        "memory/pool.pyx": POOL_TESTS,
        "memory/_registry.pyx": ("tests/test_buffer.py", "tests/test_core.py",
                                 "tests/test_pool.py"),
        "memory/buffer.pyx": ("tests/test_buffer.py", "tests/test_core.py"),
        "cache/blocks/_tables.pyx": _ROWS_TESTS, "cache/blocks/_rows.pyx": _ROWS_TESTS,
        "kernels/_pack.pyx": ("tests/test_steprows.py", "tests/test_step_plans.py"),
        "kernels/planning/_worksplit.pyx": ("tests/test_step_plans.py", "tests/test_ops.py",
                                            "tests/test_graph.py"),
        "kernels/planning/_prefill.pyx": ("tests/test_plan_reference.py",
                                          "tests/test_multi_token.py")}

#: Where a .pxd's inline code is compiled (its .c and .so are put back after a mutant).
COMPILED_INTO = {"rocmforge_raw/memory/_freelist.pxd": "rocmforge_raw/memory/_pool_core"}


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
