"""Type stub of the compiled ``_worksplit`` module (see ``_worksplit.pyx``)."""

import numpy as np

def prefix_sums(lens: np.ndarray, granule: int, cum16: np.ndarray) -> int: ...
def first_sequences(cum16: np.ndarray, groups: int, per_cta: int,
                    first_seq: np.ndarray) -> None: ...
