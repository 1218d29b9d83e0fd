"""A hypothesis state machine over add/append/fork/write/finish/remove/preempt, with prompts
given by their tokens that share prefixes (the prefix cache hits held and cached-free blocks).

After every step: the pool's invariants hold (free + used == total, ref counts == holders,
no block held twice without sharing, tables consistent) and every live sequence reads back
exactly the K values written for it, so sharing, copy-on-write and prefix hits never leak
between sequences. A prompt's K values are its token ids (a function of the prompt, as a
model's are) and only the tokens the reservation does not report cached are written: a wrong
hit reads back the wrong values. 160 examples of up to 100 steps: at least 10 000 steps
per run (asserted).
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from rocmforge_raw.cache import CacheConfig, KvCache
from rocmforge_raw.kernels.ops import host_view
from rocmforge_raw.memory.array import DeviceArray

BLOCK = 8
CONFIG = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, block_size=BLOCK,
                     num_blocks=16, dtype="float32")

#: Shared prefixes: two of them agree on their first block, one is whole blocks only.
SYSTEM_PROMPTS = [tuple(range(1000, 1000 + 2 * BLOCK + 3)),
                  tuple(range(1000, 1000 + BLOCK)) + (7,) * (BLOCK + 1),
                  tuple(range(2000, 2000 + 3 * BLOCK)), ()]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = KvCache(CONFIG, backend="host")
        self.model: dict[int, list[float]] = {}
        self.next_id = 0
        self.next_value = 1.0

    def teardown(self) -> None:
        self.cache.close()

    def _write(self, slots: np.ndarray) -> list[float]:
        values = [self.next_value + i for i in range(len(slots))]
        self.next_value += len(slots)
        keys = np.repeat(np.asarray(values, np.float32)[:, None, None], CONFIG.head_dim, 2)
        array = DeviceArray.from_numpy(keys, backend="host")
        self.cache.write(0, array, array, slots)
        return values

    def _forget(self, ids: list[int]) -> None:
        for seq_id in ids:
            del self.model[seq_id]

    @rule(tokens=st.integers(1, 40))
    def add(self, tokens: int) -> None:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if tokens > CONFIG.num_slots:
            return
        reservation = self.cache.add_sequence(seq_id, tokens)
        self._forget(reservation.preempted)
        self.model[seq_id] = self._write(reservation.slot_mapping)

    @rule(system=st.sampled_from(SYSTEM_PROMPTS),
          suffix=st.lists(st.integers(0, 2), max_size=2 * BLOCK))
    def add_prompt(self, system: tuple[int, ...], suffix: list[int]) -> None:
        tokens = np.array(system + tuple(suffix), np.int64)
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if tokens.size == 0 or tokens.size > CONFIG.num_slots:
            return
        cached_free = self.cache.stats()["cached_free_blocks"]
        reservation = self.cache.add_sequence(seq_id, tokens=tokens)
        self._forget(reservation.preempted)
        cached = reservation.num_cached_tokens
        CacheMachine.hits += cached > 0
        CacheMachine.revived += cached > 0 and cached_free > 0
        assert cached <= tokens.size - 1 and (cached % BLOCK == 0 or cached == tokens.size - 1)
        keys = np.repeat(tokens[cached:].astype(np.float32)[:, None, None], CONFIG.head_dim, 2)
        array = DeviceArray.from_numpy(keys, backend="host")
        self.cache.write(0, array, array, reservation.slot_mapping[cached:])
        self.model[seq_id] = tokens.astype(np.float32).tolist()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        reservation = self.cache.append(ids)
        self._forget(reservation.preempted)
        keep = reservation.slot_mapping >= 0
        values = self._write(reservation.slot_mapping[keep])
        for seq_id, value in zip([s for s, k in zip(ids, keep) if k], values):
            self.model[seq_id].append(value)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.cache.fork(parent, child)
        self.model[child] = list(self.model[parent])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), finish=st.booleans())
    def finish_or_remove(self, data: st.DataObject, finish: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.model)))
        (self.cache.finish if finish else self.cache.remove)(seq_id)
        del self.model[seq_id]

    @precondition(lambda self: self.cache.stats()["free_blocks"] < 4 and self.model)
    @rule()
    def preempt_by_pressure(self) -> None:
        """A prompt larger than the free blocks forces LRU preemption."""
        free = self.cache.stats()["free_blocks"]
        self.add(min((free + 2) * BLOCK, CONFIG.num_slots))

    checks = hits = revived = 0

    @invariant()
    def pool_is_consistent(self) -> None:
        CacheMachine.checks += 1
        self.cache.check_invariants()
        assert set(self.cache.seq_ids()) == set(self.model)

    @invariant()
    def every_sequence_reads_back_what_was_written(self) -> None:
        keys = host_view(self.cache.k_cache(0))
        for seq_id, values in self.model.items():
            blocks = self.cache.block_ids(seq_id)
            positions = np.arange(len(values))
            got = keys[blocks[positions // BLOCK], 0, positions % BLOCK, 0]
            np.testing.assert_array_equal(got, np.asarray(values, np.float32))


def test_ten_thousand_steps_keep_every_invariant():
    CacheMachine.checks = CacheMachine.hits = CacheMachine.revived = 0
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=160, stateful_step_count=100, deadline=None))
    assert CacheMachine.checks >= 10_000, f"only {CacheMachine.checks} steps ran"
    assert CacheMachine.hits >= 100 and CacheMachine.revived >= 20, (
        f"only {CacheMachine.hits} prompts hit the prefix cache, {CacheMachine.revived} "
        "with cached-free blocks around")
