# The per-sequence arrays in C, for ``_rows.RowArrays`` to extend: see _tables.pyx.
from libc.stdint cimport int32_t, int64_t


cdef class _Snapshot:
    cdef object rows, base, view, counts, lens, lens_view, slots, slots_view
    cdef Py_ssize_t width
    cdef long long touches
    cdef int32_t* c_tables
    cdef int64_t* c_counts
    cdef int32_t* c_lens
    cdef int64_t* c_slots

    cdef void copy_rows(self, _Snapshot narrower) noexcept
    cdef bint free(self)


cdef class RowStore:
    cdef object _tables, _lens, _nblocks, _last_slot, _last_block, _created, _accessed
    cdef object _recency
    cdef int32_t* c_tables
    cdef int64_t* c_lens
    cdef int64_t* c_nblocks
    cdef int64_t* c_last_slot
    cdef int64_t* c_last_block
    cdef double* c_accessed
    cdef int64_t* c_recency
    cdef Py_ssize_t width  # entries per block table
    cdef Py_ssize_t lengths[8]  # rows of each array; a row index must be below them all
    #: Recency ticks handed out so far (the next ``touch`` continues from here).
    cdef public long long tick
    #: Gathers served by bringing a free snapshot up to date (``gather_rows``).
    cdef public long long patched
    cdef long long touches  # Python uses of ``tables``: each voids the snapshots
    cdef list snapshots  # the last two ``_Snapshot``s

    cdef int _check_rows(self, const int64_t[::1] rows) except -1
    cdef bint _fill(self, const int64_t[::1] rows, _Snapshot snap, int64_t num_blocks,
                    int64_t block_size) except -1
