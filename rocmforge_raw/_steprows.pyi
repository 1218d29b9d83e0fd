"""Type stub of the compiled ``_steprows`` module (see ``_steprows.pyx``)."""

import numpy as np

PLAIN: int
GROW: int
COW: int

class RowArrays:
    tables: np.ndarray
    lens: np.ndarray
    nblocks: np.ndarray
    last_slot: np.ndarray
    last_block: np.ndarray
    created: np.ndarray
    accessed: np.ndarray
    recency: np.ndarray
    tick: int
    patched: int
    def touch(self, rows: np.ndarray, now: float) -> None: ...
    def need(self, rows: np.ndarray, ref_cnt: np.ndarray, block_size: int
             ) -> tuple[int, np.ndarray, int]: ...
    def extend_rows(self, rows: np.ndarray, kinds: np.ndarray, new: np.ndarray,
                    block_size: int, now: float, slots: np.ndarray) -> int: ...
    def append_plain(self, rows: np.ndarray, free: np.ndarray, top: int, ref_cnt: np.ndarray,
                     block_size: int, now: float, slots: np.ndarray) -> int: ...
    def gather_rows(self, rows: np.ndarray, num_blocks: int, block_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]: ...

def pop_blocks(free: np.ndarray, top: int, count: int, ref_cnt: np.ndarray) -> np.ndarray: ...

COPY_PIECE: int
MAX_GRID: int

def copy_host(dst: int, src: object) -> None: ...
def pack_host(base: int, capacity: int, arrays: list[np.ndarray], start: int, align: int
              ) -> tuple[int, list[int]]: ...
def pack_step(base: int, capacity: int, align: int, slots: np.ndarray, lens: np.ndarray,
              tables: np.ndarray, groups: int, ctas: int,
              rule: tuple[int, int, int, float, int, int, int, float, float, float, int, int]
              ) -> tuple[int, tuple[int, int, int, int, int], int, int, int, bool, bool]: ...
