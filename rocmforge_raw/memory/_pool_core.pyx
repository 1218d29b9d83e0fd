# cython: language_level=3, binding=True
"""The stream-ordered core of ``MemoryPool`` (``pool``): per-stream lanes of cached blocks and
the C path that takes and gives them, the events that show which blocks the device has passed,
and growing from and giving back to the device.

A lane (``_Lane``) holds the blocks freed on one stream (``None``: the default stream), one
C ring per size class (``_freelist``), and the events recorded after its frees. A block is
reused on its own stream at once (newest first) and goes to another stream only once an event
recorded after its free has completed: queried, never waited for (oldest first). The
invariants and the thread-safety argument are ``MemoryPool``'s (its docstring).
"""

from libc.stdint cimport SIZE_MAX, uintptr_t
from libc.stdlib cimport free

from rocmforge_raw.memory._freelist cimport (NUM_CLASSES, FreeList, class_of, pop_newest,
                                             pop_oldest, push, size_of_class)
from rocmforge_raw.memory._registry cimport owns_memory_of
from rocmforge_raw.runtime._alloc cimport Allocator

from collections import deque

from ..common import checks
from ..errors import BufferClosedError, OutOfMemoryError
from .stream import Stream

cdef object _LARGE = 1 << 30  # blocks above this are checked against the device's size
#: Events pending per stream; past this many the newest is recorded again (moved forward).
MAX_FENCES = 8


cdef bint stream_is_open(object stream):
    """Whether events may still be recorded on ``stream`` (its handle is not destroyed)."""
    return stream is None or stream._finalizer.alive


cdef class _Lane:
    """The blocks freed on one stream (``None``: the default stream) and the events that
    show which of them the device has passed: ``fences`` holds (seq, event), oldest first;
    a block whose seq is <= ``passed`` may go to another stream. Owned by one pool."""

    def __cinit__(self, stream):
        self.stream = stream
        self.fences = deque()

    def __dealloc__(self):
        cdef int index
        for index in range(NUM_CLASSES):
            free(self.lists[index].items)


cdef class PoolCore(Allocator):
    """The lanes and the C path of a ``MemoryPool`` (module docstring); its attributes are
    declared in ``_pool_core.pxd``."""

    def __dealloc__(self):
        if self.upstream is not None and owns_memory_of(self.generation):
            try:
                self.free_cached()
                self.drop_events()
            except BaseException:  # a finalizer never raises; the process keeps the blocks
                pass

    cdef int check_open(self) except -1:
        if self.is_closed:
            raise BufferClosedError("this MemoryPool was closed")
        return 0

    cdef _Lane lane(self, object stream):
        """The lane of ``stream`` (checked: an open Stream of this pool's backend object and
        device), not registered yet when it is new: ``register`` it once nothing can fail."""
        if stream is None:
            return self.default
        if not isinstance(stream, Stream):
            raise TypeError(f"stream must be a Stream or None, got {checks.show(stream)}")
        if not stream_is_open(stream):
            raise BufferClosedError(f"{stream!r} was closed")
        found = self.lanes.get(stream)
        if found is not None:
            return found
        checks.colocated("stream", stream.backend, stream.device, "this pool", self.backend,
                         self.device)
        return _Lane(stream)

    cdef _Lane register(self, _Lane lane):
        """``lane`` in the pool's lanes, or the lane registered meanwhile for its stream."""
        if lane.stream is None or self.lanes.get(lane.stream) is lane:
            return lane
        with self.lock:
            return self.lanes.setdefault(lane.stream, lane)

    cdef _Lane current(self, _Lane lane):
        """``lane``, or a new (unregistered) lane of its stream if ``free_all`` dropped it
        (no block is ever cached in a dropped lane)."""
        if lane.stream is None or self.lanes.get(lane.stream) is lane:
            return lane
        return _Lane(lane.stream)

    # --- the C path --------------------------------------------------------------------------
    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0:
        return self.take(self.default, nbytes)

    cdef int free_ptr(self, uintptr_t ptr, size_t nbytes, int device) except -1:
        return self.give(self.default, ptr, nbytes)

    cdef uintptr_t take(self, _Lane lane, size_t nbytes) except 0:
        """A block for work on ``lane``'s stream: its own newest, else another stream's
        oldest that the device has passed, else a new one."""
        cdef size_t size = 0
        cdef int index = class_of(nbytes, &size)
        if index < 0:
            raise OverflowError(f"a pool block of {nbytes} bytes is larger than any device")
        if self.is_closed:
            raise BufferClosedError("this MemoryPool was closed")
        cdef FreeList* blocks = &lane.lists[index]
        cdef uintptr_t ptr
        if blocks.count:  # a hit: one atomic step
            ptr = pop_newest(blocks)
            lane.blocks -= 1
            self.cached -= size
            self.hits += 1
            self.lent += 1
            return ptr
        if self.lanes or lane is not self.default:  # other lanes to take from
            ptr = self.take_passed(lane, index, size)
            if ptr:
                return ptr
        ptr = self.grow(size)
        self.misses += 1
        self.lent += 1
        return ptr

    cdef uintptr_t take_passed(self, _Lane taker, int index, size_t size) except? 0:
        """The oldest block of class ``index`` that another lane's events show passed, or 0."""
        cdef _Lane lane
        cdef FreeList* blocks
        cdef uintptr_t ptr
        with self.lock:
            for lane in [self.default, *self.lanes.values()]:
                if lane is taker or not lane.lists[index].count:
                    continue
                self.poll(lane)  # Python calls: the list may change meanwhile
                blocks = &lane.lists[index]
                if blocks.count and blocks.items[blocks.head].seq <= lane.passed:
                    ptr = pop_oldest(blocks)  # checked and taken in one atomic step
                    lane.blocks -= 1
                    self.cached -= size
                    self.hits += 1
                    self.handoffs += 1
                    self.lent += 1
                    return ptr
        return 0

    cdef int give(self, _Lane lane, uintptr_t ptr, size_t nbytes) except -1:
        cdef size_t size = 0
        cdef int index = class_of(nbytes, &size)
        if push(&lane.lists[index], ptr, lane.freed + 1) < 0:  # no host memory for the list
            self.lent -= 1
            self.reserved -= size
            self.upstream.free_ptr(ptr, size, self.device)
            return 0
        lane.freed += 1
        lane.blocks += 1
        self.cached += size
        self.lent -= 1
        if lane.stream is not None:
            try:
                self.fence(lane)
            except Exception:  # no event: the block stays on its own stream, which is safe
                pass
        return 0

    cdef record(self, event, handle):
        """Record ``event`` on the stream ``handle`` (None: the default stream of this pool's
        device, which a free in a finalizer may find inactive: it stays as it was)."""
        if handle is None:
            self.backend.restoring(self.device,
                                   lambda: self.backend.event_record(event, None))
        else:
            self.backend.event_record(event, handle)

    cdef int fence(self, _Lane lane) except -1:
        """Record an event on ``lane``'s stream after every free so far on it."""
        cdef unsigned long long seq
        if lane.freed == lane.fenced or not stream_is_open(lane.stream):
            return 0
        handle = None if lane.stream is None else lane.stream.handle
        with self.lock:
            seq = lane.freed  # read under the lock: fences are recorded in seq order
            if len(lane.fences) >= MAX_FENCES:  # move the newest forward, then say so
                event = lane.fences[-1][1]
                self.record(event, handle)
                lane.fences[-1] = (seq, event)
            else:
                event = self.spare_events.pop() if self.spare_events else (
                    self.backend.restoring(  # a finalizer's fence: the thread's device stays
                        self.device, lambda: self.backend.event_create(self.device)))
                try:
                    self.record(event, handle)
                except BaseException:
                    self.spare_events.append(event)
                    raise
                lane.fences.append((seq, event))
            lane.fenced = seq
        return 0

    cdef int poll(self, _Lane lane) except -1:
        """Advance ``lane.passed`` past the fences that completed (lock held), after fencing
        the default stream's frees that no event covers yet."""
        if lane.stream is None:
            self.fence(lane)
        fences = lane.fences
        while fences:
            seq, event = fences[0]
            if not self.backend.event_query(event):
                break
            fences.popleft()
            lane.passed = max(lane.passed, seq)
            self.spare_events.append(event)
        return 0

    cdef uintptr_t grow(self, size_t size) except 0:
        """A new block from the device, within the limit (cached blocks are given back only
        when that makes room)."""
        if self.reserved + size > self.cap:
            if self.reserved - self.cached + size > self.cap:
                raise OutOfMemoryError("MemoryPool", size, self.cap - self.reserved,
                                       self.cap, 2, "pool limit reached")
            self.free_cached()
            if self.reserved + size > self.cap:  # another thread took the room meanwhile
                raise OutOfMemoryError("MemoryPool", size, self.cap - self.reserved,
                                       self.cap, 2, "pool limit reached")
        if size > _LARGE and size > self.backend.capacity(self.device):
            free, total = self.backend.mem_info(self.device)
            raise OutOfMemoryError("MemoryPool", size, free, total, 2,
                                   "larger than the device's memory")
        self.reserved += size
        try:
            try:
                return self.upstream.alloc_ptr(size, self.device)
            except OutOfMemoryError:
                self.free_cached()
                return self.upstream.alloc_ptr(size, self.device)
        except BaseException:
            self.reserved -= size
            raise

    cdef int free_cached(self) except -1:
        """Give every cached block of every lane back to the device, one atomic take at a
        time."""
        cdef _Lane lane
        for lane in [self.default, *self.lanes.values()]:
            self.release(lane)
        return 0

    cdef int release(self, _Lane lane) except -1:
        cdef int index
        cdef size_t size
        cdef FreeList* blocks
        cdef uintptr_t ptr
        for index in range(NUM_CLASSES):
            blocks = &lane.lists[index]
            size = size_of_class(index)
            while blocks.count:
                ptr = pop_newest(blocks)
                lane.blocks -= 1
                self.cached -= size
                self.reserved -= size
                self.upstream.free_ptr(ptr, size, self.device)
        return 0

    cdef int drop_events(self) except -1:
        """Forget every lane's fences (no block is cached) and destroy the events."""
        cdef _Lane lane
        with self.lock:
            for lane in [self.default, *self.lanes.values()]:
                if lane.blocks == 0:
                    self.spare_events.extend(event for _, event in lane.fences)
                    lane.fences.clear()
                    lane.passed = lane.fenced = lane.freed
            while self.spare_events:
                self.backend.event_destroy(self.spare_events.pop(), self.device)
        return 0
