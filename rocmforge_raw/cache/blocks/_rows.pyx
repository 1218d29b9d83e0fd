# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A decode step's bookkeeping in C: ``append`` and ``batch`` of a KV cache at B sequences
are loops over B rows of C arrays, not NumPy calls (each of which costs a microsecond or
more whatever its size) nor Python objects per sequence.

``RowArrays`` adds the loops of a step to the arrays of ``_tables.RowStore``: ``touch``,
``need``, ``extend_rows`` and ``append_plain``; ``pop_blocks`` is ``BlockPool.allocate``'s
common case; ``query_slots`` is a mixed step's write slots (``multi.query_slots``). Not
locked: the cache's lock covers calls.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t

from rocmforge_raw.cache.blocks._tables cimport RowStore

import numpy as np


cdef enum:  # what ``need`` says of each row (the Python names below)
    KIND_PLAIN = 0
    KIND_GROW = 1
    KIND_COW = 2

#: What ``need`` says of each row: nothing new, a new block, or a private copy of a shared
#: last block (copy-on-write).
PLAIN, GROW, COW = KIND_PLAIN, KIND_GROW, KIND_COW


cdef class RowArrays(RowStore):
    """A step's loops over the per-sequence arrays (module docstring)."""

    def touch(self, const int64_t[::1] rows, double now):
        """Mark ``rows`` used at ``now``, later ones in the list as more recent."""
        self._check_rows(rows)
        cdef Py_ssize_t i
        cdef double* accessed = self.c_accessed
        cdef int64_t* recency = self.c_recency
        cdef long long tick = self.tick
        for i in range(rows.shape[0]):
            tick += 1
            accessed[rows[i]] = now
            recency[rows[i]] = tick
        self.tick = tick

    def need(self, const int64_t[::1] rows, const int32_t[::1] ref_cnt, int64_t block_size):
        """(blocks needed, kinds, COW rows) for one more token in each of ``rows`` (distinct):
        ``kinds[i]`` is GROW where row i's last block is full, COW where it has room but
        other holders, else PLAIN. ``block_size`` is a power of two. The rule that one of
        several batch members sharing a block keeps it (``SequenceRows.append_need``) is
        left to the caller: it is rare."""
        self._check_rows(rows)
        kinds = np.empty(rows.shape[0], np.uint8)
        cdef uint8_t[::1] k = kinds
        cdef int64_t copies = 0
        cdef int64_t total = self._kinds(rows, &ref_cnt[0] if ref_cnt.shape[0] else NULL,
                                         ref_cnt.shape[0], block_size,
                                         &k[0] if k.shape[0] else NULL, &copies)
        return total, kinds, copies

    cdef int64_t _kinds(self, const int64_t[::1] rows, const int32_t* ref_cnt,
                        Py_ssize_t blocks, int64_t block_size, uint8_t* kinds,
                        int64_t* copies) except -1:
        """``need``'s loop: each row's kind into ``kinds``; the blocks needed (COW rows
        counted into ``copies`` too)."""
        cdef Py_ssize_t i
        cdef int64_t row, last, mask = block_size - 1, total = 0
        for i in range(rows.shape[0]):
            row = rows[i]
            if self.c_lens[row] & mask == 0:
                kinds[i] = KIND_GROW
                total += 1
                continue
            last = self.c_last_block[row]
            if not 0 <= last < blocks:
                raise IndexError(f"row {row}'s last block {last} outside [0, {blocks})")
            if ref_cnt[last] > 1:
                kinds[i] = KIND_COW
                total += 1
                copies[0] += 1
            else:
                kinds[i] = KIND_PLAIN
        return total

    def extend_rows(self, const int64_t[::1] rows, const uint8_t[::1] kinds,
                    const int32_t[::1] new,
               int64_t block_size, double now, int64_t[::1] slots):
        """One more token for each of ``rows`` as ``kinds`` says (``need``): ``new`` holds
        the new blocks of the GROW rows, then the private copies replacing the last block
        of the COW rows, in row order; ``slots[i]`` gets row i's new slot. Returns 0, or,
        changing nothing, the table width a GROW row needs when the tables are narrower."""
        self._check_rows(rows)
        cdef Py_ssize_t i, n = rows.shape[0], copied = 0, num_grow = 0
        if kinds.shape[0] != n or slots.shape[0] != n:
            raise ValueError(f"kinds ({kinds.shape[0]}) and slots ({slots.shape[0]}) must "
                             f"have one entry per row ({n})")
        for i in range(n):
            if kinds[i] == KIND_GROW:
                num_grow += 1
                if self.c_nblocks[rows[i]] >= self.width:
                    return self.c_nblocks[rows[i]] + 1
            elif kinds[i] == KIND_COW:
                copied += 1
        if new.shape[0] != num_grow + copied:
            raise ValueError(f"{num_grow + copied} new blocks needed, {new.shape[0]} given")
        if n:
            self._extend(rows, &kinds[0], &new[0] if new.shape[0] else NULL, 1,
                         &new[num_grow] if copied else NULL, block_size, now, &slots[0])
        return 0

    cdef void _extend(self, const int64_t[::1] rows, const uint8_t* kinds,
                      const int32_t* grown, Py_ssize_t step, const int32_t* copies,
                      int64_t block_size, double now, int64_t* slots) noexcept:
        """``extend_rows``' loop over checked arguments: the GROW rows take ``grown[0]``,
        ``grown[step]``, ... in row order, the COW rows ``copies[0]``, ``copies[1]``, ..."""
        # locals: a store through one pointer may not alias another, nor the tick
        cdef int32_t* tables = self.c_tables
        cdef int64_t* lens = self.c_lens
        cdef int64_t* nblocks = self.c_nblocks
        cdef int64_t* last_block = self.c_last_block
        cdef int64_t* last_slot = self.c_last_slot
        cdef double* accessed = self.c_accessed
        cdef int64_t* recency = self.c_recency
        cdef int64_t width = self.width, mask = block_size - 1, tick = self.tick, block
        cdef int64_t row, count, length
        cdef Py_ssize_t i, g = 0, c = 0
        for i in range(rows.shape[0]):
            row = rows[i]
            count = nblocks[row]
            block = last_block[row]
            if kinds[i] == KIND_GROW:
                block = grown[g * step]
                tables[row * width + count] = <int32_t>block
                nblocks[row] = count + 1
                g += 1
            elif kinds[i] == KIND_COW:
                block = copies[c]
                tables[row * width + count - 1] = <int32_t>block
                c += 1
            last_block[row] = block
            length = lens[row]
            last_slot[row] = slots[i] = block * block_size + (length & mask)
            lens[row] = length + 1
            tick += 1
            accessed[row] = now
            recency[row] = tick
        self.tick = tick

    def append_plain(self, const int64_t[::1] rows, const int32_t[::1] free,
                     Py_ssize_t top, int32_t[::1] ref_cnt, int64_t block_size, double now,
                     int64_t[::1] slots):
        """An append's common case in one call (``need``, ``pop_blocks`` and
        ``extend_rows``): one more token for each of ``rows`` (distinct), the rows whose
        last block is full taking new blocks off the top of the free stack ``free[:top]``
        (ref count 1; the caller lowers its top by the count returned). Returns -1,
        changing nothing, where the case does not hold: a last block with other holders
        (copy-on-write), a full table, or fewer blocks on the stack than needed."""
        self._check_rows(rows)
        cdef Py_ssize_t i, n = rows.shape[0], blocks = ref_cnt.shape[0]
        if slots.shape[0] != n or not 0 <= top <= free.shape[0]:
            raise ValueError(f"slots ({slots.shape[0]}) must have one entry per row ({n}), "
                             f"top {top} lie in [0, {free.shape[0]}]")
        if n == 0:
            return 0
        cdef uint8_t* k = <uint8_t*>PyMem_Malloc(n)
        if k == NULL:
            raise MemoryError()
        cdef int64_t copies = 0, block, need
        try:
            need = self._kinds(rows, &ref_cnt[0] if blocks else NULL, blocks, block_size, k,
                               &copies)
            if copies or need > top:
                return -1
            for i in range(n):
                if k[i] == KIND_GROW and self.c_nblocks[rows[i]] >= self.width:
                    return -1
            for i in range(need):
                block = free[top - 1 - i]
                if not 0 <= block < blocks:
                    raise IndexError(f"free block {block} outside [0, {blocks})")
            for i in range(need):
                ref_cnt[free[top - 1 - i]] = 1
            self._extend(rows, k, &free[top - 1] if need else NULL, -1, NULL, block_size,
                         now, &slots[0])
            return need
        finally:
            PyMem_Free(k)



def pop_blocks(int32_t[::1] free, Py_ssize_t top, Py_ssize_t count, int32_t[::1] ref_cnt):
    """``count`` ids off the top of the free stack ``free[:top]`` (the last first), each
    given ref count 1: ``BlockPool.allocate``'s common case in one call. The caller lowers
    its top by ``count``."""
    if not 0 <= count <= top <= free.shape[0]:
        raise ValueError(f"cannot pop {count} of {top} free blocks")
    ids = np.empty(count, np.int32)
    cdef int32_t[::1] out = ids
    cdef Py_ssize_t i, blocks = ref_cnt.shape[0]
    cdef int32_t block
    for i in range(count):
        block = free[top - 1 - i]
        if not 0 <= block < blocks:
            raise IndexError(f"free block {block} outside [0, {blocks})")
        out[i] = block
    for i in range(count):
        ref_cnt[out[i]] = 1
    return ids


def query_slots(const int32_t[:, :] tables, const int32_t[:] lens, const int32_t[:] query_lens,
                const int32_t[:] ref_cnt, int64_t block_size):
    """The slots of each sequence's last ``query_lens`` tokens (int64, sequence by sequence;
    -1 for a position of a block shared with another sequence (ref count over 1) that an
    earlier sequence of this step writes already: each position of a shared block is
    written by the first sequence whose rows reach it, as a prefix hit in the same step as
    the prompt it hit needs; ``written[block]`` holds a bit a position so far):
    ``multi.query_slots``, a block's run of tokens at a time (no division a token). Every
    length, table column and block id is checked first or where read (ValueError,
    IndexError)."""
    cdef Py_ssize_t s, j, k = 0, n = lens.shape[0], width = tables.shape[1]
    cdef Py_ssize_t blocks = ref_cnt.shape[0]
    cdef int64_t total = 0, pos, end, col, off, run, block, base
    cdef dict written = {}  # shared block -> a bit for each position written this step
    cdef object seen
    if tables.shape[0] != n or query_lens.shape[0] != n:
        raise ValueError(f"{tables.shape[0]} tables, {n} lengths and {query_lens.shape[0]} "
                         "query lengths must pair up")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for s in range(n):
        if not 0 <= query_lens[s] <= lens[s] <= width * block_size:
            raise ValueError(f"sequence {s}: {query_lens[s]} query tokens of {lens[s]} do not "
                             f"fit [0, length] in {width} blocks of {block_size}")
        total += query_lens[s]
    slots = np.empty(total, np.int64)
    cdef int64_t[::1] out = slots
    for s in range(n):
        pos, end = lens[s] - query_lens[s], lens[s]
        col = pos // block_size
        off = pos - col * block_size
        while pos < end:
            block = tables[s, col]
            if not 0 <= block < blocks:
                raise IndexError(f"block {block} outside [0, {blocks})")
            run = min(block_size - off, end - pos)
            base = block * block_size + off
            if ref_cnt[block] > 1:  # (rare: a prefix hit or a fork in the step)
                seen = written.get(block, 0)
                for j in range(run):
                    out[k + j] = -1 if (seen >> (off + j)) & 1 else base + j
                written[block] = seen | (((1 << <object>run) - 1) << <object>off)  # (Python ints)
            else:
                for j in range(run):
                    out[k + j] = base + j
            k += run
            pos += run
            col += 1
            off = 0
    return slots
