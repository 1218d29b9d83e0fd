# Size classes and the per-class free list of MemoryPool (pool.pyx): C only, inlined there.
# Sizes are bytes; pointers are uintptr_t device addresses.
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free, malloc


cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil


cdef enum:
    NUM_CLASSES = 1 + 4 * 53  # 512 bytes, then four classes per power of two up to 2**62


cdef struct Cached:
    uintptr_t ptr
    unsigned long long seq  # the freeing lane's count of frees, this one included


cdef struct FreeList:  # a ring of cached blocks, oldest at ``head``; seqs ascend from it
    Cached* items
    size_t head, count, mask  # capacity mask + 1, a power of two (0 items: none yet)


cdef inline uintptr_t pop_newest(FreeList* blocks) noexcept:
    blocks.count -= 1
    return blocks.items[(blocks.head + blocks.count) & blocks.mask].ptr


cdef inline uintptr_t pop_oldest(FreeList* blocks) noexcept:
    cdef uintptr_t ptr = blocks.items[blocks.head].ptr
    blocks.head = (blocks.head + 1) & blocks.mask
    blocks.count -= 1
    return ptr


cdef inline int push(FreeList* blocks, uintptr_t ptr, unsigned long long seq) noexcept:
    """Add a block as the newest: 0, or -1 (nothing changed) when no host memory is left."""
    cdef size_t capacity = 0 if blocks.items == NULL else blocks.mask + 1
    cdef size_t i, wider = 2 * capacity if capacity else 8
    cdef Cached* grown
    if blocks.count == capacity:
        grown = <Cached*>malloc(wider * sizeof(Cached))
        if grown == NULL:
            return -1
        for i in range(blocks.count):
            grown[i] = blocks.items[(blocks.head + i) & blocks.mask]
        free(blocks.items)
        blocks.items, blocks.head, blocks.mask = grown, 0, wider - 1
    blocks.items[(blocks.head + blocks.count) & blocks.mask] = Cached(ptr, seq)
    blocks.count += 1
    return 0


cdef inline int class_of(size_t nbytes, size_t* size) noexcept:
    """The size-class index of ``nbytes`` (> 0) and its block size, or -1 past 2**62."""
    if nbytes <= 512:
        size[0] = 512
        return 0
    if nbytes > (<size_t>1) << 62:
        return -1
    cdef int shift = 64 - __builtin_clzll(nbytes - 1)  # top = 2**shift >= nbytes
    cdef size_t step = (<size_t>1) << (shift - 3)  # quarters of the lower half
    cdef size_t steps = (nbytes + step - 1) // step  # 5..8
    size[0] = steps * step
    return 1 + 4 * (shift - 10) + <int>(steps - 5)


cdef inline size_t size_of_class(int index) noexcept:
    """The block size of size class ``index`` (the inverse of ``class_of``)."""
    if index == 0:
        return 512
    return ((<size_t>1) << (7 + (index - 1) // 4)) * (5 + (index - 1) % 4)
