"""The compiled core of a decode step's bookkeeping (``cache.blocks._tables``, ``_rows``) and
its packing (``kernels._pack``) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from rocmforge_raw.cache.blocks._rows import COW, GROW, PLAIN
from rocmforge_raw.cache.blocks.rows import SequenceRows


def _filled(rng, rows=40, width=8, block_size=16, num_blocks=500):
    """Rows with random lengths and distinct random blocks, as a cache leaves them."""
    table = SequenceRows(rows, width)
    ids = rng.permutation(np.arange(1, num_blocks))
    used = 0
    for row in range(rows):
        length = int(rng.integers(1, width * block_size))
        count = -(-length // block_size)
        table.tables[row, :count] = ids[used : used + count]
        table.lens[row], table.nblocks[row] = length, count
        table.last_block[row] = table.tables[row, count - 1]
        table.last_slot[row] = -1
        used += count
    return table


def test_gather_equals_numpy_fancy_indexing(rng):
    table = _filled(rng)
    rows = rng.permutation(40)[:25].astype(np.int64)
    tables, lens, slots = table.gather(rows, 500, 16)
    width = int(table.nblocks[rows].max())
    np.testing.assert_array_equal(tables, table.tables[rows, :width])
    np.testing.assert_array_equal(lens, table.lens[rows].astype(np.int32))
    np.testing.assert_array_equal(slots, table.last_slot[rows])
    assert tables.dtype == lens.dtype == np.int32 and slots.dtype == np.int64


def test_gather_hands_out_read_only_arrays(rng):
    table = _filled(rng)
    for array in table.gather(np.arange(5, dtype=np.int64), 500, 16)[:3]:
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1


def test_gather_of_no_rows_is_one_empty_column(rng):
    tables, lens, slots = _filled(rng).gather(np.zeros(0, np.int64), 500, 16)
    assert tables.shape == (0, 1) and lens.shape == slots.shape == (0,)


@pytest.mark.parametrize("corrupt, message", [
    (lambda t: t.tables.__setitem__((3, 0), 500), "block id 500 in block_tables is outside"),
    (lambda t: t.tables.__setitem__((3, 0), -2), "block id -2 in block_tables is outside"),
    (lambda t: t.lens.__setitem__(3, t.nblocks[3] * 16 + 1), "holds .* tokens in .* blocks of 16"),
])
def test_gather_says_how_broken_bookkeeping_is_broken(rng, corrupt, message):
    table = _filled(rng)
    corrupt(table)
    with pytest.raises(ValueError, match=message):
        table.gather(np.arange(10, dtype=np.int64), 500, 16)


def test_need_and_extend_equal_the_rules_in_numpy(rng):
    table = _filled(rng)
    ref_cnt = np.ones(500, np.int32)
    shared = table.last_block[[4, 7]]
    ref_cnt[shared] = 2  # rows 4 and 7 end in blocks shared with someone outside the batch
    rows = np.arange(0, 40, 2, dtype=np.int64)
    before = {name: getattr(table, name).copy() for name in ("tables", "lens", "nblocks")}
    total, kinds, copies = table.append_need(rows, ref_cnt, 16)
    full = before["lens"][rows] % 16 == 0
    want = np.where(full, GROW, np.where(ref_cnt[table.last_block[rows]] > 1, COW, PLAIN))
    np.testing.assert_array_equal(kinds, want)
    assert total == int((want != PLAIN).sum()) and copies == int((want == COW).sum())
    new = np.arange(600, 600 + total, dtype=np.int32)
    slots = table.extend(rows, kinds, new, 16, 2.5)
    grown, copied = rows[kinds == GROW], rows[kinds == COW]
    np.testing.assert_array_equal(table.tables[grown, before["nblocks"][grown]],
                                  new[: grown.size])
    np.testing.assert_array_equal(table.tables[copied, before["nblocks"][copied] - 1],
                                  new[grown.size :])
    np.testing.assert_array_equal(table.lens[rows], before["lens"][rows] + 1)
    np.testing.assert_array_equal(slots, table.last_block[rows] * 16 + before["lens"][rows] % 16)
    assert (table.accessed[rows] == 2.5).all()
    assert (np.diff(table.recency[rows]) == 1).all()  # later in the list: more recent
    untouched = np.setdiff1d(np.arange(40), rows)
    np.testing.assert_array_equal(table.lens[untouched], before["lens"][untouched])


def _state(table, free, ref_cnt):
    arrays = {name: getattr(table, name).copy() for name in
              ("tables", "lens", "nblocks", "last_slot", "last_block", "accessed", "recency")}
    return arrays, free.copy(), ref_cnt.copy(), table.tick


def _same(a, b):
    for name in a[0]:
        np.testing.assert_array_equal(a[0][name], b[0][name], err_msg=name)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])
    assert a[3] == b[3]


@pytest.mark.parametrize("seed", range(6))
def test_append_plain_equals_need_pop_and_extend(seed):
    """The common append in one call leaves the rows, the stack's blocks and the ref counts
    as ``append_need``, ``pop_blocks`` and ``extend`` do, and the same slots."""
    from rocmforge_raw.cache.blocks._rows import pop_blocks

    rng = np.random.default_rng(seed)
    table, twin = _filled(rng), SequenceRows(40, 64)
    table.widen(64)
    for name in ("tables", "lens", "nblocks", "last_slot", "last_block"):
        getattr(twin, name)[:] = getattr(table, name)
    used = np.unique(table.tables)
    free = np.setdiff1d(np.arange(1, 500, dtype=np.int32), used)[::-1].copy()
    ref_cnt = np.zeros(500, np.int32)
    ref_cnt[used[used > 0]] = 1
    free2, ref2 = free.copy(), ref_cnt.copy()
    rows = rng.permutation(40)[: int(rng.integers(1, 41))].astype(np.int64)
    for step in range(40):
        slots = np.empty(rows.size, np.int64)
        top = free.size
        popped = table.append_plain(rows, free, top, ref_cnt, 16, 3.0 + step, slots)
        total, kinds, copies = twin.append_need(rows, ref2, 16)
        assert copies == 0 and popped == total
        new = pop_blocks(free2, top, total, ref2)
        want = twin.extend(rows, kinds, new, 16, 3.0 + step)
        np.testing.assert_array_equal(slots, want)
        _same(_state(table, free, ref_cnt), _state(twin, free2, ref2))
        free, free2 = free[:top - popped].copy(), free2[:top - total].copy()


@pytest.mark.parametrize("case", ["shared last block", "full table", "short stack"])
def test_append_plain_changes_nothing_where_the_common_case_does_not_hold(case):
    table = SequenceRows(4, 2)
    table.tables[0, :2], table.tables[1, :1] = [5, 6], [7]
    table.lens[:2], table.nblocks[:2], table.last_block[:2] = [20, 16], [2, 1], [6, 7]
    ref_cnt = np.ones(10, np.int32)
    free = np.array([9, 8], np.int32)
    rows = np.array([0, 1], np.int64)
    if case == "shared last block":
        ref_cnt[6] = 2
    elif case == "full table":
        table.lens[0] = 32
    else:
        free = free[:0]
    before = _state(table, free, ref_cnt)
    slots = np.zeros(2, np.int64)
    assert table.append_plain(rows, free, free.size, ref_cnt, 16, 1.0, slots) == -1
    _same(_state(table, free, ref_cnt), before)
    assert (slots == 0).all()


def test_extend_widens_full_tables_and_changes_nothing_before(rng):
    table = SequenceRows(4, 2)
    table.tables[1, :2] = [5, 6]
    table.lens[1], table.nblocks[1], table.last_block[1] = 32, 2, 6
    rows = np.array([1], np.int64)
    total, kinds, _ = table.append_need(rows, np.ones(10, np.int32), 16)
    assert total == 1 and kinds.tolist() == [GROW]
    slots = table.extend(rows, kinds, np.array([9], np.int32), 16, 1.0)
    assert table.tables.shape[1] == 4 and table.tables[1].tolist() == [5, 6, 9, 0]
    assert slots.tolist() == [9 * 16] and table.nblocks[1] == 3


def test_a_row_outside_the_arrays_is_refused_before_anything_changes():
    table = SequenceRows(4, 2)
    lens = table.lens.copy()
    for call in (lambda: table.touch(np.array([0, 4]), 1.0),
                 lambda: table.need(np.array([-1]), np.ones(4, np.int32), 16),
                 lambda: table.gather(np.array([9]), 4, 16)):
        with pytest.raises(IndexError, match="outside the 4 rows"):
            call()
    np.testing.assert_array_equal(table.lens, lens)
    assert table.tick == 0


@pytest.mark.parametrize("name, value, error", [
    ("lens", np.zeros(4, np.int32), "lens must be a 1-d int64 array"),
    ("tables", np.zeros(4, np.int32), "tables must be a 2-d int32 array"),
    ("accessed", [0.0] * 4, "accessed must be a NumPy array"),
    ("recency", np.zeros(8, np.int64)[::2], "recency must be C-contiguous"),
])
def test_the_arrays_take_only_what_the_c_loops_can_read(name, value, error):
    table = SequenceRows(4, 2)
    with pytest.raises((TypeError, ValueError), match=error):
        setattr(table, name, value)


def test_snapshots_are_patched_only_when_nobody_holds_them_and_always_equal_the_rows(rng):
    """A decode loop's snapshots are brought up to date in place (O(rows)), never one a plan
    still holds; whatever the cache does between steps, each batch's tables equal the rows'
    (read from a twin cache driven alike: reading them here would void the snapshots) and
    every held plan's tables stay as they were."""
    from rocmforge_raw.cache import CacheConfig, KvCache

    config = CacheConfig(1, 1, 64, 16, 600, "float32")
    with KvCache(config, backend="host") as cache, KvCache(config, backend="host") as twin:
        ids = [f"s{i}" for i in range(12)]
        for seq in ids:
            length = int(rng.integers(1, 60))
            cache.add_sequence(seq, length)
            twin.add_sequence(seq, length)
        held, made = [], 0
        for step in range(300):
            action = rng.random()
            for c in (cache, twin):
                if action < 0.03 and len(ids) > 3:
                    c.finish(ids[step % len(ids)])
                elif action < 0.05:
                    c.block_ids(ids[0])  # a Python use of the tables
            if action < 0.03 and len(ids) > 3:
                ids.remove(ids[step % len(ids)])
            twin.append(ids)
            cache.append(ids)
            if action > 0.9:  # shared last blocks, copied on the next append (patched then)
                cache.fork(ids[step % len(ids)], f"f{step}")
                twin.fork(ids[step % len(ids)], f"f{step}")
            meta = cache.batch(ids)
            made += 1
            rows = twin._rows.rows(ids)
            width = int(twin._rows.nblocks[rows].max())
            np.testing.assert_array_equal(meta.block_tables, twin._rows.tables[rows, :width])
            np.testing.assert_array_equal(meta.seq_lens, twin._rows.lens[rows])
            np.testing.assert_array_equal(meta.slot_mapping, twin._rows.last_slot[rows])
            kept = rng.random()
            if kept < 0.1:  # the plan, or only one of its arrays
                held.append((meta, meta.block_tables.copy(), meta.seq_lens.copy(),
                             meta.slot_mapping.copy()))
            elif kept < 0.2:
                which = ("block_tables", "seq_lens", "slot_mapping")[int(rng.integers(3))]
                array = getattr(meta, which)
                held.append((array, array.copy()))
        for got, *want in held:
            if len(want) == 1:
                np.testing.assert_array_equal(got, want[0])
            else:
                np.testing.assert_array_equal(got.block_tables, want[0])
                np.testing.assert_array_equal(got.seq_lens, want[1])
                np.testing.assert_array_equal(got.slot_mapping, want[2])
        assert 0 < cache._rows.patched < made


def test_a_python_write_to_the_tables_voids_the_snapshots(rng):
    table = _filled(rng)
    rows = np.arange(10, dtype=np.int64)
    for _ in range(3):  # the third gather patches the first's snapshot
        tables = table.gather(rows, 500, 16)[0]
    del tables
    table.tables[2, 0] = 499  # written the way a tier swap or a transfer would
    tables = table.gather(rows, 500, 16)[0]
    assert tables[2, 0] == 499


@pytest.mark.parametrize("nbytes", [0, 1, 2047, 2048, 2049, 3 * 2048 + 5, 150_000])
def test_copy_host_copies_every_byte_and_nothing_past_them(rng, nbytes):
    from rocmforge_raw.kernels._pack import copy_host

    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.full(nbytes + 64, 0xAB, np.uint8)
    copy_host(dst.ctypes.data, src)
    np.testing.assert_array_equal(dst[:nbytes], src)
    assert (dst[nbytes:] == 0xAB).all()


def test_copy_host_takes_any_dtype_and_refuses_strided_arrays():
    import ml_dtypes

    from rocmforge_raw.kernels._pack import copy_host

    src = np.linspace(-3, 3, 4000).astype(ml_dtypes.bfloat16).reshape(40, 100)
    dst = np.zeros_like(src)
    copy_host(dst.ctypes.data, src)
    assert (dst == src).all()
    with pytest.raises(ValueError, match="not C-contiguous"):
        copy_host(dst.ctypes.data, src[:, ::2])


def test_a_planned_batch_is_what_its_dataclass_init_makes():
    import dataclasses

    from rocmforge_raw.cache.step.metadata import BatchMetadata

    def arrays():
        made = np.zeros((2, 3), np.int32), np.ones(2, np.int32), np.full(2, -1, np.int64)
        for array in made:
            array.setflags(write=False)  # as gather hands them out
        return made

    made = BatchMetadata(("a", "b"), *arrays(), None, "owner", 7, _kv_shape=(2, 1, 64))
    planned = BatchMetadata._planned(dict(seq_ids=("a", "b"), block_tables=arrays()[0],
                                          seq_lens=arrays()[1], slot_mapping=arrays()[2],
                                          stream=None, _owner="owner", _epoch=7,
                                          _kv_shape=(2, 1, 64)))
    for f in dataclasses.fields(BatchMetadata):
        want, got = getattr(made, f.name), getattr(planned, f.name)
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
            assert not got.flags.writeable
        else:
            assert got == want, f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.seq_ids = ()


def test_a_plain_reservation_is_what_its_dataclass_init_makes():
    import dataclasses

    from rocmforge_raw.cache.kv_cache import Reservation

    slots = np.arange(3, dtype=np.int64)
    made, plain = Reservation(slots, []), Reservation._plain(slots)
    assert dataclasses.asdict(plain).keys() == dataclasses.asdict(made).keys()
    for f in dataclasses.fields(Reservation):
        assert getattr(plain, f.name) is slots if f.name == "slot_mapping" else (
            getattr(plain, f.name) == getattr(made, f.name)), f.name
    assert plain.swapped is not Reservation._plain(slots).swapped  # a list of its own
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.preempted = ["x"]
