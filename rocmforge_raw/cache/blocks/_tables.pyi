"""Type stub of the compiled ``_tables`` module (see ``_tables.pyx``)."""

import numpy as np

class RowStore:
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
    def gather_rows(self, rows: np.ndarray, num_blocks: int, block_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]: ...
