"""Type stub of the compiled ``_prefill`` module (see ``_prefill.pyx``)."""

import numpy as np

def prefill_items(q_lens: np.ndarray, kv_lens: np.ndarray, num_kv_heads: int, ratio: int,
                  bm: int, bn: int, slots: int, max_pieces: int, piece_waves: int,
                  min_piece_tiles: int, item_cost: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]: ...
