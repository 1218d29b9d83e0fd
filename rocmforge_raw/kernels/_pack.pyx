# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A staging slot's packing in C: launch metadata copied into pinned host memory in one call
(``copy_host``, ``pack_host``), and a decode step's metadata with the attention's work split
computed in place beside it (``pack_step``). Callers own the memory written (no check can see
it); every argument is checked before the first byte is written."""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_STRIDES,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyBuffer_ToContiguous,
    PyObject_GetBuffer,
)
from libc.string cimport memcpy

from rocmforge_raw.kernels.planning._worksplit cimport SplitRule, split_into

import numpy as np


cdef enum:
    COPY_PIECE_BYTES = 2048

#: Bytes ``copy_host`` copies at a time: glibc's memcpy takes ``rep movsb`` past 2-4 KiB,
#: which some x86 machines (AMD EPYC under a hypervisor, this project's CI among them) run
#: at 1.5 GB/s up to about 1 MiB; pieces this small keep its vector loop (45 GB/s there).
COPY_PIECE = COPY_PIECE_BYTES


cdef void _copy_pieces(size_t dst, const char* source, size_t total) noexcept nogil:
    """``total`` bytes from ``source`` to ``dst`` in pieces of ``COPY_PIECE`` bytes."""
    cdef size_t done = 0, step
    while done < total:
        step = COPY_PIECE_BYTES if total - done > COPY_PIECE_BYTES else total - done
        memcpy(<void*>(dst + done), source + done, step)
        done += step


def copy_host(size_t dst, object src):
    """Copy the bytes of ``src`` (a C-contiguous buffer; else the exporter raises) to
    host memory at ``dst``, in pieces of ``COPY_PIECE`` bytes. The caller owns the
    ``len(src)`` bytes at ``dst`` (no check can see them)."""
    cdef Py_buffer view
    PyObject_GetBuffer(src, &view, PyBUF_C_CONTIGUOUS)
    try:
        _copy_pieces(dst, <const char*>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)


def pack_host(size_t base, size_t capacity, list arrays, size_t start, size_t align):
    """Lay ``arrays`` (buffers, any layout) out from byte ``start`` on, each at the next
    multiple of ``align``: returns (end, offsets), ``end`` past the last one's bytes rounded
    up to ``align``. Their bytes (in C order) are copied to ``base + offset`` only when
    ``end <= capacity``: the caller owns ``capacity`` bytes at ``base`` (no check can see
    them). A staging slot's packing in one call (``Staging.put``)."""
    cdef Py_ssize_t i, n = len(arrays)
    cdef size_t end = start
    if align < 1:
        raise ValueError(f"align must be at least 1, got {align}")
    offsets = [0] * n
    sizes = [0] * n
    for i in range(n):
        sizes[i] = arrays[i].nbytes
        offsets[i] = end
        end += _rounded(sizes[i], align)
    if end > capacity:
        return end, offsets
    for i in range(n):
        _put(base + <size_t>offsets[i], arrays[i], sizes[i], i)
    return end, offsets


#: The most CTAs a launch's grid holds (x dimension).
MAX_GRID = (1 << 31) - 1


cdef inline size_t _rounded(size_t nbytes, size_t align) noexcept:
    return (nbytes + align - 1) // align * align  # (align >= 1: the callers check)


cdef void _put(size_t dst, object array, size_t nbytes, Py_ssize_t i) except *:
    """``array``'s ``nbytes`` bytes (any layout, in C order) to host memory at ``dst``."""
    cdef Py_buffer view
    PyObject_GetBuffer(array, &view, PyBUF_STRIDES)  # no format: numpy makes one
    try:
        if <size_t>view.len != nbytes:
            raise ValueError(f"array {i} changed size while packed")
        if PyBuffer_IsContiguous(&view, b'C'):
            _copy_pieces(dst, <const char*>view.buf, <size_t>view.len)
        else:  # strided: element by element, in C order
            PyBuffer_ToContiguous(<void*>dst, &view, view.len, b'C')
    finally:
        PyBuffer_Release(&view)


def pack_step(size_t base, size_t capacity, size_t align, object slots,
              const int[::1] lens, object tables, long long groups, long long ctas,
              tuple rule):
    """A decode step's staging in one call: ``[slots, lens, tables, cum16, first_seq]`` laid
    out from byte 0 as ``pack_host`` lays a list out, where ``cum16`` and ``first_seq`` are
    the work split of ``lens`` (``_worksplit.split_lengths`` over ``groups`` units a
    sequence and ``ctas`` slots, ``rule`` its constants from ``granule`` on), computed
    straight into that memory. The layout's bound gives ``first_seq`` room for
    ``max(ctas, n * groups, 1)`` CTAs (a split never has more: a wave at most, or one CTA a
    unit, ``_worksplit._whole`` and ``_lean``); nothing is written unless it fits in
    ``capacity`` bytes at ``base`` (the caller's). Arguments that do not fit together raise
    ``ValueError`` before any byte is written.

    Returns (end, offsets of the five, num_ctas, per_cta, total, whole, lean): ``end`` past
    the bytes written, rounded up to ``align``; ``num_ctas`` 0 when nothing was written,
    ``end`` then the bound to make room for; ``whole`` and ``lean`` as
    ``planning.WorkSplit``'s."""
    cdef Py_ssize_t n = lens.shape[0]
    if n < 1:
        raise ValueError("a step's staging needs at least one sequence")
    if align < 1:
        raise ValueError(f"align must be at least 1, got {align}")
    if not 0 <= ctas <= MAX_GRID:  # a grid's CTAs: also bounds first_seq's room below
        raise ValueError(f"ctas must be in [0, {MAX_GRID}], got {ctas}")
    if groups < 1:
        raise ValueError(f"groups must be at least 1, got {groups}")
    (granule, min_tokens, aligned_tokens, stretch, sms, piece_cost, quantum, margin,
     whole_waves, lone_fill, lean_slots, lean_tokens) = rule
    if granule < 1 or quantum < 1:
        raise ValueError(f"the rule's granule and quantum must be at least 1, got {rule}")
    cdef SplitRule c_rule = SplitRule(granule, min_tokens, aligned_tokens, stretch, sms,
                                      piece_cost, quantum, margin, whole_waves, lone_fill,
                                      lean_slots, lean_tokens)
    if slots.dtype != np.int64 or slots.shape != (n,):
        raise ValueError(f"slots must be int64 [{n}], got {slots.dtype} {slots.shape}")
    if tables.dtype != np.int32 or tables.ndim != 2 or tables.shape[0] != n:
        raise ValueError(f"tables must be int32 [{n}, width], got {tables.dtype} "
                         f"{tables.shape}")
    cdef size_t slots_bytes = slots.nbytes, tables_bytes = tables.nbytes
    if groups > MAX_GRID or n * groups > MAX_GRID:
        raise ValueError(f"{n} sequences of {groups} units make more CTAs than a grid's "
                         f"{MAX_GRID}")
    cdef Py_ssize_t room = max(ctas, n * groups, 1)
    cdef size_t at_lens = _rounded(slots_bytes, align)
    cdef size_t at_tables = at_lens + _rounded(4 * <size_t>n, align)
    cdef size_t at_cum16 = at_tables + _rounded(tables_bytes, align)
    cdef size_t at_first = at_cum16 + _rounded(8 * <size_t>(n + 1), align)
    cdef size_t bound = at_first + _rounded(4 * <size_t>room, align)
    if bound > capacity:
        return bound, (0, at_lens, at_tables, at_cum16, at_first), 0, 0, 0, False, False
    cdef long long per_cta, total
    cdef bint whole = False, lean = False
    cdef Py_ssize_t num_ctas = split_into(&lens[0], n, groups, ctas, &c_rule,
                                          <long long*>(base + at_cum16),
                                          <int*>(base + at_first), room, &per_cta, &total,
                                          &whole, &lean)
    if num_ctas < 1:
        raise RuntimeError(f"the work split of {n} sequences took more than {room} CTAs")
    _put(base, slots, slots_bytes, 0)
    _copy_pieces(base + at_lens, <const char*>&lens[0], 4 * <size_t>n)
    _put(base + at_tables, tables, tables_bytes, 2)
    return (at_first + _rounded(4 * <size_t>num_ctas, align),
            (0, at_lens, at_tables, at_cum16, at_first), num_ctas, per_cta, total, bool(whole),
            bool(lean))


def pack_pieces(size_t base, size_t capacity, const long long[:, ::1] spans,
                long long src_ptr, long long dst_ptr, long long src_nbytes,
                long long dst_nbytes, long long piece):
    """A span copy's piece table in one pass over ``spans`` (int64 ``[n, 3]``: src offset,
    dst offset, bytes): each span of ``src_nbytes`` at ``src_ptr`` and ``dst_nbytes`` at
    ``dst_ptr`` cut into rows (src address, dst address, bytes) of at most ``piece`` bytes
    (> 0), written as int64 at ``base`` when they fit in ``capacity`` bytes (the caller's;
    no check can see them). Empty spans are skipped.

    Returns (pieces, nbytes): ``nbytes`` the table's size (24 a piece; nothing written when
    past ``capacity``: make room and call again); ``pieces`` -1 (nothing written) unless
    every span lies in both buffers, every offset and size is a multiple of 16, and the
    non-empty spans' destinations ascend without overlapping: the caller then checks them
    the general way (``checks.spans``), which names what is wrong or copies them otherwise."""
    cdef Py_ssize_t i, n = spans.shape[0]
    cdef long long s, d, size, end = 0, count = 0, done, step
    if spans.shape[1] != 3 or piece <= 0:
        raise ValueError(f"spans must be [n, 3] and piece > 0, got {spans.shape[1]} columns, "
                         f"piece {piece}")
    for i in range(n):
        s, d, size = spans[i, 0], spans[i, 1], spans[i, 2]
        if (s < 0 or d < 0 or size < 0 or size > src_nbytes - s or size > dst_nbytes - d
                or (s | d | size) & 15):
            return -1, 0
        if size == 0:
            continue
        if d < end:  # out of order, or overlapping the last destination
            return -1, 0
        end = d + size
        count += (size + piece - 1) // piece
    cdef size_t nbytes = 24 * <size_t>count
    if nbytes > capacity:
        return count, nbytes
    cdef long long* row = <long long*>base
    with nogil:
        for i in range(n):
            s, d, size = spans[i, 0] + src_ptr, spans[i, 1] + dst_ptr, spans[i, 2]
            done = 0
            while done < size:
                step = piece if size - done > piece else size - done
                row[0], row[1], row[2] = s + done, d + done, step
                row += 3
                done += step
    return count, nbytes
