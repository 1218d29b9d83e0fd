# cython: language_level=3, binding=True
"""The process-wide registry of live root allocations, and the finalizer that frees them.

A root HipBuffer registers a weakref whose callback, held here and never referencing the
buffer, frees its memory: once (the record leaves ``live`` first), on the owning device
(the record's allocator and device), never in a forked child (records carry the allocation
generation, bumped in a child) and never once the interpreter is exiting (after this
module's ``atexit`` hook). ``close()`` releases the same record early and drops the weakref,
so its callback never runs. The counters are what ``memory_stats()`` and the soak tool read.

Thread safety comes from the GIL, which this module keeps (it does not declare itself
free-threading compatible): each update of ``live`` and the counters is a run of C with no
Python code and no allocation of a GC-tracked object in it, so no other thread and no
finalizer can run in the middle of one. Records and weakrefs are made before.
"""

import atexit
import os
import sys
import traceback
from dataclasses import dataclass, field

cimport cython
from cpython.dict cimport PyDict_Values
from cpython.weakref cimport PyWeakref_NewRef
from libc.stdint cimport uintptr_t

from rocmforge_raw.runtime._alloc cimport Allocator

cdef unsigned long _generation = 0  # bumped in a forked child: older records are not ours
cdef bint _exiting = False          # set at exit: the process is about to free everything


cdef unsigned long current_generation() noexcept:
    """The allocation generation of this process (it changes in a forked child)."""
    return _generation


cdef bint owns_memory_of(unsigned long generation) noexcept:
    """Whether memory allocated in ``generation`` is this process's to free, now."""
    return generation == _generation and not _exiting


@dataclass
class Allocation:
    """One live root allocation as the registry reports it."""

    nbytes: int
    device: int
    backend: str
    stack: list[str] | None = field(default=None, repr=False)


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
cdef class Registry:
    """Every live root allocation, keyed by its buffer's weakref, and the counters."""

    def __init__(self):
        self.live = {}
        self.track_stacks = os.environ.get("RF_TRACK_STACKS", "") not in ("", "0")

    cdef object add(self, object buf, size_t nbytes, int device, Allocator allocator,
                    uintptr_t ptr):
        """Register ``buf``'s allocation; return the weakref that ``release`` takes."""
        cdef _Record record = _Record.__new__(_Record)
        record.nbytes, record.device, record.ptr = nbytes, device, ptr
        record.allocator, record.generation = allocator, _generation
        if self.track_stacks:
            record.stack = traceback.format_stack()  # compiled frames are not in it
        ref = PyWeakref_NewRef(buf, _on_dead_callback)
        self.live[ref] = record  # atomic from here on
        self.live_bytes += nbytes
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
        if record.ptr == 0 or not owns_memory_of(record.generation):
            return
        try:
            record.allocator.free_ptr(record.ptr, record.nbytes, record.device)
        except BaseException as exc:  # a finalizer must never raise: say what leaked instead
            try:
                sys.stderr.write(f"rocmforge_raw: freeing {record.nbytes} bytes at "
                                 f"{record.ptr:#x} on device {record.device} failed: {exc}\n")
            except BaseException:
                pass


cdef Registry _registry = Registry()
registry = _registry  # what buffer.pyx types as its registry


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


def memory_stats():
    """Counters of root buffers: live count and bytes, peak bytes, allocations and frees."""
    cdef size_t count = len(_registry.live), live = _registry.live_bytes
    cdef size_t peak = _registry.peak_bytes
    cdef size_t allocs = _registry.num_allocs, frees = _registry.num_frees
    return {"live_buffers": count, "live_bytes": live, "peak_bytes": peak,
            "num_allocs": allocs, "num_frees": frees}


def live_allocations():
    """Records of every live root buffer (with creation stacks when ``RF_TRACK_STACKS=1``)."""
    cdef _Record r
    result = []
    for r in PyDict_Values(_registry.live):  # a consistent snapshot, even if a GC runs
        result.append(Allocation(r.nbytes, r.device, r.allocator.backend.name, r.stack))
    return result


def reset_peak():
    """Set ``peak_bytes`` to the bytes live now."""
    _registry.peak_bytes = _registry.live_bytes


def track_stacks(enabled):
    """Record (or stop recording) creation stacks of new buffers, as ``RF_TRACK_STACKS=1``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"track_stacks takes True or False, got {enabled!r}")
    _registry.track_stacks = enabled


def live_buffers():
    """The live root buffers themselves (a diagnostic: who keeps a leaked buffer alive?
    ``gc.get_referrers`` of each answers). Holding the list keeps them alive."""
    return [buf for buf in (ref() for ref in list(_registry.live)) if buf is not None]
