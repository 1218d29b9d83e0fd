"""Deterministic guards of the cache's contracts, one per change that once went unnoticed.

Each test here fails, every run, when the change named in its docstring is made to the code
(``tools/mutants.py`` applies each one and checks that). The lock tests do not race threads:
they wrap the cache's (or scheduler's) state in guards that assert, on every access, that
the calling thread holds the lock, then run every public operation once.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from rocmforge_raw import cache as cache_module
from rocmforge_raw.cache import BlockPool, CacheConfig, KvCache, Request, Scheduler
from rocmforge_raw.cache.blocks.rows import SequenceRows
from rocmforge_raw.cache.records import FinishedRecords
from rocmforge_raw.memory.array import DeviceArray


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def small_cache(num_blocks=9, block_size=8, **kw):
    return KvCache(CacheConfig(1, 1, 64, block_size, num_blocks, "float32", num_q_heads=2),
                   backend="host", **kw)


# --- one lock around each whole operation ----------------------------------------------------
class Guarded:
    """Stands in for ``target``: every use asserts that ``held()`` (the caller holds the
    owner's lock) and names what was touched without it."""

    def __init__(self, target, held, name):
        object.__setattr__(self, "_guard", (target, held, name))

    def _check(self, what):
        target, held, name = object.__getattribute__(self, "_guard")
        assert held(), f"{name}.{what} used without the lock"
        return target

    def __getattr__(self, attr):
        return getattr(self._check(attr), attr)

    def __setattr__(self, attr, value):
        setattr(self._check(attr), attr, value)

    def __len__(self):
        return len(self._check("__len__"))

    def __iter__(self):
        return iter(self._check("__iter__"))

    def __contains__(self, item):
        return item in self._check("__contains__")

    def __getitem__(self, key):
        return self._check("__getitem__")[key]

    def __setitem__(self, key, value):
        self._check("__setitem__")[key] = value

    def __delitem__(self, key):
        del self._check("__delitem__")[key]

    def __bool__(self):
        return bool(self._check("__bool__"))


def guarded(owner, held, names):
    """Replace ``owner``'s attributes ``names`` with guards; returns a function that puts
    the originals back (where the operation did not replace the attribute itself)."""
    guards = {name: Guarded(getattr(owner, name), held, name) for name in names}
    for name, guard in guards.items():
        setattr(owner, name, guard)

    def undo():
        for name, guard in guards.items():
            if getattr(owner, name) is guard:
                setattr(owner, name, object.__getattribute__(guard, "_guard")[0])
    return undo


def run_guarded(owner, held, names, ops):
    """Run each (name, call) of ``ops`` with ``owner``'s state ``names`` guarded."""
    for name, op in ops:
        undo = guarded(owner, held, names)
        try:
            op()
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
        finally:
            undo()


CACHE_STATE = ("_rows", "pool", "_finished", "_steps")


def cache_operations(cache):
    """Every public KvCache operation, as (name, call) pairs, in an order that works."""
    c = cache.config
    new = np.ones((2, c.num_kv_heads, c.head_dim), np.float32)
    key = DeviceArray.from_numpy(new, backend="host")
    query = DeviceArray.from_numpy(np.ones((2, 2, c.head_dim), np.float32), backend="host")
    out = DeviceArray.empty((2, 2, c.head_dim), np.float32, backend="host")
    arrays = (key, query, out)
    state = {}
    ops = [
        ("add_sequence", lambda: state.update(a=cache.add_sequence("a", 9).slot_mapping)),
        ("write (slots)", lambda: cache.write(0, key, key, state["a"][:2])),
        ("add_sequence b", lambda: cache.add_sequence("b", 16)),
        ("append", lambda: cache.append(["a", "b"])),
        ("fork", lambda: cache.fork("b", "c")),
        ("append (copy-on-write)", lambda: cache.append(["c"])),
        ("batch", lambda: state.update(meta=cache.batch(["a", "b"]))),
        ("write (plan)", lambda: cache.write(0, key, key, state["meta"])),
        ("attention", lambda: cache.attention(0, out, query, state["meta"])),
        ("__contains__", lambda: "a" in cache),
        ("__len__", lambda: len(cache)),
        ("seq_ids", cache.seq_ids),
        ("seq_len", lambda: cache.seq_len("a")),
        ("block_ids", lambda: cache.block_ids("a")),
        ("times", lambda: cache.times("a")),
        ("can_allocate", lambda: cache.can_allocate(8)),
        ("can_append", lambda: cache.can_append(["a"])),
        ("k_cache", lambda: cache.k_cache(0)),
        ("v_cache", lambda: cache.v_cache(0)),
        ("finish", lambda: cache.finish("c")),
        ("remove", lambda: cache.remove("b")),
        ("finished", cache.finished),
        ("stats", cache.stats),
        ("check_invariants", cache.check_invariants),
        ("close", cache.close),
    ]
    return ops, arrays


def test_every_cache_operation_holds_the_lock_throughout():
    """Killed by: the lock removed from any operation (add_sequence, append, ...)."""
    clock_calls = []

    def clock():
        clock_calls.append(cache._lock._is_owned())
        return 1.0

    cache = small_cache(num_blocks=12, clock=clock)
    ops, arrays = cache_operations(cache)
    try:
        run_guarded(cache, cache._lock._is_owned, CACHE_STATE, ops)
    finally:
        for array in arrays:
            array.buffer.close()
        cache.close()
    assert clock_calls and all(clock_calls)


def test_every_scheduler_operation_holds_its_lock_throughout():
    """Killed by: the lock removed from submit, step, advance, finished or idle."""
    cache = small_cache(num_blocks=12)
    sched = Scheduler(cache)
    state = {}
    ops = [
        ("submit", lambda: sched.submit(Request("a", 5, 2))),
        ("try_submit", lambda: sched.try_submit(Request("b", 9, 1))),
        ("step", lambda: state.update(plan=sched.step())),
        ("advance", lambda: sched.advance(state["plan"])),
        ("step again", lambda: state.update(plan=sched.step())),
        ("advance again", lambda: sched.advance(state["plan"])),
        ("finished", sched.finished),
        ("idle", lambda: sched.idle),
    ]
    run_guarded(sched, sched._lock.locked, ("cache", "_waiting", "_running", "_finished"), ops)
    assert sorted(sched.finished()) == ["a", "b"] and sched.idle
    cache.close()


# --- the block pool --------------------------------------------------------------------------
def test_sharing_a_block_not_held_is_refused_and_changes_nothing():
    """Killed by: BlockPool.share without its held check."""
    pool = BlockPool(5)
    held = pool.allocate(1)
    refs = pool.ref_cnt.copy()
    with pytest.raises(ValueError, match="cannot share block 2: it is not held"):
        pool.share(np.array([held[0], 2]))
    np.testing.assert_array_equal(pool.ref_cnt, refs)


@pytest.mark.parametrize("what", ["free", "share"])
def test_a_block_id_past_the_last_is_refused_naming_it(what):
    """Killed by: the upper bound ``ids.max() >= num_blocks`` weakened to ``>``."""
    pool = BlockPool(5)
    pool.allocate(4)
    refs = pool.ref_cnt.copy()
    with pytest.raises(ValueError, match=rf"cannot {what} block 5: ids run 1\.\.4"):
        getattr(pool, what)(np.array([1, 5]))
    np.testing.assert_array_equal(pool.ref_cnt, refs)


def test_allocating_more_blocks_than_are_free_returns_none_and_changes_nothing():
    """Killed by: allocate handing out more than the free count."""
    pool = BlockPool(4)  # three usable blocks
    assert pool.allocate(4) is None
    assert pool.num_free == 3 and (pool.ref_cnt[1:] == 0).all()
    np.testing.assert_array_equal(pool.allocate(3), [1, 2, 3])
    assert pool.allocate(1) is None and pool.num_free == 0
    assert pool.allocate(0).size == 0


@pytest.mark.parametrize("num_blocks, ok", [(((1 << 31) - 1) // 8, True), (1 << 31, False)])
def test_num_blocks_stops_at_the_largest_int32_block_id(num_blocks, ok):
    """Killed by: the int32 bound on num_blocks moved or dropped (block tables are int32;
    below it, the int32 rows of a plane bound num_blocks * kv heads * block_size)."""
    if ok:
        assert CacheConfig(1, 1, 64, 8, num_blocks, "float32").num_blocks == num_blocks
    else:
        with pytest.raises(ValueError, match=rf"num_blocks must be <= 2147483647, "
                                             rf"got {num_blocks}"):
            CacheConfig(1, 1, 64, 8, num_blocks, "float32")


# --- check-then-act --------------------------------------------------------------------------
def test_can_append_answers_for_the_sequences_it_is_given():
    """Killed by: can_append ignoring its argument."""
    with small_cache(num_blocks=3) as cache:  # two usable blocks of 8 tokens
        cache.add_sequence("full", 8)  # its next token needs a new block
        cache.add_sequence("room", 3)  # its next token fits its block
        assert cache.stats()["free_blocks"] == 0
        assert cache.can_append(["room"]) and cache.can_append([])
        assert not cache.can_append(["full"]) and not cache.can_append(["room", "full"])
        assert not cache.can_append(["room", "gone"]) and not cache.can_append(["room"] * 2)


# --- records, times and recency --------------------------------------------------------------
def test_finished_records_are_pruned_when_added_not_only_when_read():
    """Killed by: FinishedRecords.add not pruning (records grow until someone reads)."""
    clock = FakeClock(0.0)
    records = FinishedRecords(3, 60.0, clock)
    for i in range(10):
        records.add(i, i)
    assert len(records) == 3
    clock.now = 61.0
    records.add("late", 0)
    assert len(records) == 1 and records.snapshot() == {"late": 0}


def test_times_record_creation_and_every_access():
    """Killed by: times() or the recorded times wrong; append not refreshing the access."""
    clock = FakeClock()
    with small_cache(clock=clock) as cache:
        cache.add_sequence("a", 3)
        assert cache.times("a") == (1000.0, 1000.0)
        clock.now = 1005.0
        cache.append(["a"])
        assert cache.times("a") == (1000.0, 1005.0)
        clock.now = 1007.0
        cache.batch(["a"])
        assert cache.times("a") == (1000.0, 1007.0)
        clock.now = 1010.0
        cache.fork("a", "b")
        assert cache.times("b") == (1010.0, 1010.0) and cache.times("a") == (1000.0, 1010.0)
        with pytest.raises(KeyError, match="no sequence 'zz'"):
            cache.times("zz")


def test_append_makes_a_sequence_the_most_recently_used():
    """Killed by: append not refreshing recency (the clock stands still: only order counts)."""
    with small_cache(num_blocks=4, clock=FakeClock()) as cache:  # three usable blocks
        cache.add_sequence("old", 4)
        cache.add_sequence("new", 4)
        cache.append(["old"])  # now "new" is the least recently used
        assert cache.add_sequence("big", 16).preempted == ["new"]


def test_preemption_takes_sequences_outside_the_append_before_its_members():
    """Killed by: _make_room choosing victims among the append's own sequences first."""
    with small_cache(num_blocks=3, clock=FakeClock()) as cache:
        cache.add_sequence("member", 8)  # least recently used, but appending now
        cache.add_sequence("other", 8)
        reservation = cache.append(["member"])
        assert reservation.preempted == ["other"] and reservation.slot_mapping[0] >= 0
        assert "member" in cache and cache.seq_len("member") == 9


# --- slots and the row memo --------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 20])
def test_the_plan_after_add_sequence_maps_the_last_prompt_slot(num_tokens):
    """Killed by: the last slot computed without ``% block_size`` in add_sequence."""
    with small_cache(num_blocks=6) as cache:
        slots = cache.add_sequence("a", num_tokens).slot_mapping
        assert cache.batch(["a"]).slot_mapping.tolist() == [slots[-1]]
        last = cache.block_ids("a")[-1]
        assert slots[-1] == last * 8 + (num_tokens - 1) % 8


def test_a_plan_after_remove_never_reuses_the_freed_rows():
    """Killed by: the row memo ignoring the version (batch after remove returns the freed
    row's metadata)."""
    with small_cache(num_blocks=12) as cache:
        cache.add_sequence("a", 3)
        cache.add_sequence("b", 5)
        cache.batch(["a", "b"])
        cache.remove("a")
        with pytest.raises(KeyError, match="no sequence 'a'"):
            cache.batch(["a", "b"])
        cache.add_sequence("c", 11)  # takes a's old row
        cache.add_sequence("a", 2)
        assert cache.batch(["a", "b"]).seq_lens.tolist() == [2, 5]


def test_the_row_memo_answers_only_for_the_same_ids():
    """Killed by: the memo matching on the version alone."""
    rows = SequenceRows()
    rows.add("x", 1)
    rows.add("y", 1)
    assert rows.rows(["x"]).tolist() == [rows.index["x"]]
    assert rows.rows(["y"]).tolist() == [rows.index["y"]]
    assert rows.rows(["x", "x"]).tolist() == [rows.index["x"]] * 2 and not rows.distinct()


# --- the public API is documented ------------------------------------------------------------
def _public_members(cls):
    for name, member in vars(cls).items():
        if not name.isascii():  # mutmut keeps the original and mutants under such names
            continue
        if not name.startswith("_") and (inspect.isfunction(member)
                                         or isinstance(member, property)):
            yield name, member


@pytest.mark.parametrize("cls", [getattr(cache_module, name) for name in cache_module.__all__
                                 if inspect.isclass(getattr(cache_module, name))])
def test_every_public_class_and_method_of_the_cache_has_a_docstring(cls):
    """Killed by: a docstring deleted (append's, for one)."""
    assert (cls.__doc__ or "").strip(), f"{cls.__name__} has no docstring"
    if cls.__module__.startswith("rocmforge_raw.errors"):
        return
    missing = [name for name, member in _public_members(cls) if not (member.__doc__ or "")
               .strip()]
    assert not missing, f"{cls.__name__}: no docstring on {', '.join(missing)}"


# every public operation that takes a sequence id (or a list of them) as its first argument,
# with what else it needs; an unhashable id must be refused by name, on a cache with a host
# tier and without one
ID_OPERATIONS = [("add_sequence", (4,)), ("append", ()), ("batch", ()), ("block_ids", ()),
                 ("can_append", ()), ("can_swap_in", ()), ("export_sequence", ()),
                 ("extend", ([1],)), ("finish", ()), ("fork", ("child",)), ("is_swapped", ()),
                 ("remove", ()), ("room", ()), ("seq_len", ()), ("swap_in", ()),
                 ("swap_out", ()), ("times", ())]


def test_every_id_operation_is_listed():
    takes_ids = {name for name in dir(KvCache) if not name.startswith("_")
                 and name.isascii()  # mutmut keeps the original and mutants under such names
                 and callable(getattr(KvCache, name))
                 and (params := list(inspect.signature(getattr(KvCache, name)).parameters))[1:]
                 and params[1] in ("seq_id", "seq_ids", "parent_id")}
    assert takes_ids == {name for name, _ in ID_OPERATIONS}


@pytest.mark.parametrize("host_blocks", [0, 8])
@pytest.mark.parametrize("name, rest", ID_OPERATIONS, ids=[n for n, _ in ID_OPERATIONS])
def test_an_unhashable_id_is_refused_by_name(name, rest, host_blocks):
    cache = KvCache(CacheConfig(1, 1, 64, 16, 32, np.float32, host_blocks=host_blocks),
                    backend="host")
    cache.add_sequence("a", 20)
    before = cache.stats()
    takes_list = name in ("append", "batch", "can_append", "can_swap_in", "extend",
                          "swap_in", "swap_out")
    with pytest.raises(TypeError, match=r"hashable.*\['a'\]|\['a'\].*hashable"):
        getattr(cache, name)([["a"]] if takes_list else ["a"], *rest)
    assert cache.stats() == before and cache.seq_ids() == ["a"]
    cache.close()
