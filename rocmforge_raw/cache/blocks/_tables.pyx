# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The per-sequence arrays of ``cache.rows.SequenceRows`` in C (``RowStore``), and a step's
metadata gathered from them (``gather_rows``).

``RowStore`` owns NumPy arrays, each row one sequence: block tables (int32, padded with the
null block 0), lengths and block counts, last block and last reserved slot (int64; -1: none),
created/accessed times (float64 clock seconds) and recency ticks (int64, larger: used more
recently). Setting an array checks its dtype, shape and layout and rebinds the C pointer, so
the C loops (here and in ``_rows``) always see the arrays Python sees; each loop checks every
row it is given against the arrays' length first (``IndexError``, nothing changed).
``gather_rows`` keeps its last two snapshots of the tables and brings a free one up to date
instead of copying every block of every row. Not locked: the cache's lock covers calls.
"""

from cpython.ref cimport PyObject, _Py_REFCNT
from libc.string cimport memcpy, memset
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

import numpy as np

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


cdef class RowStore:
    """The per-sequence arrays and the gathering of a step's metadata (module docstring)."""

    # (its attributes: _tables.pxd)

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

    # (its attributes: _tables.pxd)

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
