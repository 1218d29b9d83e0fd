"""Type stub of the compiled ``_rows`` module (see ``_rows.pyx``)."""

import numpy as np

from ._tables import RowStore

PLAIN: int
GROW: int
COW: int

class RowArrays(RowStore):
    def touch(self, rows: np.ndarray, now: float) -> None: ...
    def need(self, rows: np.ndarray, ref_cnt: np.ndarray, block_size: int
             ) -> tuple[int, np.ndarray, int]: ...
    def extend_rows(self, rows: np.ndarray, kinds: np.ndarray, new: np.ndarray,
                    block_size: int, now: float, slots: np.ndarray) -> int: ...
    def append_plain(self, rows: np.ndarray, free: np.ndarray, top: int, ref_cnt: np.ndarray,
                     block_size: int, now: float, slots: np.ndarray) -> int: ...

def pop_blocks(free: np.ndarray, top: int, count: int, ref_cnt: np.ndarray) -> np.ndarray: ...
def query_slots(tables: np.ndarray, lens: np.ndarray, query_lens: np.ndarray,
                ref_cnt: np.ndarray, block_size: int) -> np.ndarray: ...
