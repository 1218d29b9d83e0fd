# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A decode step's bookkeeping in C: ``append`` and ``batch`` of a KV cache at B sequences
are loops over B rows of C arrays, not NumPy calls (each of which costs a microsecond or
more whatever its size) nor Python objects per sequence.

``RowArrays`` owns the per-sequence arrays of ``cache.rows.SequenceRows`` (NumPy arrays,
each row one sequence): block tables (int32, padded with the null block 0), lengths and
block counts, last block and last reserved slot (int64; -1: none), created/accessed times
(float64 clock seconds) and recency ticks (int64, larger: used more recently). Setting an
array checks its dtype, shape and layout and rebinds the C pointer, so the C loops always
see the arrays Python sees; each loop checks every row it is given against the arrays'
length first (``IndexError``, nothing changed). ``gather_rows`` keeps its last two
snapshots of the tables and brings a free one up to date instead of copying every block of
every row. Not locked: the cache's lock covers calls.
"""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_STRIDES,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyBuffer_ToContiguous,
    PyObject_GetBuffer,
)
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport PyObject, _Py_REFCNT
from libc.string cimport memcpy, memset
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from rocmforge_raw._worksplit cimport SplitRule, split_into

import numpy as np

cdef enum:  # what ``need`` says of each row (the Python names below)
    KIND_PLAIN = 0
    KIND_GROW = 1
    KIND_COW = 2

#: What ``need`` says of each row: nothing new, a new block, or a private copy of a shared
#: last block (copy-on-write).
PLAIN, GROW, COW = KIND_PLAIN, KIND_GROW, KIND_COW

_DTYPES = {"tables": np.int32, "lens": np.int64, "nblocks": np.int64,
           "last_slot": np.int64, "last_block": np.int64, "created": np.float64,
           "accessed": np.float64, "recency": np.int64}


cdef Py_ssize_t _address(object array, str name, int ndim) except -1:
    """The data address of ``array`` after checking it is what field ``name`` holds."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(array).__name__}")
    if array.dtype != _DTYPES[name] or array.ndim != ndim:
        raise TypeError(f"{name} must be a {ndim}-d {np.dtype(_DTYPES[name])} array, got "
                        f"{array.ndim}-d {array.dtype}")
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError(f"{name} must be C-contiguous and writeable")
    return <Py_ssize_t>array.ctypes.data


cdef class RowArrays:
    """The per-sequence arrays and the C loops of a step over them (module docstring)."""

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

    @property
    def tables(self):
        self.touches += 1  # it may be written through: snapshots cannot tell
        return self._tables

    @tables.setter
    def tables(self, value):
        self.touches += 1
        self.c_tables = <int32_t*>_address(value, "tables", 2)
        self._tables, self.width, self.lengths[0] = value, value.shape[1], value.shape[0]

    @property
    def lens(self):
        return self._lens

    @lens.setter
    def lens(self, value):
        self.c_lens = <int64_t*>_address(value, "lens", 1)
        self._lens, self.lengths[1] = value, value.shape[0]

    @property
    def nblocks(self):
        return self._nblocks

    @nblocks.setter
    def nblocks(self, value):
        self.c_nblocks = <int64_t*>_address(value, "nblocks", 1)
        self._nblocks, self.lengths[2] = value, value.shape[0]

    @property
    def last_slot(self):
        return self._last_slot

    @last_slot.setter
    def last_slot(self, value):
        self.c_last_slot = <int64_t*>_address(value, "last_slot", 1)
        self._last_slot, self.lengths[3] = value, value.shape[0]

    @property
    def last_block(self):
        return self._last_block

    @last_block.setter
    def last_block(self, value):
        self.c_last_block = <int64_t*>_address(value, "last_block", 1)
        self._last_block, self.lengths[4] = value, value.shape[0]

    @property
    def created(self):
        return self._created

    @created.setter
    def created(self, value):
        _address(value, "created", 1)
        self._created, self.lengths[5] = value, value.shape[0]

    @property
    def accessed(self):
        return self._accessed

    @accessed.setter
    def accessed(self, value):
        self.c_accessed = <double*>_address(value, "accessed", 1)
        self._accessed, self.lengths[6] = value, value.shape[0]

    @property
    def recency(self):
        return self._recency

    @recency.setter
    def recency(self, value):
        self.c_recency = <int64_t*>_address(value, "recency", 1)
        self._recency, self.lengths[7] = value, value.shape[0]

    def __cinit__(self):
        self.snapshots = []

    cdef int _check_rows(self, const int64_t[::1] rows) except -1:
        """Every row index lies inside every array (else ``IndexError``)."""
        cdef Py_ssize_t i, limit = self.lengths[0]
        for i in range(1, 8):
            if self.lengths[i] < limit:
                limit = self.lengths[i]
        cdef uint64_t top = 0  # the largest row as unsigned: a negative one is huge
        for i in range(rows.shape[0]):  # a reduction the compiler vectorizes
            top = max(top, <uint64_t>rows[i])
        if top < <uint64_t>limit:
            return 0
        for i in range(rows.shape[0]):  # say which
            if not 0 <= rows[i] < limit:
                raise IndexError(f"row {rows[i]} outside the {limit} rows")
        return 0

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

    def gather_rows(self, object rows, int64_t num_blocks, int64_t block_size):
        """A step's host metadata of ``rows`` (int64, in order): block tables int32
        ``[n, width]`` (width: the most blocks a row holds, at least 1), lengths int32
        ``[n]`` and last slots int64 ``[n]``, and whether they are consistent (every id a
        length reaches in ``[0, num_blocks)``, every length within its row's blocks).

        The three are read-only views of a snapshot, never changed while anyone else holds
        any of them. A decode
        loop asks for the same ``rows`` object step after step, and between two steps only
        ``extend`` writes the tables, at each row's end: so a snapshot of these rows and
        this width that nobody holds any more is brought up to date by copying each row's
        blocks from its last one at the snapshot on (``patched`` counts those), O(rows)
        instead of O(rows x width). Any Python use of ``tables`` voids every snapshot."""
        cdef const int64_t[::1] r = rows
        self._check_rows(r)
        cdef Py_ssize_t i, n = r.shape[0], width = 1
        cdef int64_t count
        for i in range(n):
            count = self.c_nblocks[r[i]]
            if count > width:
                width = count
        if width > self.width:
            raise IndexError(f"a row holds {width} blocks, its table {self.width}")
        cdef _Snapshot snap = None, found = None, narrower = None
        for snap in self.snapshots:
            if snap.rows is rows and snap.touches == self.touches and snap.free():
                if snap.width == width:
                    found = snap
                    break
                if snap.width < width:
                    narrower = snap
        if found is None:
            found = _Snapshot(rows, n, width, self.touches)
            if narrower is not None:  # the tables widened: start from it, not from scratch
                found.copy_rows(narrower)
                self.snapshots.remove(narrower)
            elif len(self.snapshots) == 2:
                self.snapshots.pop(0)
            self.snapshots.append(found)
        if n and found.c_counts[0] >= 0:  # brought up to date, not gathered from scratch
            self.patched += 1
        sound = self._fill(r, found, num_blocks, block_size)
        return found.view, found.lens_view, found.slots_view, sound

    cdef bint _fill(self, const int64_t[::1] rows, _Snapshot snap, int64_t num_blocks,
                    int64_t block_size) except -1:
        """Bring ``snap`` up to date for ``rows`` (copying each row's blocks from its count
        at the snapshot, minus one: the last may have been replaced by a private copy), and
        fill its lengths and slots; whether every length and copied id is in range."""
        cdef Py_ssize_t i, j, n = rows.shape[0], width = snap.width
        cdef int32_t* t = snap.c_tables
        cdef int64_t* counts = snap.c_counts
        cdef int32_t* ln = snap.c_lens
        cdef int64_t* sl = snap.c_slots
        cdef int32_t* src
        cdef int64_t row, count, length, start, end
        cdef bint sound = True
        cdef uint32_t bad = 0, limit = <uint32_t>min(max(num_blocks, 0), 0xFFFFFFFF)
        for i in range(n):
            row = rows[i]
            count = self.c_nblocks[row]
            length = self.c_lens[row]
            src = &self.c_tables[row * self.width]
            start, end = counts[i] - 1, count  # the last block at the snapshot, on
            if start < 0 or count < counts[i]:  # first gather, or not extend's growth: all
                start, end = 0, width
            if end == count and count - start <= 2:  # a step's one or two, without the
                if start < count:                     # vector loop's set-up
                    t[start] = src[start]
                    bad |= <uint32_t>src[start] >= limit
                if start + 1 < count:
                    t[start + 1] = src[start + 1]
                    bad |= <uint32_t>src[start + 1] >= limit
            else:
                for j in range(start, count):  # a copy and a range check, vectorized
                    t[j] = src[j]
                    bad |= <uint32_t>src[j] >= limit  # (a negative id is huge unsigned)
                for j in range(count, end):  # padding (kept since the snapshot otherwise)
                    t[j] = 0
            counts[i] = count
            t += width
            if not 0 <= length <= count * block_size or length > 0x7FFFFFFF:
                sound = False
            ln[i] = <int32_t>length
            sl[i] = self.c_last_slot[row]
        return sound and not bad


cdef class _Snapshot:
    """Metadata gathered for one ``rows`` object: block tables (``base``, owned here, int32
    ``[n, width]``), lengths (int32 ``[n]``) and last slots (int64 ``[n]``), handed out as
    read-only views (``view``, ``lens_view``, ``slots_view``; the C loops write through the
    pointers); each row's block count when last gathered (-1 before the first: ``_fill``
    then copies all and zero-pads) and the ``touches`` of the tables then."""

    cdef object rows, base, view, counts, lens, lens_view, slots, slots_view
    cdef Py_ssize_t width
    cdef long long touches
    cdef int32_t* c_tables
    cdef int64_t* c_counts
    cdef int32_t* c_lens
    cdef int64_t* c_slots

    def __init__(self, rows, Py_ssize_t n, Py_ssize_t width, long long touches):
        self.rows, self.width, self.touches = rows, width, touches
        self.base = np.empty((n, width), np.int32)
        self.counts = np.full(n, -1, np.int64)
        self.lens = np.empty(n, np.int32)
        self.slots = np.empty(n, np.int64)
        cdef int32_t[:, ::1] tables = self.base
        cdef int64_t[::1] counts = self.counts
        cdef int32_t[::1] lens = self.lens
        cdef int64_t[::1] slots = self.slots
        self.c_tables = &tables[0, 0] if n else NULL
        self.c_counts = &counts[0] if n else NULL
        self.c_lens = &lens[0] if n else NULL
        self.c_slots = &slots[0] if n else NULL
        self.view, self.lens_view, self.slots_view = (
            _frozen(self.base), _frozen(self.lens), _frozen(self.slots))

    cdef void copy_rows(self, _Snapshot narrower) noexcept:
        """Take ``narrower``'s tables (each row zero-padded to this width) and counts: its
        state, from which ``_fill`` patches as from ``narrower``."""
        cdef Py_ssize_t i, n = len(self.counts), old = narrower.width
        for i in range(n):
            memcpy(&self.c_tables[i * self.width], &narrower.c_tables[i * old],
                   old * sizeof(int32_t))
            memset(&self.c_tables[i * self.width + old], 0,
                   (self.width - old) * sizeof(int32_t))
            self.c_counts[i] = narrower.c_counts[i]

    cdef bint free(self):
        """Whether nobody but this snapshot holds its arrays (each view by this snapshot
        alone, each base by this snapshot and its view): what it handed out was dropped."""
        return (_Py_REFCNT(<PyObject*>self.view) == 1
                and _Py_REFCNT(<PyObject*>self.lens_view) == 1
                and _Py_REFCNT(<PyObject*>self.slots_view) == 1
                and _Py_REFCNT(<PyObject*>self.base) == 2
                and _Py_REFCNT(<PyObject*>self.lens) == 2
                and _Py_REFCNT(<PyObject*>self.slots) == 2)


cdef object _frozen(object array):
    """A read-only view of ``array``."""
    view = array.view()
    view.flags.writeable = False
    return view


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
