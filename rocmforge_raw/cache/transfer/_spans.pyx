# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""An import's per-block work in C: the description's block ids read once (``block_ids``) and
the span table of a run of blocks (``spans``). Each answers None where its input is not the
common case (an id that is no plain int or out of range; destinations not ascending): the
caller's NumPy path then checks, refuses or sorts as before, so these never accept what it
refuses.
"""

from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport int32_t, int64_t

import numpy as np


def block_ids(object ids, int64_t limit):
    """``ids`` (a tuple) as an int64 array where every one is a plain ``int`` (not a bool, not
    a subclass) in ``1 .. limit - 1``; else None (nothing raised: the caller's checks say
    what is wrong)."""
    if type(ids) is not tuple:
        return None
    cdef Py_ssize_t n = PyTuple_GET_SIZE(ids), i
    if n == 0:
        return None
    out = np.empty(n, np.int64)
    cdef int64_t[::1] dst = out
    cdef object item
    cdef long long value
    for i in range(n):
        item = <object>PyTuple_GET_ITEM(ids, i)
        if not PyLong_CheckExact(item):
            return None
        try:
            value = PyLong_AsLongLong(item)
        except OverflowError:
            return None
        if value < 1 or value >= limit:
            return None
        dst[i] = value
    return out


def spans(const int64_t[::1] src, object dst, int64_t src_blocks, int64_t num_blocks,
          int64_t chunk, int64_t planes):
    """``block_spans``'s table (int64 ``[planes * runs, 3]``: per plane, per run of blocks
    consecutive on both sides, src offset, dst offset, bytes) where ``dst`` (int32 or int64,
    as long as ``src``) ascends; else None. Plane ``p`` of block ``b`` starts at
    ``(p * blocks + b) * chunk`` on either side."""
    cdef Py_ssize_t n = src.shape[0], i, runs = 1, r, p, k
    cdef const int32_t[::1] d32
    cdef const int64_t[::1] d64
    cdef bint wide = dst.dtype == np.int64
    if wide:
        d64 = dst
    else:
        d32 = dst
    if n == 0 or (d64.shape[0] if wide else d32.shape[0]) != n:
        return None
    cdef int64_t prev, cur
    prev = d64[0] if wide else d32[0]
    for i in range(1, n):
        cur = d64[i] if wide else d32[i]
        if cur < prev:
            return None
        if cur != prev + 1 or src[i] != src[i - 1] + 1:
            runs += 1
        prev = cur
    out = np.empty((planes * runs, 3), np.int64)
    cdef int64_t[:, ::1] o = out
    # the first plane's runs, then each other plane's from it
    r, k = 0, 0
    for i in range(n + 1):
        if i == n or (i > 0 and ((d64[i] if wide else d32[i]) != (d64[i - 1] if wide else
                                                                  d32[i - 1]) + 1
                                 or src[i] != src[i - 1] + 1)):
            o[r, 0] = src[k] * chunk
            o[r, 1] = (d64[k] if wide else d32[k]) * chunk
            o[r, 2] = (i - k) * chunk
            r += 1
            k = i
    for p in range(1, planes):
        for r in range(runs):
            o[p * runs + r, 0] = o[r, 0] + p * src_blocks * chunk
            o[p * runs + r, 1] = o[r, 1] + p * num_blocks * chunk
            o[p * runs + r, 2] = o[r, 2]
    return out
