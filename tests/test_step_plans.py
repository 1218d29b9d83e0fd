"""A decode step's plan for a GPU, checked on the CPU: the bytes ``batch`` uploads, the
arguments of the launches it prepares, and their reuse from step to step.

No GPU answers here, so the backend is a test double (``PretendGpu``): the host backend
(memory, copies, events) under a GPU's name and properties, whose modules load nothing and
whose launches are recorded, never run. Its "device" memory is host memory, so the
uploaded bytes can be read back at the addresses the launches pass. The GPU suite runs the
same plans on real devices (test_step, test_graph).
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.kernels import module
from rocmforge_raw.kernels._pack import pack_host, pack_step
from rocmforge_raw.kernels.module import pack_args
from rocmforge_raw.kernels.planning import (
    ALIGNED_SHARE_TOKENS,
    ALIGNED_STRETCH,
    ATTENTION_PATCH,
    MIN_TOKENS_PER_CTA,
    PAD_MARGIN,
    PIECE_COST_TOKENS,
    PIECE_QUANTUM_TOKENS,
    STEP_ARGS,
    WORK_GRANULE,
    WRITE_SLOTS_ARG,
    AttentionPlan,
    attention_kernel,
    plan_work,
    split_rule,
    step_arguments,
)
from rocmforge_raw.kernels.planning._worksplit import split_lengths
from rocmforge_raw.kernels.staging import Workspace
from rocmforge_raw.runtime.host import HostBackend


class PretendGpu(HostBackend):
    """The host backend as an H100 (132 SMs, two attention CTAs each) that launches
    nothing: each launch is recorded as (grid, arguments' addresses)."""

    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[tuple[tuple[int, int, int], int]] = []

    def properties(self, device):
        return dataclasses.replace(super().properties(device), backend="cuda", arch="sm_90",
                                   multiprocessors=132)

    def module_load(self, image, device):
        return object()

    def module_function(self, module, name):
        return 1

    def max_active_blocks(self, function, threads, shared_bytes):
        return 2

    def launch(self, function, grid, block, shared_bytes, stream, params_addr):
        self.launches.append((grid, params_addr))


@pytest.fixture
def double(monkeypatch):
    """A fresh ``PretendGpu``; the modules it loads stay out of the process's cache of
    loaded kernels (a real cuda backend in this process must not find them)."""
    monkeypatch.setattr(module, "_loaded", {})
    monkeypatch.setattr(module, "_origins", {})
    return PretendGpu()


class LeanGpu(PretendGpu):
    """``PretendGpu`` whose attention CTAs fit three a SM up to 70 KiB of dynamic shared
    memory and two beyond (as on an H100), recording each launch's shared bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.shared: list[int] = []

    def max_active_blocks(self, function, threads, shared_bytes):
        return 3 if shared_bytes <= 70 << 10 else 2

    def launch(self, function, grid, block, shared_bytes, stream, params_addr):
        super().launch(function, grid, block, shared_bytes, stream, params_addr)
        self.shared.append(shared_bytes)


def test_each_step_launches_at_the_occupancy_its_split_was_planned_for(monkeypatch):
    """A step whose long, even units fill two CTAs a SM better runs lean: its launch passes
    the lean shared memory, one CTA a unit, and asks no partial records; when one sequence
    grows far past the others the next step goes back to the natural occupancy's split, and
    back to lean once it is gone, each with the launch prepared for it."""
    monkeypatch.setattr(module, "_loaded", {})
    monkeypatch.setattr(module, "_origins", {})
    gpu = LeanGpu()
    config = CacheConfig(1, 8, 128, 16, 9000, "bfloat16", num_q_heads=32)
    with KvCache(config, backend=gpu) as cache:
        for seq in range(64):
            cache.add_sequence(seq, 2047)
        found = attention_kernel(gpu, 0, cache._steps.act, 128, 4, config.dtype)
        assert (found.slots, found.rule[2]) == (396, 264)
        assert found.lean_shared_bytes - 1024 <= 70 << 10 < found.lean_shared_bytes
        assert found.shared_bytes < found.lean_shared_bytes
        ids = list(range(64))
        for step, (lean, grid) in enumerate([(True, 512), (False, None), (True, 512)]):
            if step == 1:
                cache.finish(0)
                cache.add_sequence(100, 8000)
                ids[0] = 100
            if step == 2:
                cache.finish(100)
                cache.add_sequence(101, 2047)
                ids[0] = 101
            cache.append(ids)
            meta = cache.batch(ids)
            meta._attention(1, 2, 3, 4)
            work = plan_work(8, found.slots, 64, meta.seq_lens, sms=found.sms,
                             rule=found.rule)
            assert work.lean == lean and work.whole == lean
            assert gpu.shared[-1] == (found.lean_shared_bytes if lean else found.shared_bytes)
            assert gpu.launches[-1][0][0] == work.num_ctas == (grid or work.num_ctas)
            if step == 0:  # a fresh slot: a whole split asks no partial records
                assert meta._staging.workspace._partials.nbytes == 1


def _read(address, dtype, count):
    """``count`` elements of ``dtype`` at a "device" address of the double (host memory)."""
    nbytes = count * np.dtype(dtype).itemsize
    return np.frombuffer(ctypes.string_at(address, nbytes), dtype).copy()


def _cache(double, lens, num_q_heads=32):
    config = CacheConfig(2, 8, 128, 16, 4000, "bfloat16", num_q_heads=num_q_heads)
    cache = KvCache(config, backend=double)
    for seq, length in enumerate(lens):
        cache.add_sequence(seq, int(length))
    return cache


def _expected_attention(cache, meta, workspace):
    """The attention arguments (each as its 8-byte slot) and CTAs of a launch prepared for
    ``meta``'s step alone, and the work split it reads."""
    c, steps = cache.config, cache._steps
    found = attention_kernel(steps.backend, steps.device, steps.act, c.head_dim,
                             c.num_q_heads // c.num_kv_heads, c.dtype)
    n, width = meta.block_tables.shape
    work = plan_work(c.num_kv_heads * found.groups, found.slots, n, meta.seq_lens,
                     sms=found.sms, rule=found.rule)
    plan = AttentionPlan(found.kernel, found.group, work, found.shared_bytes, n,
                         c.num_q_heads, c.num_kv_heads, c.head_dim, c.block_size, width)
    launch = meta._attention
    tables_at, lens_at, _ = meta._addresses
    args = plan.arguments(0, 0, 0, 0, tables_at, lens_at, steps.default_scale,
                          workspace._partials.ptr, workspace._counters.ptr, launch.slot(8),
                          launch.slot(9))
    raw = pack_args(args).slots.raw
    slots = [int.from_bytes(raw[8 * i : 8 * i + 8], "little") for i in range(len(args))]
    return slots, work


def test_each_step_uploads_its_metadata_and_launches_with_its_own_arguments(double, rng):
    """Step after step (tables widening, a sequence finishing, new ones joining), the
    attention and write launches each slot prepared once are reused, and every argument
    equals what a launch prepared for that step alone passes; the addresses hold the
    step's tables, lengths, slots and work split."""
    lens = rng.integers(20, 200, 6)
    with _cache(double, lens) as cache:
        ids = list(range(6))
        launches = set()
        for step in range(120):
            if step == 40:
                cache.finish(ids.pop(2))
            if step == 80:
                cache.add_sequence(99, 500)
                ids.append(99)
            cache.append(ids)
            meta = cache.batch(ids)
            n, width = meta.block_tables.shape
            tables_at, lens_at, slots_at = meta._addresses
            np.testing.assert_array_equal(
                _read(tables_at, np.int32, n * width).reshape(n, width), meta.block_tables)
            np.testing.assert_array_equal(_read(lens_at, np.int32, n), meta.seq_lens)
            np.testing.assert_array_equal(_read(slots_at, np.int64, n), meta.slot_mapping)
            want, work = _expected_attention(cache, meta, meta._staging.workspace)
            attention = meta._attention
            got = [attention.slot(i) for i in range(attention.num_args)]
            for i in ATTENTION_PATCH:  # each call's pointers
                got[i] = want[i]
            assert got == want, step
            np.testing.assert_array_equal(_read(attention.slot(8), np.int64, n + 1), work.cum16)
            np.testing.assert_array_equal(_read(attention.slot(9), np.int32, work.num_ctas),
                                          work.first_seq)
            assert meta._write.slot(WRITE_SLOTS_ARG) == slots_at
            attention(1, 2, 3, 4)  # the double records the grid
            assert double.launches[-1][0] == (work.num_ctas, 1, 1)
            launches.update((id(meta._attention), id(meta._write)))
        assert len(launches) <= 2 * 2 * 3  # per slot, kind and batch size: prepared once


def test_a_launch_updated_to_another_step_equals_one_prepared_for_it():
    """``STEP_ARGS`` are every argument two steps of one shape may differ in: the first
    step's arguments with ``step_arguments`` of the second are the second's."""
    def arguments(lens, width, pointers):
        work = plan_work(2, 396, 3, np.asarray(lens, np.int32))
        plan = AttentionPlan(None, 4, work, 0, 3, 8, 2, 128, 16, width)
        return plan.arguments(0, 0, 0, 0, pointers[0], pointers[1], 0.125, *pointers[2:]), \
            work

    before, _ = arguments([100, 7, 3000], 188, [i << 40 for i in range(1, 7)])
    want, work = arguments([101, 8, 3100], 194, [i << 36 for i in range(1, 7)])
    pointers = [i << 36 for i in range(1, 7)]
    updated = list(before)
    values = step_arguments((work.uniform16, work.per_cta, work.total), pointers[2],
                            pointers[3], pointers[0], pointers[1], pointers[4], pointers[5], 194)
    for index, value in zip(STEP_ARGS, values):
        updated[index] = type(updated[index])(value)
    assert [type(a) for a in updated] == [type(a) for a in want]
    assert [float(a) if isinstance(a, np.floating) else int(a) for a in updated] == [
        float(a) if isinstance(a, np.floating) else int(a) for a in want]


def test_a_failed_plan_leaves_the_current_plan_current_and_fences_its_slot(double, rng,
                                                                           monkeypatch):
    with _cache(double, rng.integers(20, 200, 4)) as cache:
        ids = [0, 1, 2, 3]
        meta = cache.batch(ids)
        steps = cache._steps
        used = len(steps.ring.slots)

        def broken(*args):
            raise RuntimeError("launch preparation failed")

        monkeypatch.setattr(steps, "_attention_launch", broken)
        with pytest.raises(RuntimeError, match="launch preparation failed"):
            cache.batch(ids)
        assert steps.current is meta and len(steps.ring.slots) == used
        # the failed plan's slot waits for its queued upload; the current one's is unfenced
        assert [slot.fence._pending for slot in steps.ring.slots] == [
            slot is not meta._staging for slot in steps.ring.slots]
        monkeypatch.undo()
        key, value = _kv(cache, meta)
        cache.write(0, key, value, meta)  # still current: it launches
        assert double.launches


def test_failed_plans_never_hand_out_the_current_plans_slot(double, rng, monkeypatch):
    """A plan that fails after taking a staging slot gives it back to the ring: the plans
    after it (failing or not) never reuse the slot whose metadata the current plan's
    launches read, so those bytes stay the current plan's."""
    with _cache(double, [100, 150, 180, 190]) as cache:
        meta = cache.batch([0, 1, 2, 3])
        steps = cache._steps
        tables_at, lens_at, slots_at = meta._addresses

        def broken(*args):
            raise MemoryError("workspace allocation failed")

        monkeypatch.setattr(steps, "_attention_launch", broken)
        for ids in ([0, 1, 2, 3], [3, 2], [1]):
            with pytest.raises(MemoryError):
                cache.batch(ids)
            assert steps.current is meta
            assert steps.ring.slots[steps.ring._next] is not meta._staging
        monkeypatch.undo()
        np.testing.assert_array_equal(_read(lens_at, np.int32, 4), meta.seq_lens)
        np.testing.assert_array_equal(_read(slots_at, np.int64, 4), meta.slot_mapping)
        np.testing.assert_array_equal(
            _read(tables_at, np.int32, meta.block_tables.size).reshape(
                meta.block_tables.shape), meta.block_tables)
        after = cache.batch([3, 2])
        assert after._staging is not meta._staging


def _kv(cache, meta):
    """A new token's key and value for each sequence of ``meta`` on the double."""
    from rocmforge_raw.memory.array import DeviceArray
    from rocmforge_raw.memory.buffer import HipBuffer

    shape, act = meta._kv_shape, cache._steps.act
    nbytes = int(np.prod(shape)) * act.itemsize
    return [DeviceArray(HipBuffer(nbytes, 0, cache._steps.backend), act, shape)
            for _ in range(2)]


# --- the compiled pieces against Python -------------------------------------------------
def _reference_lean(units, longest, total, slots, lean_slots, tokens):
    """``_worksplit._lean`` in Python: long, even units whose waves fill the lean
    occupancy's slots at least 0.9 and better than ``slots``."""
    if not 0 < lean_slots < slots or longest < tokens or units <= slots:
        return False
    if 10 * total < 9 * longest * units:
        return False
    def full(at):
        return units / (at * -(-units // at))
    return full(lean_slots) >= 0.9 and full(lean_slots) > full(slots)


def _reference_split(lens, groups, slots, sms=0, rule=(0.0, 0.0, 0, 0)):
    """``plan_work``'s rule over real lengths, written out in Python."""
    work16 = [max(WORK_GRANULE, -(-max(int(n), 1) // WORK_GRANULE) * WORK_GRANULE)
              for n in lens]
    total = sum(work16) * groups
    share = max(MIN_TOKENS_PER_CTA, -(-total // max(slots, 1)))
    balanced = -(-share // WORK_GRANULE) * WORK_GRANULE
    padded, (waves, lone_fill, lean_slots, tokens) = 0, rule
    units, longest = len(lens) * groups, max(work16, default=0)
    lean = bool(sms and units and _reference_lean(units, longest, total, slots, lean_slots,
                                                   tokens))
    if lean or (sms and slots and units and waves and units >= waves * slots
                and longest * slots * waves <= total):
        padded = longest  # one CTA a unit
    elif sms and 0 < units <= slots:
        padded = _reference_padding(work16, groups, slots, sms, balanced, lone_fill)
    if padded:
        share = padded
        work16 = [-(-w // padded) * padded for w in work16]
        total = sum(work16) * groups
    elif MIN_TOKENS_PER_CTA < share < ALIGNED_SHARE_TOKENS and len(set(work16)) == 1:
        whole, start = work16[0] // WORK_GRANULE, -(-share // WORK_GRANULE)
        for granules in range(start, int(ALIGNED_STRETCH * start * WORK_GRANULE)
                              // WORK_GRANULE + 1):
            if whole % granules == 0 or granules % whole == 0:
                share = granules * WORK_GRANULE
                break
    cum16 = np.concatenate([[0], np.cumsum(work16)]).astype(np.int64)
    per_cta = -(-share // WORK_GRANULE) * WORK_GRANULE
    num_ctas = -(-total // per_cta)
    first = [int(np.searchsorted(cum16 * groups, c * per_cta, "right")) - 1
             for c in range(num_ctas)]
    whole = bool(padded) and padded >= longest
    return num_ctas, per_cta, total, cum16, np.array(first, np.int32), whole, lean


def _reference_padding(work16, groups, slots, sms, balanced, lone_fill=0.0):
    """The padded share: over the least share cutting the longest work into k pieces, each
    k from the balanced share's count down, those whose pieces fit one wave and (but for the
    first) keep two CTAs on some multiprocessor or one on ``lone_fill`` of them at least,
    the least busiest-multiprocessor load
    (pieces in whole quanta, plus their cost), then the fewest pieces; taken if within
    PAD_MARGIN of the balanced split's load."""
    def cost(share):
        return -(-share // PIECE_QUANTUM_TOKENS) * PIECE_QUANTUM_TOKENS + PIECE_COST_TOKENS

    longest, candidates = max(work16), []
    shares = sorted({-(-max(-(-longest // k), MIN_TOKENS_PER_CTA) // WORK_GRANULE)
                     * WORK_GRANULE for k in range(1, -(-longest // balanced) + 1)})
    for share in shares:
        pieces = groups * sum(-(-w // share) for w in work16)
        if pieces > slots or (candidates and pieces <= sms
                              and not (lone_fill and pieces >= lone_fill * sms)):
            continue
        candidates.append((-(-pieces // sms) * cost(share), pieces, share))
    if not candidates:
        return 0
    load, _, share = min(candidates)
    ctas = -(-(sum(work16) * groups) // balanced)
    return share if load <= PAD_MARGIN * -(-ctas // sms) * cost(balanced) else 0


@pytest.mark.parametrize("seed", range(100))
def test_split_lengths_equals_the_rule_in_python(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    same = rng.random() < 0.4
    lens = np.full(n, rng.integers(0, 5000), np.int32) if same else rng.integers(
        0, 5000 if rng.random() < 0.5 else 300, n).astype(np.int32)
    groups, slots = int(rng.choice([1, 2, 8, 32])), int(rng.choice([1, 7, 264, 396]))
    sms = int(rng.choice([0, 1, 66, 132]))
    lean = slots * 2 // 3  # one CTA a multiprocessor fewer, as on an H100
    rule = [(0.0, 0.0, 0, 0), (2.0, 0.9, 0, 0), (1.0, 0.5, lean, 16), (4.0, 0.0, lean, 64),
            (2.0, 0.9, lean, 2048)][seed % 5]
    got = split_lengths(lens, groups, slots, WORK_GRANULE, MIN_TOKENS_PER_CTA,
                        ALIGNED_SHARE_TOKENS, ALIGNED_STRETCH, sms, PIECE_COST_TOKENS,
                        PIECE_QUANTUM_TOKENS, PAD_MARGIN, *rule)
    want = _reference_split(lens, groups, slots, sms, rule)
    assert got[:3] == want[:3] and got[5:] == want[5:]
    np.testing.assert_array_equal(got[3], want[3])
    np.testing.assert_array_equal(got[4], want[4])
    assert got[4].dtype == np.int32 and got[3].dtype == np.int64


def test_split_lengths_equals_the_rule_in_python_for_long_even_units():
    """Near-even batches of long sequences, where the lean occupancy's rule decides (some
    draws go lean, most do not), against the rule in Python."""
    rng, leans = np.random.default_rng(11), 0
    for _ in range(60):
        n, groups = int(rng.integers(20, 140)), int(rng.choice([4, 8]))
        lens = (rng.integers(2048, 4096) - rng.integers(0, 200, n)).astype(np.int32)
        rule = (2.0, 0.9, 264, 2048)
        got = split_lengths(lens, groups, 396, WORK_GRANULE, MIN_TOKENS_PER_CTA,
                            ALIGNED_SHARE_TOKENS, ALIGNED_STRETCH, 132, PIECE_COST_TOKENS,
                            PIECE_QUANTUM_TOKENS, PAD_MARGIN, *rule)
        want = _reference_split(lens, groups, 396, 132, rule)
        assert got[:3] == want[:3] and got[5:] == want[5:]
        np.testing.assert_array_equal(got[3], want[3])
        np.testing.assert_array_equal(got[4], want[4])
        leans += got[6]
    assert 5 <= leans <= 55


def test_pack_host_aligns_each_array_and_copies_only_what_fits(rng):
    arrays = [rng.integers(-9, 9, (3, 5)).astype(np.int32), np.arange(7, dtype=np.int64),
              rng.integers(0, 9, (6, 8)).astype(np.int32)[:, ::3]]  # strided
    memory = np.full(4096, 0xAB, np.uint8)
    base = memory.ctypes.data
    end, offsets = pack_host(base, 300, arrays, 64, 256)  # does not fit: nothing copied
    assert (end, offsets) == (64 + 3 * 256, [64, 320, 576])
    assert (memory == 0xAB).all()
    end, offsets = pack_host(base, memory.nbytes, arrays, 64, 256)
    for array, offset in zip(arrays, offsets):
        np.testing.assert_array_equal(
            memory[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape),
            array)
    assert (memory[:64] == 0xAB).all() and (memory[end:] == 0xAB).all()
    assert (memory[64 + 60 : 320] == 0xAB).all()  # the gaps stay untouched


@pytest.mark.parametrize("lens, sms, rule", [
    ([1000] * 8, 132, (0.0, 0.0, 0, 0)),  # one wave of units: padded to whole pieces
    ([37, 5000, 0, 812, 16, 17], 132, (0.0, 0.0, 0, 0)),  # ragged, one of them empty
    (list(range(1, 300, 7)), 132, (0.0, 0.0, 0, 0)),  # more units than a wave: balanced
    ([32768], 0, (0.0, 0.0, 0, 0)),  # multiprocessors unknown: the aligned share
    ([100, 70, 99] * 30, 132, (2.0, 0.0, 0, 0)),  # 720 units, 2.7 waves: one CTA a unit
    ([4096] * 33, 132, (2.0, 0.9, 0, 0)),  # 264 units, a wave of 264: one piece a unit
    ([2048] * 40, 132, (2.0, 0.9, 176, 2048)),  # 320 units: lean, 1.8 waves of 176
])
def test_pack_step_lays_out_what_pack_host_does_with_the_split_computed_in_place(
        rng, lens, sms, rule):
    """``pack_step``'s bytes are ``pack_host``'s of [slots, lens, tables] and of
    ``plan_work``'s arrays, with the same (num_ctas, per_cta, total); a layout that does not
    fit writes nothing and says how many bytes it needs."""
    n, groups, ctas = len(lens), 8, 264
    lens = np.asarray(lens, np.int32)
    slots = rng.integers(-1, 1 << 40, n).astype(np.int64)
    tables = rng.integers(0, 4000, (n, 13)).astype(np.int32)
    work = plan_work(groups, ctas, n, lens, sms=sms, rule=rule)
    assert rule[0] == 0 or work.num_ctas == n * groups  # the rule takes whole units
    assert work.lean == (rule[2] > 0)
    want = np.full(1 << 16, 0xAB, np.uint8)
    end, offsets = pack_host(want.ctypes.data, want.nbytes,
                             [slots, lens, tables, *work.arrays], 0, 256)
    got = np.full(1 << 16, 0xAB, np.uint8)
    rule = split_rule(sms, rule)
    needed, _, none, *_ = pack_step(got.ctypes.data, 512, 256, slots, lens, tables, groups,
                                    ctas, rule)
    assert none == 0 and needed >= end and (got == 0xAB).all()
    done, at, *split = pack_step(got.ctypes.data, needed, 256, slots, lens, tables, groups,
                                 ctas, rule)
    assert (done, list(at), *split) == (end, offsets, work.num_ctas, work.per_cta,
                                        work.total, work.whole, work.lean)
    np.testing.assert_array_equal(got[:end], want[:end])
    assert (got[end:] == 0xAB).all()


def test_pack_step_refuses_arguments_that_do_not_fit_before_writing_a_byte(rng):
    """Each argument ``pack_step`` is given wrong gets a ValueError naming it, and the
    memory stays as it was: a short rule, align 0, a grid too large to stage, slots or
    tables of another dtype or row count; ``pack_host`` refuses align 0 too."""
    lens = np.asarray([100, 7, 3000], np.int32)
    slots = rng.integers(0, 1 << 40, 3).astype(np.int64)
    tables = rng.integers(0, 4000, (3, 9)).astype(np.int32)
    memory = np.full(1 << 14, 0xAB, np.uint8)
    base, rule = memory.ctypes.data, split_rule(132)
    bad = [
        (dict(rule=rule[:4]), "unpack|values"),
        (dict(align=0), "align must be at least 1, got 0"),
        (dict(ctas=1 << 62), "ctas must be in"),
        (dict(ctas=-1), "ctas must be in"),
        (dict(groups=0), "groups must be at least 1, got 0"),
        (dict(groups=1 << 62), "make more CTAs than a grid"),
        (dict(slots=slots.astype(np.int32).repeat(2)), "slots must be int64"),
        (dict(slots=slots[:2]), "slots must be int64"),
        (dict(tables=tables.astype(np.int64)), "tables must be int32"),
        (dict(tables=tables[:2]), "tables must be int32"),
    ]
    good = dict(base=base, capacity=memory.nbytes, align=256, slots=slots, lens=lens,
                tables=tables, groups=8, ctas=264, rule=rule)
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            pack_step(**{**good, **change})
        assert (memory == 0xAB).all(), change
    with pytest.raises(ValueError, match="align must be at least 1"):
        pack_host(base, memory.nbytes, [slots], 0, 0)
    assert (memory == 0xAB).all()


def test_set_ints_checks_every_index_before_it_changes_a_slot(double):
    loaded = module.Module(b"\0" * 16, backend=double)
    launch = loaded.function("k").prepare(1, 1, 1, 2, 3, patch=())
    with pytest.raises(IndexError, match="argument 3 outside"):
        launch.set_ints((0, 3), (7, 8))
    with pytest.raises(OverflowError):
        launch.set_ints((0, 1), (7, 1 << 64))
    with pytest.raises(ValueError, match="pair up"):
        launch.set_ints((0, 1), (7,))
    assert [launch.slot(i) for i in range(3)] == [1, 2, 3]
    launch.set_ints((2, 0), ((1 << 64) - 1, -2))
    assert [launch.slot(i) for i in range(3)] == [(1 << 64) - 2, 2, (1 << 64) - 1]


def test_a_workspace_ready_hands_out_only_buffers_that_hold_enough(double):
    from rocmforge_raw.memory.array import DeviceArray
    from rocmforge_raw.memory.buffer import HipBuffer

    workspace = Workspace()
    assert workspace.ready(1, 1) is None
    like = DeviceArray(HipBuffer(64, 0, double), np.int32, (16,))
    partials, counters = workspace.get(1000, 10, like)
    assert workspace.ready(1000, 10) == (partials, counters)
    assert workspace.ready(1001, 10) is None and workspace.ready(1000, 11) is None
    workspace.close()
