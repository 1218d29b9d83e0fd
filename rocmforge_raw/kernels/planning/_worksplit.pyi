"""Type stub of the compiled ``_worksplit`` module (see ``_worksplit.pyx``)."""

import numpy as np

def prefix_sums(lens: np.ndarray, granule: int, cum16: np.ndarray) -> int: ...
def first_sequences(cum16: np.ndarray, groups: int, per_cta: int,
                    first_seq: np.ndarray) -> None: ...
def split_lengths(lens: np.ndarray, groups: int, slots: int, granule: int, min_tokens: int,
                  aligned_tokens: int, stretch: float, sms: int = 0, piece_cost: int = 0,
                  quantum: int = 1, margin: float = 1.0, whole_waves: float = 0.0,
                  lone_fill: float = 0.0, lean_slots: int = 0, lean_tokens: int = 0,
                  with_first_seq: bool = True
                  ) -> tuple[int, int, int, np.ndarray, np.ndarray | None, bool, bool]: ...
def padded_share(cum16: np.ndarray, groups: int, slots: int, sms: int, granule: int,
                 min_tokens: int, piece_cost: int, quantum: int = 1,
                 margin: float = 1.0, lone_fill: float = 0.0) -> int: ...
