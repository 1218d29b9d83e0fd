"""Type stub of the compiled ``_spans`` module (see ``_spans.pyx``)."""

import numpy as np

def block_ids(ids: object, limit: int) -> np.ndarray | None: ...
def spans(src: np.ndarray, dst: np.ndarray, src_blocks: int, num_blocks: int, chunk: int,
          planes: int) -> np.ndarray | None: ...
