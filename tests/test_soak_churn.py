"""The soak's churn of the host tier, sequence transfers and graph replays (``soak
--workloads tier transfer graph``): each cycle does the work it names and leaves nothing
behind."""

from __future__ import annotations

import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.soak.churn import Churn
from rocmforge_raw.soak.results import DEFAULT_WORKLOADS, WORKLOADS, SoakConfig


def test_the_churn_workloads_are_offered_but_not_run_by_default():
    assert set(WORKLOADS) - set(DEFAULT_WORKLOADS) == {"tier", "transfer", "graph"}
    assert SoakConfig(workloads=("tier", "graph")).workloads == ("tier", "graph")
    with pytest.raises(ValueError, match=r"workloads must be some of .*'swap'"):
        SoakConfig(workloads=("tier", "swap"))


def test_cycles_swap_move_and_release_everything(backend):
    before = rf.memory_stats()["live_buffers"]
    churn = Churn(backend, 0, np.random.default_rng(3), ("tier", "transfer"))
    for _ in range(60):
        churn.cycle()
    tier, src, dst = churn.tiered.stats(), churn.sender.stats(), churn.receiver.stats()
    assert tier["swapped_out_blocks"] > 0 and tier["swapped_in_blocks"] > 0
    assert churn.blocks_shared > 0  # the shared prefix was shared, not moved
    assert tier["used_blocks"] == src["used_blocks"] == dst["used_blocks"] == 0
    for cache in (churn.tiered, churn.sender, churn.receiver):
        cache.check_invariants()
        assert len(cache._events._known) <= cache.config.num_blocks + cache.config.host_blocks
    churn.close()
    rf.free_waiting()  # the one-off writes' staging, kept per device (a GPU's)
    assert rf.memory_stats()["live_buffers"] == before


def test_graph_cycles_replay_mixed_steps(gpu):
    churn = Churn(gpu, 0, np.random.default_rng(4), ("graph",))
    for _ in range(40):
        churn.cycle()
    assert churn.graph.captures >= 1 and churn.graph.replays > churn.graph.captures
    churn.close()
