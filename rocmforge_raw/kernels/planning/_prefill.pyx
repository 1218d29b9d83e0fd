# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True
"""A multi-token launch's work items in C (``prefill.plan_prefill``): a mixed step plans
them in every ``KvCache.batch(query_lens=)``, and NumPy's per-call overhead over a few
hundred items was most of its host time (P5, 512 items: 85 -> 9 us on a 2-core test host).

A *row tile* ``(s, t)`` is packed rows ``[t * bm, min((t + 1) * bm, q_len * ratio))`` of
sequence ``s``; it reads KV positions ``[0, hi)``, ``hi = kv_len - q_len + last_row //
ratio + 1``: ``ceil(hi / bn)`` tiles, cut into ``pieces`` of ``per`` tiles. Its items, one a
kv head ``x``, share all of that, so the arithmetic (64-bit divisions, tens of cycles each)
runs once a row tile, not once an item. Item ``i`` enumerates (s, x, t) in that nesting;
the launch lists split items first, each group by descending cost, ties in item order.
"""

import numpy as np

#: Sort keys: split row tiles first (key ``-cost``), then whole ones (``_WHOLE - cost``).
DEF _WHOLE = 1 << 56


def prefill_items(const long long[::1] q_lens, const long long[::1] kv_lens,
                  long long num_kv_heads, long long ratio, long long bm, long long bn,
                  long long slots, long long max_pieces, long long piece_waves,
                  long long min_piece_tiles, long long item_cost):
    """(items int32 ``[n, 4]``, combines int32 ``[m, 2]``, q_starts int32 ``[s + 1]``,
    num_pieces) of ``plan_prefill`` (``max_pieces`` < 0: no cap). Raises ValueError for a
    sequence whose rows would read no position (``kv_len < q_len``)."""
    cdef Py_ssize_t s, i, j, r, g, end, x, k, n = 0, num_seqs = q_lens.shape[0]
    cdef long long rows, row0, last, total = 0, target, cut = 0, launched = 0, split = 0
    cdef long long p, per, piece, hi, tiles, cost, first = 0
    if kv_lens.shape[0] != num_seqs:
        raise ValueError(f"{kv_lens.shape[0]} seq_lens for {num_seqs} query_lens")
    for name, value, most in (("num_kv_heads", num_kv_heads, 0xFFFF), ("ratio", ratio, 0),
                              ("bm", bm, 0), ("bn", bn, 0)):
        # (C below divides by them and steps by bm; the kernel reads x in 16 bits)
        if value < 1 or (most and value > most):
            raise ValueError(f"{name} must be 1..{most or 'any'}, got {value}")
    starts = np.empty(num_seqs + 1, np.int32)
    cdef int[::1] q_starts = starts
    q_starts[0] = 0
    for s in range(num_seqs):
        if kv_lens[s] < q_lens[s]:
            raise ValueError(f"seq_lens[{s}] = {kv_lens[s]} is less than query_lens[{s}] = "
                             f"{q_lens[s]}")
        first += q_lens[s]
        q_starts[s + 1] = <int>first
        if q_lens[s] > 0:
            n += (q_lens[s] * ratio + bm - 1) // bm
    fields = np.empty((6, n), np.int64)  # a row tile's seq, row0, tiles, pieces, per, hi
    cdef long long[:, ::1] f = fields
    r = 0
    for s in range(num_seqs):
        rows = q_lens[s] * ratio
        row0 = 0
        while row0 < rows:
            last = (row0 + bm if row0 + bm < rows else rows) - 1
            hi = kv_lens[s] - q_lens[s] + last // ratio + 1
            tiles = (hi + bn - 1) // bn
            f[0, r], f[1, r], f[2, r], f[3, r], f[5, r] = s, row0, tiles, 1, hi
            total += tiles
            row0 += bm
            r += 1
    if 0 < n * num_kv_heads < piece_waves * slots:
        target = (total * num_kv_heads + piece_waves * slots - 1) // (piece_waves * slots)
        target = target if target > min_piece_tiles else min_piece_tiles
        for r in range(n):
            p = f[2, r] // target  # at most the tiles: target >= 1
            f[3, r] = p if p > 1 else 1
    for r in range(n):
        tiles = f[2, r]
        per = (tiles + f[3, r] - 1) // f[3, r]
        f[3, r] = (tiles + per - 1) // per  # no empty piece
        f[4, r] = per
        if f[3, r] > 1:
            cut += f[3, r] * num_kv_heads
    if 0 <= max_pieces < cut:
        for r in range(n):
            f[3, r], f[4, r] = 1, f[2, r]
        cut = 0
    for r in range(n):  # the longest piece's positions; hi becomes the sort key
        cost = f[4, r] * bn
        cost = (cost if cost < f[5, r] else f[5, r]) + item_cost
        f[5, r] = -cost if f[3, r] > 1 else _WHOLE - cost
        launched += f[3, r] * num_kv_heads
        split += num_kv_heads if f[3, r] > 1 else 0
    cdef const long long[::1] order = np.argsort(fields[5], kind="stable")
    out = np.empty((launched, 4), np.int32)
    cdef int[:, ::1] items = out
    combined = np.empty((split, 2), np.int32)
    cdef int[:, ::1] combines = combined
    j = k = g = 0
    while g < n:  # a run of row tiles of one sequence and key: kv head by kv head
        end = g + 1
        while end < n and f[0, order[end]] == f[0, order[g]] and (
                f[5, order[end]] == f[5, order[g]]):
            end += 1
        for x in range(num_kv_heads):
            for i in range(g, end):
                r = order[i]
                p = f[3, r]
                if p > 1:
                    combines[j, 0], combines[j, 1] = <int>k, <int>p
                    j += 1
                for piece in range(p):
                    items[k, 0], items[k, 1] = <int>f[0, r], <int>f[1, r]
                    items[k, 2], items[k, 3] = <int>(x | (piece << 16)), <int>p
                    k += 1
        g = end
    return out, combined, starts, int(cut)

