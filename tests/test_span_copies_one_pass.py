"""ops.copy_spans's one pass (``_one_pass``, ``Staging.put_pieces``, ``_pack.pack_pieces``):
a table of spans in ascending destination order cut straight into the staging slot and
launched, and every other table handed to the general checks, which refuse it as before.

A GPU is not needed: ``kernel_path`` makes the host backend take the launch path (as a
device backend does), and its ``rf_copy_pieces`` stand-in reads the uploaded piece table
and moves each piece on the host (the host backend's addresses are the host's)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from conftest import DEVICE

import rocmforge_raw as rf
from rocmforge_raw.common import checks, procs
from rocmforge_raw.kernels import ops
from rocmforge_raw.kernels.staging import pack_pieces

KiB = 1024


class Pieces:
    """A stand-in for ``rf_copy_pieces``: each launch reads its ``grid`` rows (src address,
    dst address, bytes) at the table's address and moves them; ``launches`` logs the grids."""

    def __init__(self) -> None:
        self.launches: list[int] = []

    def function(self, name: str) -> Pieces:
        assert name == "rf_copy_pieces"
        return self

    def launch(self, grid: int, threads: int, table: int, stream: Any = None) -> None:
        rows = np.ctypeslib.as_array((ctypes.c_int64 * (3 * grid)).from_address(table))
        for src, dst, nbytes in rows.reshape(grid, 3).tolist():
            assert nbytes % 16 == 0 and 0 < nbytes <= ops.PIECE_BYTES
            ctypes.memmove(dst, src, nbytes)
        self.launches.append(grid)


@pytest.fixture
def kernel_path(monkeypatch) -> Pieces:
    """The host backend takes the launch path; ``general`` counts the general checks."""
    pieces = Pieces()
    monkeypatch.setattr(ops, "by_kernel", lambda backend: True)
    monkeypatch.setattr(ops, "load_kernels", lambda *args, **kwargs: pieces)
    return pieces


@pytest.fixture
def general(monkeypatch) -> list[int]:
    calls: list[int] = []
    spans = checks.spans

    def counted(value: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(np.asarray(value)))
        return spans(value, *args, **kwargs)

    monkeypatch.setattr(checks, "spans", counted)
    return calls


def copied(spans: Any, nbytes: int = 1024 * KiB, dst_nbytes: int | None = None,
           ) -> tuple[np.ndarray, np.ndarray]:
    """(what ``copy_spans`` left in a zeroed destination, what span-by-span copies leave)."""
    data = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    dst_nbytes = nbytes if dst_nbytes is None else dst_nbytes
    want = np.zeros(dst_nbytes, np.uint8)
    with rf.HipBuffer.from_numpy(data, DEVICE, "host") as src, \
            rf.HipBuffer.from_numpy(want, DEVICE, "host") as dst:
        ops.copy_spans(dst, src, spans)
        got = dst.to_numpy()
    for s, d, n in np.asarray(spans).tolist():
        want[d : d + n] = data[s : s + n]
    return got, want


def ascending(rng: np.random.Generator) -> np.ndarray:
    """Block-sized spans from anywhere to ascending places, one of several pieces with a
    one-vector tail, one of a single vector, one empty: what ``block_spans`` makes."""
    chunk = 32 * KiB
    places = np.sort(rng.permutation(24)[:12]) * chunk
    spans = [[int(rng.integers(0, 32)) * chunk, int(d), chunk] for d in places]
    top = 24 * chunk
    spans += [[16, top, 3 * ops.PIECE_BYTES + 16], [64, top + 3 * ops.PIECE_BYTES + 32, 16],
              [0, top + 3 * ops.PIECE_BYTES + 48, 0]]
    return np.array(spans, np.int64)


def test_spans_in_destination_order_move_in_one_pass_and_one_launch(kernel_path, general,
                                                                     rng):
    spans = ascending(rng)
    got, want = copied(spans)
    np.testing.assert_array_equal(got, want)
    assert kernel_path.launches == [12 + 4 + 1]  # a piece a block, 4 for the long one, 1
    assert general == []  # never checked twice


def test_pieces_past_one_launch_go_in_several_from_the_one_pass(kernel_path, monkeypatch):
    monkeypatch.setattr(ops, "MAX_PIECES", 3)
    got, want = copied(np.array([[0, 0, 10 * ops.PIECE_BYTES]], np.int64))
    np.testing.assert_array_equal(got, want)
    assert kernel_path.launches == [3, 3, 3, 1]


@pytest.mark.parametrize("spans", [
    [[0, 64 * KiB, 64], [0, 0, 64]],  # destinations descend: sorted by the general checks
    np.array([[0, 0, 64], [0, 64, 64]], np.int32),  # another integer type
    np.array([[0, 0, 64, 0], [0, 64, 64, 0]], np.int64)[:, :3],  # a strided view
    np.asfortranarray(np.array([[0, 0, 64], [0, 64, 64]], np.int64)),
])
def test_other_tables_take_the_general_checks_and_still_launch(kernel_path, general, spans):
    got, want = copied(spans)
    np.testing.assert_array_equal(got, want)
    assert general == [2] and kernel_path.launches == [2]


@pytest.mark.parametrize("spans, words", [
    ([[0, 0, 64], [64, 32, 64]], "overlap in the destination: bytes 0..64 and 32"),
    ([[0, 0, 4 * KiB + 16]], "has a span outside the 4096-byte source"),
    ([[-16, 0, 16]], "has a span outside"),
    ([[16, 16, 2**63 - 16]], "has a span outside"),
    ([[0, 8 * KiB - 16, 32]], "has a span outside"),  # past the destination
    ([[0, 0, 64], [0, 32, 0], [0, 16, 16]], "overlap in the destination"),
])
def test_bad_tables_are_refused_by_the_general_checks_with_nothing_moved(kernel_path, spans,
                                                                         words):
    table = np.array(spans, np.int64)
    with rf.HipBuffer.from_numpy(np.full(4 * KiB, 9, np.uint8), DEVICE, "host") as src, \
            rf.HipBuffer.from_numpy(np.zeros(8 * KiB, np.uint8), DEVICE, "host") as dst:
        with pytest.raises(ValueError, match=words):
            ops.copy_spans(dst, src, table)
        assert not dst.to_numpy().any()
    assert kernel_path.launches == []


def test_unaligned_spans_leave_the_one_pass_for_runtime_copies(kernel_path, general):
    got, want = copied(np.array([[3, 100, 1000], [5000, 7000, 33]], np.int64))
    np.testing.assert_array_equal(got, want)
    assert general == [2] and kernel_path.launches == []


def test_pack_pieces_writes_the_rows_cut_pieces_makes_and_nothing_past_capacity(rng):
    spans = ascending(rng)
    want = ops.cut_pieces(1 << 40, 1 << 30, spans[spans[:, 2] > 0])
    table = np.full((len(want) + 1, 3), -1, np.int64)
    args = (spans, 1 << 30, 1 << 40, 1 << 20, 1 << 20, ops.PIECE_BYTES)
    assert pack_pieces(table.ctypes.data, 24 * len(want) - 8, *args) == (
        len(want), 24 * len(want))
    assert (table == -1).all()  # too small: nothing written
    assert pack_pieces(table.ctypes.data, table.nbytes, *args) == (
        len(want), 24 * len(want))
    np.testing.assert_array_equal(table[:-1], want)
    assert (table[-1] == -1).all()


def test_a_watched_process_is_alive_until_it_exits():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        start = procs.start_ticks(child.pid)
        assert start is not None
        watch = procs.Exit(child.pid, start)
        wrong = procs.Exit(child.pid, start + 1)  # another process that had this pid
        assert watch.alive() and not wrong.alive()
        child.stdin.close()
        child.wait()
        assert not watch.alive() and not watch.alive()  # and stays so
        watch.close()
        wrong.close()
        assert not procs.Exit(child.pid, start).alive()  # reaped: no such process
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_watch_without_pidfds_asks_proc(monkeypatch):
    monkeypatch.delattr(os, "pidfd_open")
    pid, start = procs.identity()
    assert procs.Exit(pid, start).alive() and not procs.Exit(pid, start + 1).alive()


def test_a_sequence_moves_into_scattered_blocks_in_one_pass(kernel_path, general):
    """``block_spans`` puts the destinations in ascending order, so an import whose fresh
    blocks come in any order takes the one pass, checked by nothing else; every block of
    every plane lands where the receiver's table says."""
    from test_transfer import config, decode_and_check, write_prompt

    from rocmforge_raw.cache import KvCache
    from rocmforge_raw.transport import PeerTransport

    with KvCache(config(), backend="host") as src, \
            KvCache(config(num_blocks=20), backend="host") as dst, PeerTransport() as link:
        link.publish(src.slab)
        for i in range(8):  # the receiver's free blocks: out of order, every other one
            dst.add_sequence(i, num_tokens=16)
        for i in (6, 1, 4, 3):
            dst.remove(i)
        write_prompt(src, "prompt", np.arange(70), seed=5)
        done = dst.import_sequence(src.export_sequence("prompt"), link)
        assert done.blocks_moved == 5 and general == [] and len(kernel_path.launches) == 1
        decode_and_check(dst, "prompt", 70, seed=5)
