# cython: language_level=3, binding=True
"""The compiled core of HipBuffer: ownership, release, and the live-allocation registry.

``BufferCore`` is HipBuffer's base type. A root buffer owns ``nbytes`` bytes at ``ptr`` on
``device`` of ``backend``, got from an ``Allocator`` (the backend's raw malloc or a
``MemoryPool``), and gives them back exactly once: through ``close()``/``with``, or through a
weakref callback that the registry holds and that never references the buffer. The callback
frees on the owning device, never in a forked child (allocation generations), and never once
the interpreter is exiting (after this module's ``atexit`` hook). A view borrows its parent's
memory, keeps the parent alive and frees nothing. Sizes and offsets are in bytes.

This is C because it is the path every allocation takes: ``bench --alloc`` holds it to
1.10 × the bare binding calls, and to under a microsecond with a pool.
"""

import atexit
import operator
import os
import sys
import traceback

cimport cython
from cpython.dict cimport PyDict_Values
from cpython.weakref cimport PyWeakref_NewRef
from libc.limits cimport INT_MAX
from libc.stdint cimport uintptr_t

from rocmforge_raw.runtime._alloc cimport Allocator

from .errors import BackendUnavailableError, BufferClosedError, OutOfMemoryError
from .runtime import get_backend

#: Requests above this many bytes are checked against the device's total memory first.
cdef object _LARGE = 1 << 30

cdef unsigned long _generation = 0  # bumped in a forked child: older records are not ours
cdef bint _exiting = False          # set at exit: the process is about to free everything


@cython.final
@cython.freelist(256)
cdef class _Record:
    """One live root allocation, as the registry holds it (never the buffer itself)."""
    cdef size_t nbytes
    cdef int device
    cdef Allocator allocator
    cdef uintptr_t ptr
    cdef unsigned long generation
    cdef object stack


@cython.final
cdef class _Registry:
    """Every live root allocation, keyed by its buffer's weakref, and the counters.

    Thread safety comes from the GIL, which this module keeps (it does not declare itself
    free-threading compatible): each update of ``live`` and the counters is a run of C with no
    Python code and no allocation of a GC-tracked object in it, so no other thread and no
    finalizer can run in the middle of one. Records and weakrefs are made before.
    """
    cdef dict live
    cdef size_t live_bytes, peak_bytes, num_allocs, num_frees
    cdef public bint track_stacks

    def __init__(self):
        self.live = {}
        self.track_stacks = os.environ.get("RF_TRACK_STACKS", "") not in ("", "0")

    cdef object add(self, BufferCore buf, Allocator allocator, uintptr_t ptr):
        cdef _Record record = _Record.__new__(_Record)
        record.nbytes, record.device, record.ptr = buf.nbytes, buf.device, ptr
        record.allocator, record.generation = allocator, _generation
        if self.track_stacks:
            record.stack = traceback.format_stack()  # compiled frames are not in it
        ref = PyWeakref_NewRef(buf, _on_dead_callback)
        self.live[ref] = record  # atomic from here on
        self.live_bytes += record.nbytes
        self.num_allocs += 1
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return ref

    cdef void release(self, object ref) noexcept:
        """Free ``ref``'s allocation once, on its device, in its process; never raise."""
        found = self.live.pop(ref, None)  # atomic until the free
        if found is None:
            return
        cdef _Record record = <_Record>found
        self.live_bytes -= record.nbytes
        self.num_frees += 1
        if record.ptr == 0 or record.generation != _generation or _exiting:
            return
        try:
            record.allocator.free_ptr(record.ptr, record.nbytes, record.device)
        except BaseException as exc:  # a finalizer must never raise: say what leaked instead
            try:
                sys.stderr.write(f"rocmforge_raw: freeing {record.nbytes} bytes at "
                                 f"{record.ptr:#x} on device {record.device} failed: {exc}\n")
            except BaseException:
                pass

    def stats(self):
        cdef size_t count = len(self.live), live = self.live_bytes, peak = self.peak_bytes
        cdef size_t allocs = self.num_allocs, frees = self.num_frees
        return {"live_buffers": count, "live_bytes": live, "peak_bytes": peak,
                "num_allocs": allocs, "num_frees": frees}

    def records(self):
        """(nbytes, device, backend name, creation stack or None) of each live allocation."""
        cdef _Record r
        result = []
        for r in PyDict_Values(self.live):  # a consistent snapshot, even if a GC runs
            result.append((r.nbytes, r.device, r.allocator.backend.name, r.stack))
        return result

    def reset_peak(self):
        self.peak_bytes = self.live_bytes


cdef _Registry _registry = _Registry()
registry = _registry


def _on_dead(ref):
    _registry.release(ref)


cdef object _on_dead_callback = _on_dead


def _after_fork_in_child():
    global _generation
    _generation += 1


def _at_exit():
    global _exiting
    _exiting = True


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)

cdef object _default_pool = None


def set_allocator(pool):
    """Route new buffers on ``pool``'s backend and device through ``pool`` (None: raw malloc)."""
    global _default_pool
    if pool is not None and not isinstance(pool, Allocator):
        raise TypeError(f"set_allocator takes a MemoryPool or None, not {type(pool).__name__}")
    _default_pool = pool


def get_allocator():
    """The pool ``set_allocator`` installed, or None."""
    return _default_pool


def index(value, what):
    """``value`` as a non-negative ``int``; a clear ``TypeError``/``ValueError`` otherwise."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}") from None
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {number}")
    return number


def device_index(value):
    """``value`` as a device ordinal: a non-negative ``int`` that fits a C ``int``."""
    number = index(value, "device")
    if number > INT_MAX:
        raise BackendUnavailableError(f"device {number} does not exist")
    return number


cdef class BufferCore:
    """``nbytes`` of device memory, owned (root) or borrowed from a parent (view).

    ``ptr`` is the device address as an ``int``; ``nbytes`` is fixed; ``device`` and
    ``backend`` say where the memory lives. Using a closed buffer, or a view of one, raises
    ``BufferClosedError``.
    """
    cdef readonly object backend
    cdef readonly int device
    cdef readonly size_t nbytes
    cdef uintptr_t addr
    cdef readonly object _parent
    cdef bint view_closed
    cdef object ref  # the registry's key while a root is open; None for views and once closed
    cdef object __weakref__

    def __init__(self, nbytes, device=None, backend=None, *, pool=None):
        if type(nbytes) is not int or nbytes < 0:
            nbytes = index(nbytes, "nbytes")
        if device is not None and (type(device) is not int or not 0 <= device <= INT_MAX):
            device = device_index(device)
        if pool is None:
            if _default_pool is not None and _default_pool.serves(backend, device):
                pool = _default_pool
        elif (backend is not None or device is not None) and not pool.serves(backend, device):
            raise ValueError(f"{pool!r} cannot allocate on backend {backend} device {device}")
        cdef Allocator allocator
        if pool is not None:
            allocator = <Allocator?>pool
            self.backend, self.device = allocator.backend, allocator.device
        else:
            self.backend = get_backend(backend)
            self.device = self.backend.get_device() if device is None else device
            allocator = self.backend.allocator
        if nbytes > _LARGE and nbytes > self.backend.capacity(self.device):
            free, total = self.backend.mem_info(self.device)
            raise OutOfMemoryError("HipBuffer", nbytes, free, total, 2,
                                   "larger than the device's memory")
        self.nbytes = nbytes
        if self.nbytes:
            self.addr = allocator.alloc_ptr(self.nbytes, self.device)
            try:
                self.ref = _registry.add(self, allocator, self.addr)
            except BaseException:
                allocator.free_ptr(self.addr, self.nbytes, self.device)
                raise
        else:
            self.ref = _registry.add(self, allocator, 0)

    cdef BufferCore _view(self, uintptr_t addr, size_t nbytes):
        """A view of ``nbytes`` at ``addr`` (already bounds-checked) of this buffer."""
        cdef BufferCore view = type(self).__new__(type(self))
        view.backend, view.device, view.nbytes = self.backend, self.device, nbytes
        view.addr, view._parent = addr, self
        return view

    def _make_view(self, addr, nbytes):
        return self._view(addr, nbytes)

    cdef BufferCore owner(self):
        cdef BufferCore buf = self
        while buf._parent is not None:
            buf = buf._parent
        return buf

    @property
    def root(self):
        """The buffer that owns the memory (``self`` for a root buffer)."""
        return self.owner()

    @property
    def closed(self):
        return self.view_closed or self.owner().ref is None

    @property
    def ptr(self):
        """The device address as an ``int``; raises ``BufferClosedError`` once closed."""
        if self.ref is None and self.closed:  # an open root has its ref: no walk needed
            raise BufferClosedError(f"{self!r} was closed; its memory is no longer valid")
        return self.addr

    @property
    def _ptr(self):
        """The address, closed or not (for messages)."""
        return self.addr

    def close(self):
        """Free the memory now (root) or stop using it (view). Idempotent."""
        if self._parent is None:
            ref, self.ref = self.ref, None  # the dropped ref's callback never runs
            if ref is not None:
                _registry.release(ref)
        else:
            self.view_closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
