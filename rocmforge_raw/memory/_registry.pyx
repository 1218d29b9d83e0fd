# cython: language_level=3, binding=True
"""The process-wide registry of root allocations: those in use, those waiting on the device,
and the finalizer that frees them.

A root HipBuffer registers a weakref whose callback, held here and never referencing the
buffer, frees its memory: once (the record leaves ``live`` first), on the owning device
(the record's allocator and device), never in a forked child (records carry the allocation
generation, bumped in a child) and never once the interpreter is exiting (after this
module's ``atexit`` hook). ``close()`` releases the same record early and drops the weakref,
so its callback never runs. The counters are what ``memory_stats()`` and the soak tool read.

Memory the device may still use is handed over instead (``retire``, ``defer_free``): it
leaves ``live`` and *waits* here with the event of its last use until ``free_waiting()``,
its owner's ``close()`` or interpreter exit frees it, each after that event has passed.
Nothing else frees it: a free (hipFree, cuMemFree, cuMemFreeHost) waits for the whole
device, which only a caller who asked for it may pay. Layers above register *holders*
(``add_holder``): functions that give back memory they keep for reuse, run first by
``free_waiting()`` and at exit.

Thread safety comes from the GIL, which this module keeps (it does not declare itself
free-threading compatible): each update of ``live``, ``waiting`` and the counters is a run of
C with no Python code and no allocation of a GC-tracked object in it, so no other thread and
no finalizer can run in the middle of one. Records, entries and weakrefs are made before.
"""

import atexit
import os
import sys
import traceback
from dataclasses import dataclass, field

cimport cython
from cpython.dict cimport PyDict_Keys, PyDict_Values
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
@cython.freelist(64)
cdef class Waiting:
    """Memory handed over until the device passes ``event``: a root buffer's record, or
    (``record`` None) other memory that ``free()`` frees (pinned host memory, say), which
    ``memory_stats`` counts apart from buffers."""
    cdef _Record record
    cdef object free
    cdef size_t nbytes
    cdef unsigned long generation
    cdef object event  # an Event whose latest record follows the memory's last use; None: freed


cdef void _free_record(_Record record) noexcept:
    """Free ``record``'s memory on its device, in its process; never raise."""
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


@cython.final
cdef class Registry:
    """Every live root allocation, keyed by its buffer's weakref; the memory waiting on the
    device (``Waiting`` entries, in the order handed over); the counters."""

    def __init__(self):
        self.live = {}
        self.waiting = {}
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
        if self.live_bytes + self.waiting_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes + self.waiting_bytes
        return ref

    cdef void release(self, object ref) noexcept:
        """Free ``ref``'s allocation once, on its device, in its process; never raise."""
        found = self.live.pop(ref, None)  # atomic until the free
        if found is None:
            return
        cdef _Record record = <_Record>found
        self.live_bytes -= record.nbytes
        self.num_frees += 1
        _free_record(record)

    cdef object retire(self, object ref, object event):
        """Move ``ref``'s allocation from ``live`` to ``waiting`` until the device has passed
        ``event``; return its entry (None when ``ref`` is not live). Frees nothing."""
        if _exiting:  # too late to wait: the process frees everything now
            self.release(ref)
            return None
        cdef Waiting entry = Waiting.__new__(Waiting)
        entry.event, entry.generation = event, _generation
        found = self.live.pop(ref, None)  # atomic until the entry waits
        if found is None:
            return None
        entry.record = <_Record>found
        entry.nbytes = entry.record.nbytes
        self.live_bytes -= entry.nbytes
        self.waiting[entry] = True
        self.waiting_bytes += entry.nbytes
        self.num_waiting += 1
        return entry

    cdef object defer(self, object free, size_t nbytes, object event):
        """An entry that waits until the device has passed ``event``, then calls ``free()``."""
        cdef Waiting entry = Waiting.__new__(Waiting)
        entry.free, entry.nbytes, entry.event = free, nbytes, event
        entry.generation = _generation
        self.waiting[entry] = True  # atomic from here on
        self.other_bytes += nbytes
        self.num_other += 1
        return entry

    cdef size_t free(self, object waiting) noexcept:
        """Free ``waiting``'s memory (its event has passed) once; the bytes freed."""
        if self.waiting.pop(waiting, None) is None:  # atomic until the free
            return 0  # freed already
        cdef Waiting entry = <Waiting>waiting
        entry.event = None
        if entry.record is not None:
            self.waiting_bytes -= entry.nbytes
            self.num_waiting -= 1
            self.num_frees += 1
            _free_record(entry.record)
            return entry.nbytes
        self.other_bytes -= entry.nbytes
        self.num_other -= 1
        free, entry.free = entry.free, None
        if owns_memory_of(entry.generation):
            try:
                free()
            except BaseException as exc:  # as _free_record: say what leaked
                try:
                    sys.stderr.write(f"rocmforge_raw: freeing {entry.nbytes} bytes handed "
                                     f"over with defer_free failed: {exc}\n")
                except BaseException:
                    pass
        return entry.nbytes


cdef Registry _registry = Registry()
registry = _registry  # what buffer.pyx types as its registry
_holders = []  # add_holder's functions, in the order added


def _on_dead(ref):
    _registry.release(ref)


cdef object _on_dead_callback = _on_dead


def _after_fork_in_child():
    global _generation
    _generation += 1


def defer_free(free, nbytes, event):
    """Hand over memory the registry does not hold (pinned host memory, say) that the device
    may use until it has passed ``event`` (an ``Event`` recorded after that use): ``free()``
    frees it then, as ``free_waiting()`` or interpreter exit or ``free_entry`` of the entry
    returned gets to it (never in a forked child). ``nbytes`` is only counted
    (``waiting_other_bytes``)."""
    return _registry.defer(free, nbytes, event)


def free_entry(entry):
    """Wait until the device has passed ``entry``'s event, then free its memory; the bytes
    freed (0 when it was freed already). Raises what the wait raised, the entry waiting on."""
    cdef Waiting waiting = <Waiting?>entry
    event = waiting.event
    if event is not None and owns_memory_of(waiting.generation):
        if event.closed:  # its owner closed it: the whole device is waited for instead
            event.backend.synchronize(event.device)
        else:
            event.synchronize()
    return _registry.free(waiting)


def add_holder(release):
    """Have ``free_waiting()`` (and interpreter exit) call ``release()`` first: a layer above
    that keeps memory for reuse (the one-off ops' staging rings) gives it back there."""
    if not callable(release):
        raise TypeError(f"add_holder takes a function, got {type(release).__name__}")
    if release not in _holders:
        _holders.append(release)


def free_waiting():
    """Free every memory waiting on the device, each once the device has passed its event,
    after the holders (``add_holder``) gave back what they keep: this waits for the device
    (an event at a time), so call it where a wait is wanted (tests, teardown, the end of a
    phase). Returns the bytes of waiting memory freed (buffers and other memory; what the
    holders free themselves is not counted). A failed wait raises, leaving that memory and
    what follows it waiting."""
    for release in list(_holders):
        release()
    cdef size_t freed = 0
    for entry in PyDict_Keys(_registry.waiting):  # a snapshot: finalizers may add
        freed += free_entry(entry)
    return freed


def _at_exit():
    """Free what waits (``free_waiting``, before the registry stops freeing), never raising:
    a failure is one line on stderr."""
    global _exiting
    failed, first = 0, None
    try:
        for release in list(_holders):
            try:
                release()
            except BaseException as exc:
                failed, first = failed + 1, first or exc
        for entry in PyDict_Keys(_registry.waiting):
            try:
                free_entry(entry)
            except BaseException as exc:
                failed, first = failed + 1, first or exc
        if failed:
            left = _registry.waiting_bytes + _registry.other_bytes
            sys.stderr.write(f"rocmforge_raw: at exit, {failed} free(s) of memory waiting on "
                             f"the device failed ({left} bytes left to the process's end): "
                             f"{type(first).__name__}: {first}\n")
    except BaseException:
        pass
    finally:
        _exiting = True


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)


def memory_stats():
    """The registry's counters, of root buffers unless named otherwise:

    - ``live_buffers``, ``live_bytes``: buffers in use (not closed, not handed over);
    - ``waiting_buffers``, ``waiting_bytes``: buffers closed with ``release_after`` whose
      memory waits for the device to pass its last use (``free_waiting()`` frees it);
    - ``waiting_other``, ``waiting_other_bytes``: other memory waiting the same way
      (``defer_free``: pinned host staging memory);
    - ``peak_bytes``: the most buffer bytes allocated and not yet freed (live + waiting)
      at any one time since start or ``reset_peak()``;
    - ``num_allocs``, ``num_frees``: buffers allocated, and buffers whose memory was freed
      (a waiting buffer counts once freed), since start.
    Sizes are bytes. ``num_allocs - num_frees == live_buffers + waiting_buffers``."""
    cdef size_t count = len(_registry.live), live = _registry.live_bytes
    cdef size_t waiting = _registry.num_waiting, waiting_bytes = _registry.waiting_bytes
    cdef size_t other = _registry.num_other, other_bytes = _registry.other_bytes
    cdef size_t peak = _registry.peak_bytes
    cdef size_t allocs = _registry.num_allocs, frees = _registry.num_frees
    return {"live_buffers": count, "live_bytes": live, "waiting_buffers": waiting,
            "waiting_bytes": waiting_bytes, "waiting_other": other,
            "waiting_other_bytes": other_bytes, "peak_bytes": peak, "num_allocs": allocs,
            "num_frees": frees}


def live_allocations():
    """Records of every live root buffer (with creation stacks when ``RF_TRACK_STACKS=1``)."""
    cdef _Record r
    result = []
    for r in PyDict_Values(_registry.live):  # a consistent snapshot, even if a GC runs
        result.append(Allocation(r.nbytes, r.device, r.allocator.backend.name, r.stack))
    return result


def reset_peak():
    """Set ``peak_bytes`` to the buffer bytes allocated and not freed now (live + waiting)."""
    _registry.peak_bytes = _registry.live_bytes + _registry.waiting_bytes


def track_stacks(enabled):
    """Record (or stop recording) creation stacks of new buffers, as ``RF_TRACK_STACKS=1``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"track_stacks takes True or False, got {enabled!r}")
    _registry.track_stacks = enabled


def live_buffers():
    """The live root buffers themselves (a diagnostic: who keeps a leaked buffer alive?
    ``gc.get_referrers`` of each answers). Holding the list keeps them alive."""
    return [buf for buf in (ref() for ref in list(_registry.live)) if buf is not None]
