# cython: language_level=3, boundscheck=False, wraparound=False
"""The work split's arrays in C (``planning.plan_work``): a decode step plans one in every
``KvCache.batch``, so these loops run per step; NumPy's per-call overhead was most of it.

Work tokens: a sequence of ``n`` tokens counts ``max(n, 1)`` rounded up to ``granule``.
"""


def prefix_sums(const int[::1] lens, long long granule, long long[::1] cum16) -> int:
    """``cum16[i]`` = work tokens of sequences ``[0, i)`` (``cum16`` has ``len(lens) + 1``
    entries); returns the total."""
    cdef Py_ssize_t i
    cdef long long total = 0, tokens
    cum16[0] = 0
    for i in range(lens.shape[0]):
        tokens = lens[i] if lens[i] > 1 else 1
        total += (tokens + granule - 1) // granule * granule
        cum16[i + 1] = total
    return total


def first_sequences(const long long[::1] cum16, long long groups, long long per_cta,
                    int[::1] first_seq) -> None:
    """``first_seq[c]`` = the sequence whose units hold work token ``c * per_cta`` (sequence
    ``s``'s units span ``[cum16[s] * groups, cum16[s + 1] * groups)``)."""
    cdef Py_ssize_t c, s = 0, last = cum16.shape[0] - 2
    cdef long long start
    for c in range(first_seq.shape[0]):
        start = c * per_cta
        while s < last and cum16[s + 1] * groups <= start:
            s += 1
        first_seq[c] = <int>s
