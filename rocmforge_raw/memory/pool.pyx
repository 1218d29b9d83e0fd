# cython: language_level=3, binding=True
"""MemoryPool: an opt-in caching allocator for HipBuffer (CuPy's ``set_allocator`` model),
stream-ordered.

Freed blocks stay cached per size class and are handed out again without a binding call.
Size classes: 512 bytes and up, each power of two split in four steps, so at most 25% of a
block is rounding. ``limit`` caps the bytes the pool holds from the device (in use + cached);
past it, cached blocks are released first, then ``OutOfMemoryError`` is raised. Raw
malloc/free stays the default: use ``HipBuffer(n, pool=p)`` or ``set_allocator(p)``.

Stream order (CuPy's model, with events): each stream has its own free lists (a *lane*). A
block freed on a stream is reused on that stream at once (the stream orders the new work
after the old), newest first. It goes to another stream only once an event recorded on the
freeing stream after the free has completed -- queried, never waited for -- oldest first.
``HipBuffer(n, pool=p.on(stream))`` and ``p.allocate(n, stream=stream)`` allocate and free
on ``stream`` (an open ``Stream`` of the pool's backend object and device); plain ``HipBuffer(n, pool=p)`` uses the default stream, the fast path: no
event at its frees; a fence event is recorded on the default stream only when another stream
looks for its blocks. Blocks freed on a stream record an event at the free (at most
``MAX_FENCES`` per stream are pending; past that the newest is recorded again).

Compiled, like HipBuffer, so that a pooled allocation and free stay under a microsecond:
the pool is an ``Allocator`` whose C methods HipBuffer calls directly, and each size class
keeps its cached pointers in a C ring (no Python objects on the hot path).
"""

import threading

from libc.stdint cimport SIZE_MAX, uintptr_t

from rocmforge_raw.memory._freelist cimport NUM_CLASSES, FreeList, class_of, size_of_class
from rocmforge_raw.memory._pool_core cimport PoolCore, _Lane, stream_is_open
from rocmforge_raw.memory._registry cimport current_generation
from rocmforge_raw.runtime._alloc cimport Allocator

from ..common import checks
from ..errors import BufferClosedError
from ..runtime import get_backend
from ._pool_core import MAX_FENCES

MIN_BLOCK = 512


def size_class(nbytes):
    """The block size that serves a request of ``nbytes`` > 0."""
    cdef size_t size = 0
    if class_of(nbytes, &size) < 0:
        raise OverflowError(f"a pool block of {nbytes} bytes is larger than any device")
    return size


cdef class MemoryPool(PoolCore):
    """Caches freed device blocks of one device for reuse, per stream. Thread-safe.

    Invariant: ``reserved`` bytes = bytes of blocks lent out + ``cached`` bytes; a block is
    either lent or in exactly one lane's free list, never both. Every call checks its
    arguments before it changes anything, and one that fails (a limit, a device out of
    memory) leaves the pool as it was, except that a device out of memory first gets the
    cached blocks back. ``close()`` gives everything back and ends the pool's use; it refuses
    while blocks are lent. Blocks lent to HipBuffers are
    counted (the registry frees each once); blocks lent through the Python ``allocate`` are
    also kept in ``loose`` (pointer -> size), so that ``free`` can refuse a pointer it never
    lent. Cached blocks go back to the device on ``free_all()``, at the limit, and when the
    pool dies (in the process that made it, and not once the interpreter is exiting); the
    device's free waits for work still using them (hipFree/cuMemFree synchronize).

    Like the registry, the pool is made thread-safe by the GIL: each step that reads and
    writes its free lists and counters runs no Python code, so it is atomic. Python code
    (the device allocator's fallback, event calls) runs between steps: a block is reserved
    before it is asked for, un-reserved if that fails; a block is taken across streams only
    in a step that checks, after the events were queried, that it is still there and passed.
    The lanes and their events are changed under ``lock``.
    """
    # (its attributes: _pool_core.pxd)

    def __init__(self, device=None, backend=None, limit=None):
        self.backend = get_backend(backend)
        self.device = self.backend.resolve_device(device)
        if limit is not None:
            limit = checks.integer(limit, "limit")
        if limit is not None and not 0 <= limit < SIZE_MAX:
            raise ValueError(f"a pool limit must be between 0 and {SIZE_MAX - 1} bytes, got "
                             f"{limit}")
        self.limit = limit
        self.cap = SIZE_MAX if limit is None else limit
        self.upstream = self.backend.allocator
        self.default = _Lane(None)
        self.lanes, self.loose, self.loose_lanes = {}, {}, {}
        self.spare_events = []
        self.lock = threading.RLock()
        self.generation = current_generation()

    def serves(self, backend, device):
        """Whether this pool allocates for a request naming ``backend`` and ``device``."""
        named = backend is None or backend is self.backend or backend == self.backend.name
        return named and device in (None, self.device)

    def on(self, stream):
        """The allocator of this pool for ``stream`` (None: the pool itself, the default
        stream): ``HipBuffer(n, pool=pool.on(stream))`` allocates and frees on ``stream``."""
        self.check_open()
        if stream is None:
            return self
        return StreamAllocator(self, self.lane(stream))  # registered by its first allocation

    @property
    def closed(self):
        """Whether ``close()`` ended this pool's use."""
        return self.is_closed

    # --- Python API --------------------------------------------------------------------------
    def allocate(self, nbytes, stream=None):
        """A device pointer to at least ``nbytes`` > 0 bytes for work on ``stream`` (None:
        the default stream), for ``free`` to take back."""
        if type(nbytes) is not int:
            nbytes = checks.integer(nbytes, "nbytes")
        if nbytes <= 0:
            raise ValueError(f"a pool allocation needs nbytes > 0, got {nbytes}")
        if nbytes > 1 << 62:
            raise ValueError(f"a pool allocation needs nbytes <= 2**62, got {nbytes}")
        self.check_open()
        if stream is None:
            ptr = self.take(self.default, nbytes)
        else:
            lane = self.lane(stream)
            ptr = self.take(lane, nbytes)  # the lane is registered only once it succeeded
            self.loose_lanes[ptr] = self.register(lane)
        self.loose[ptr] = nbytes
        return ptr

    def free(self, ptr, device=None, *, stream=...):
        """Return a block from ``allocate`` to the cache, freed in the order of ``stream``:
        by default the stream it was allocated for; None names the default stream.
        ``device``, if given, must be the pool's."""
        if type(ptr) is not int:
            ptr = checks.integer(ptr, "ptr")
        if device is not None and checks.integer(device, "device") != self.device:
            raise ValueError(f"device {device} is not this pool's device {self.device}")
        lane = None if stream is ... else self.lane(stream)  # checked before any change
        nbytes = self.loose.pop(ptr, None)
        if nbytes is None:
            raise ValueError(f"pointer {ptr:#x} was not allocated by this pool's allocate(), "
                             "or was freed already")
        lent_on = self.loose_lanes.pop(ptr, self.default) if self.loose_lanes else self.default
        self.give(self.register(self.current(lent_on) if lane is None else lane), ptr, nbytes)

    def close(self):
        """Give every cached block back to the device and end the pool's use (it refuses
        every later allocation). Idempotent. Raises ``RuntimeError``, changing nothing,
        while blocks are still lent (buffers not closed, ``allocate`` not freed)."""
        with self.lock:
            if self.is_closed:
                return
            if self.lent:
                many = self.lent != 1
                raise RuntimeError(f"MemoryPool.close(): {self.lent} block{'s' if many else ''}"
                                   f" ({self.reserved - self.cached} bytes) "
                                   f"{'are' if many else 'is'} still in use; close their "
                                   "buffers (or free() them) first")
            self.free_all()
            self.is_closed = True

    def free_all(self):
        """Give every cached (not in-use) block back to the device; forget the streams
        whose blocks are all back."""
        self.free_cached()
        self.drop_events()
        with self.lock:
            for stream in [s for s, lane in self.lanes.items() if not (<_Lane>lane).blocks]:
                del self.lanes[stream]

    def stats(self):
        """Bytes reserved from the device, in use, cached; cache hits (``handoffs``: blocks
        that went to another stream than the one that freed them) and misses; the limit."""
        cdef size_t reserved = self.reserved, cached = self.cached, blocks = self.lent
        cdef size_t hits = self.hits, misses = self.misses, handoffs = self.handoffs
        return {"reserved_bytes": reserved, "in_use_bytes": reserved - cached,
                "cached_bytes": cached, "in_use_blocks": blocks, "hits": hits,
                "misses": misses, "handoffs": handoffs, "streams": len(self.lanes),
                "limit": self.limit}

    def lane_states(self):
        """What each lane holds, for inspection: one dict per lane, the default stream's
        (``stream`` None) first, then each stream's: ``cached`` maps a block size to its
        cached pointers, oldest (handed to another stream first) to newest (reused on this
        one first); ``frees`` counts frees so far, ``pending_events`` the fences not yet
        seen passed, and ``passed`` the frees they show the device passed."""
        cdef _Lane lane
        cdef FreeList* blocks
        found = []
        with self.lock:
            for lane in [self.default, *self.lanes.values()]:
                cached = {}
                for index in range(NUM_CLASSES):
                    blocks = &lane.lists[index]
                    if blocks.count:
                        cached[size_of_class(index)] = [
                            blocks.items[(blocks.head + i) & blocks.mask].ptr
                            for i in range(blocks.count)]
                found.append({"stream": lane.stream, "cached": cached, "frees": lane.freed,
                              "pending_events": len(lane.fences), "passed": lane.passed})
        return found

    def lent_blocks(self):
        """The blocks lent through ``allocate`` and not freed yet: pointer -> bytes asked."""
        return dict(self.loose)

    def __reduce__(self):
        raise TypeError("a MemoryPool owns device memory and cannot be copied or pickled")

    def __repr__(self):
        return f"<MemoryPool {self.backend.name}:{self.device} {self.stats()}>"


cdef class StreamAllocator(Allocator):
    """A pool's allocator for one stream (``MemoryPool.on(stream)``): buffers made with it
    get blocks for work on ``stream`` and, when freed, are freed in ``stream``'s order."""
    cdef readonly MemoryPool pool
    cdef _Lane lane

    def __init__(self, MemoryPool pool, _Lane lane):
        self.pool, self.lane = pool, lane
        self.backend, self.device = pool.backend, pool.device

    @property
    def stream(self):
        """The stream this allocator allocates and frees on."""
        return self.lane.stream

    def serves(self, backend, device):
        """Whether the pool allocates for a request naming ``backend`` and ``device``."""
        return self.pool.serves(backend, device)

    cdef uintptr_t alloc_ptr(self, size_t nbytes, int device) except 0:
        cdef _Lane lane = self.pool.current(self.lane)
        if not stream_is_open(lane.stream):
            raise BufferClosedError(f"{lane.stream!r} was closed: its pool allocator cannot "
                                    "allocate")
        cdef uintptr_t ptr = self.pool.take(lane, nbytes)
        self.lane = self.pool.register(lane)
        return ptr

    cdef int free_ptr(self, uintptr_t ptr, size_t nbytes, int device) except -1:
        self.lane = self.pool.register(self.pool.current(self.lane))
        return self.pool.give(self.lane, ptr, nbytes)

    def __reduce__(self):
        raise TypeError("a StreamAllocator belongs to its pool and cannot be copied")

    def __repr__(self):
        return f"<StreamAllocator of {self.pool!r} on {self.lane.stream!r}>"
