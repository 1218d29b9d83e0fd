"""Type stub of the compiled ``_pack`` module (see ``_pack.pyx``)."""

import numpy as np

COPY_PIECE: int
MAX_GRID: int

def copy_host(dst: int, src: object) -> None: ...
def pack_host(base: int, capacity: int, arrays: list[np.ndarray], start: int, align: int
              ) -> tuple[int, list[int]]: ...
def pack_step(base: int, capacity: int, align: int, slots: np.ndarray, lens: np.ndarray,
              tables: np.ndarray, groups: int, ctas: int,
              rule: tuple[int, int, int, float, int, int, int, float, float, float, int, int]
              ) -> tuple[int, tuple[int, int, int, int, int], int, int, int, bool, bool]: ...
def pack_pieces(base: int, capacity: int, spans: np.ndarray, src_ptr: int, dst_ptr: int,
                src_nbytes: int, dst_nbytes: int, piece: int) -> tuple[int, int]: ...
