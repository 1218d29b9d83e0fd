"""Bank conflicts of traced LDS accesses (``Emulator.lds_trace``), by a model of AMD's LDS.

The model: 32 banks of 4 bytes; a 16-byte access by a wave is served 8 lanes at a time, and
two lanes conflict when they touch different 4-byte words of one bank (lanes reading the
same word share it). Which lanes are served together: lanes 8i..8i+7 (what AMD documents
for ds_write_b128, and what NVIDIA does for 16-byte accesses), and for gfx9's ds_read_b128
(gfx90a, gfx942) lanes 4a..4a+3 with 4b..4b+3 for (a, b) in (0, 5), (1, 4), (2, 7), (3, 6)
of each half wave, as CK's LDS documentation gives it. The kernels are laid out to be
conflict-free under both, so neither reading of the hardware has to be the right one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

BANKS = 32
BANK_BYTES = 4
#: Lanes served together by a 16-byte access: lanes 8i..8i+7.
CONSECUTIVE = tuple(tuple(range(8 * i, 8 * i + 8)) for i in range(8))
#: Lanes served together by gfx9's ds_read_b128: quads 0 and 5, 1 and 4, 2 and 7, 3 and 6 of
#: each 32 lanes.
GFX9_READ_B128 = tuple(
    tuple(range(half + 4 * a, half + 4 * a + 4)) + tuple(range(half + 4 * b, half + 4 * b + 4))
    for half in (0, 32) for a, b in ((0, 5), (1, 4), (2, 7), (3, 6)))


def ways(addresses: Sequence[int], lane_sets: Sequence[Sequence[int]]) -> int:
    """The worst conflict of one access: over the lane sets served together, the most
    different words any one bank holds (1: conflict-free). ``addresses[lane]`` is each
    lane's first byte (lanes past the list take no part); accesses are 16 bytes."""
    worst = 1
    for lanes in lane_sets:
        words: dict[int, set[int]] = {}
        for lane in lanes:
            if lane < len(addresses):
                first = addresses[lane] // BANK_BYTES
                for word in range(first, first + 16 // BANK_BYTES):
                    words.setdefault(word % BANKS, set()).add(word)
        worst = max([worst, *(len(w) for w in words.values())])
    return worst


@dataclass(frozen=True)
class Access:
    """One access instruction of one wave: the k-th traced access of each of its lanes."""

    group: int
    wave: int
    index: int
    write: bool
    bytes: int
    addresses: tuple[int, ...]  # per lane of the wave


def instructions(records: np.ndarray, wave_size: int) -> Iterator[Access]:
    """The traced accesses grouped into instructions: for each workgroup and wave, the k-th
    access of every lane. Raises ValueError where the lanes of a wave made different
    numbers or kinds of accesses (divergent code: its accesses cannot be paired up)."""
    by_lane: dict[tuple[int, int], list[np.void]] = {}
    for record in records:
        by_lane.setdefault((int(record["group"]), int(record["item"])), []).append(record)
    waves = sorted({(group, item // wave_size) for group, item in by_lane})
    for group, wave in waves:
        lanes = [by_lane.get((group, wave * wave_size + lane), []) for lane in range(wave_size)]
        counts = {len(accesses) for accesses in lanes}
        if len(counts) != 1:
            raise ValueError(f"workgroup {group} wave {wave}: lanes made {sorted(counts)} "
                             "accesses (divergent)")
        for k in range(counts.pop()):
            kinds = {(int(a[k]["write"]), int(a[k]["bytes"])) for a in lanes}
            if len(kinds) != 1:
                raise ValueError(f"workgroup {group} wave {wave}: access {k} differs in kind "
                                 f"across lanes: {sorted(kinds)}")
            write, size = kinds.pop()
            yield Access(group, wave, k, bool(write), size,
                         tuple(int(a[k]["address"]) for a in lanes))
