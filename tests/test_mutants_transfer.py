"""Behaviours the mutation run of issue 44 (group B) found unpinned: sequence transfer
(``cache/transfer``), the transports, IPC's lifetimes, a graph's layout and uploads, and the
scheduler's abort and multi-turn paths. Each test names what a user would see change."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from test_atomicity import cache_state

from rocmforge_raw.cache import CacheConfig, CacheFullError, KvCache
from rocmforge_raw.cache.transfer.sequences import block_spans, fingerprint, layout
from rocmforge_raw.transport import PeerTransport

CONFIG = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_q_heads=4)


def config(num_blocks=32, **changes):
    return CacheConfig(**{**CONFIG, "num_blocks": num_blocks, **changes})


def exported(src, link, num_tokens=40):
    link.publish(src.slab)
    src.add_sequence("s", tokens=np.arange(num_tokens))
    return src.export_sequence("s")


# --- sequences.py ----------------------------------------------------------------------------
def test_a_description_s_layout_names_its_dtypes_as_plain_strings():
    with KvCache(config(activation_dtype="float16")) as src, PeerTransport() as link:
        desc = exported(src, link)
        assert desc.layout == dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                                   dtype="float16", activation_dtype="float16",
                                   kv_scales=src.config.kv_scales)


def test_a_dtype_mismatch_names_both_dtypes():
    with KvCache(config()) as src, KvCache(config(dtype="bfloat16")) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)
        with pytest.raises(ValueError, match=re.escape(
                "dtype 'float16' (this cache: 'bfloat16'), activation_dtype 'float16' "
                "(this cache: 'bfloat16')")):
            dst.import_sequence(desc, link)


@pytest.mark.parametrize("field, value", [("prefix_hashes", "abc"),
                                          ("endpoints", [("peer", 1)])])
def test_a_malformed_container_is_shown_in_the_refusal(field, value):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), **{field: value})
        with pytest.raises(TypeError, match=re.escape(f"got {value!r}")):
            dst.import_sequence(desc, link)


def test_block_spans_of_no_blocks_are_an_empty_int64_table():
    spans = block_spans(np.zeros(0, np.int64), np.zeros(0, np.int32), 12, config())
    assert spans.shape == (0, 3) and spans.dtype == np.int64


def test_layouts_that_differ_have_different_fingerprints():
    fp8 = config(dtype="float8_e4m3fn", activation_dtype="float16",
                 kv_scales=[(0.02, 0.03)] * 2)
    prints = {fingerprint(layout(c)) for c in (config(), config(block_size=32), fp8)}
    assert len(prints) == 3


def test_a_layout_s_fingerprint_is_the_same_in_every_build():
    """A description crosses processes that may run another build of the package: the
    fingerprint of a layout is a fixed 16-byte digest of its fields, not of this build."""
    assert fingerprint(layout(config())) == "530d0cc6e43d9fb931bfca2ff6504e53"


def test_an_import_refuses_what_is_not_a_description_or_a_transport_showing_it():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = exported(src, link)
        with pytest.raises(TypeError, match=r"SequenceDescription \(from export_sequence\), "
                                            r"got \{'seq_id': 's'"):
            dst.import_sequence(dict(desc.__dict__), link)
        with pytest.raises(TypeError, match="must be a Transport, got 'peer'"):
            dst.import_sequence(desc, "peer")
        with pytest.raises(TypeError, match=re.escape("seq_id must be hashable, got [1]")):
            dst.import_sequence(desc, link, seq_id=[1])


def test_an_import_under_the_id_of_a_swapped_out_sequence_is_refused():
    with KvCache(config()) as src, KvCache(config(host_blocks=8)) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)
        dst.add_sequence("s", num_tokens=20)
        dst.swap_out(["s"])
        before = dst.stats()
        with pytest.raises(ValueError, match="sequence 's' already exists"):
            dst.import_sequence(desc, link)
        assert dst.stats() == before


def test_an_endpoint_missing_for_the_transport_says_how_to_publish_it():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = dataclasses.replace(exported(src, link), endpoints={})
        with pytest.raises(ValueError, match=re.escape("PeerTransport.publish(slab)")):
            dst.import_sequence(desc, link)


def test_prefix_blocks_cached_free_at_the_receiver_count_as_blocks_an_import_takes():
    """3 blocks, 2 of them prefix blocks the receiver holds cached-free: reusing those takes
    them from the free blocks too, so 2 free blocks are too few and 3 are enough."""
    for resident_blocks, fits in ((5, False), (4, True)):
        with KvCache(config()) as src, KvCache(config(num_blocks=8)) as dst, \
                PeerTransport() as link:
            desc = exported(src, link)  # 40 tokens: 3 blocks, 2 full
            dst.import_sequence(desc, link, "held")
            dst.finish("held")  # 7 free blocks, 2 of them cached
            dst.add_sequence("resident", num_tokens=16 * resident_blocks)
            if fits:
                done = dst.import_sequence(desc, link)
                assert (done.blocks_shared, done.blocks_moved) == (2, 1)
                continue
            before = cache_state(dst)
            with pytest.raises(CacheFullError, match="needs 3 blocks but 2 are free"):
                dst.import_sequence(desc, link)
            assert cache_state(dst) == before


def test_prefix_blocks_the_receiver_holds_in_use_take_no_free_block():
    with KvCache(config()) as src, KvCache(config(num_blocks=8)) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)  # 3 blocks, 2 full
        dst.import_sequence(desc, link, "held")
        dst.add_sequence("resident", num_tokens=16 * 3)  # 1 block left free
        done = dst.import_sequence(desc, link, "again")
        assert (done.blocks_shared, done.blocks_moved) == (2, 1)
        assert dst.stats()["free_blocks"] == 0


def test_a_full_receiver_says_an_import_never_preempts():
    with KvCache(config()) as src, KvCache(config(num_blocks=3)) as dst, \
            PeerTransport() as link:
        desc = exported(src, link)  # 3 blocks; the receiver has 2
        with pytest.raises(CacheFullError, match=r"^needs 3 blocks but 2 are free: an import "
                                                 r"never preempts$"):
            dst.import_sequence(desc, link)


def test_an_allocation_that_fails_raises_its_own_error_and_changes_nothing(monkeypatch):
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        desc = exported(src, link)
        before = cache_state(dst)

        def failing(*args):
            raise RuntimeError("no block today")

        monkeypatch.setattr(dst, "_allocate", failing)
        with pytest.raises(RuntimeError, match="no block today"):
            dst.import_sequence(desc, link)
        assert cache_state(dst) == before


def test_an_import_reports_the_sequence_its_tokens_and_a_duration():
    with KvCache(config()) as src, KvCache(config()) as dst, PeerTransport() as link:
        done = dst.import_sequence(exported(src, link), link, "copy")
        assert (done.seq_id, done.num_tokens, done.blocks_moved) == ("copy", 40, 3)
        assert isinstance(done.seconds, float) and 0 <= done.seconds < 60
