# cython: language_level=3, boundscheck=False, wraparound=False
"""The work split's arrays in C (``planning.plan_work``): a decode step plans one in every
``KvCache.batch``, so these loops run per step; NumPy's per-call overhead was most of it.

Work tokens: a sequence of ``n`` tokens counts ``max(n, 1)`` rounded up to ``granule``.
The loops take C pointers: ``split_into`` writes a step's split straight into the pinned
memory its upload reads (``_pack.pack_step``), the ``def`` functions into NumPy arrays.
"""

import numpy as np


def prefix_sums(const int[::1] lens, long long granule, long long[::1] cum16) -> int:
    """``cum16[i]`` = work tokens of sequences ``[0, i)`` (``cum16`` has ``len(lens) + 1``
    entries); returns the total."""
    if cum16.shape[0] != lens.shape[0] + 1:
        raise ValueError(f"cum16 has {cum16.shape[0]} entries for {lens.shape[0]} lengths")
    return _prefix(_ints(lens), lens.shape[0], granule, &cum16[0])


cdef inline const int* _ints(const int[::1] values) noexcept:
    """The first element's address (NULL for none: no element to index)."""
    return &values[0] if values.shape[0] else NULL


cdef long long _prefix(const int* lens, Py_ssize_t n, long long granule, long long* cum16
                       ) noexcept:
    cdef Py_ssize_t i
    cdef long long total = 0, tokens
    cum16[0] = 0
    for i in range(n):
        tokens = lens[i] if lens[i] > 1 else 1
        total += (tokens + granule - 1) // granule * granule
        cum16[i + 1] = total
    return total


def first_sequences(const long long[::1] cum16, long long groups, long long per_cta,
                    int[::1] first_seq) -> None:
    """``first_seq[c]`` = the sequence whose units hold work token ``c * per_cta`` (sequence
    ``s``'s units span ``[cum16[s] * groups, cum16[s + 1] * groups)``)."""
    if first_seq.shape[0]:
        _first(&cum16[0], cum16.shape[0] - 1, groups, per_cta, &first_seq[0],
               first_seq.shape[0])


cdef void _first(const long long* cum16, Py_ssize_t n, long long groups, long long per_cta,
                 int* first_seq, Py_ssize_t ctas) noexcept:
    cdef Py_ssize_t c, s = 0, last = n - 1
    cdef long long start
    for c in range(ctas):
        start = c * per_cta
        while s < last and cum16[s + 1] * groups <= start:
            s += 1
        first_seq[c] = <int>s


cdef long long _aligned(long long share, long long unit, long long granule, double stretch
                        ) noexcept:
    """The least multiple of ``granule`` from ``share`` to ``stretch * share`` that divides
    ``unit`` or that ``unit`` divides (both multiples of ``granule``); ``share`` when there
    is none."""
    cdef long long whole = unit // granule, granules
    for granules in range(share // granule, <long long>(stretch * share) // granule + 1):
        if granules and (whole % granules == 0 or granules % whole == 0):
            return granules * granule
    return share


cdef long long _share(long long total, long long slots, long long unit, long long granule,
                      long long min_tokens, long long aligned_tokens, double stretch
                      ) noexcept:
    """A CTA's work tokens: the balanced share of ``total`` over ``slots`` (at least
    ``min_tokens``), aligned to the units when it is under ``aligned_tokens`` and they are
    all ``unit`` long (0: of several lengths, or none), rounded up to ``granule``."""
    cdef long long share = (total + slots - 1) // slots if slots > 1 else total
    if share < min_tokens:
        share = min_tokens
    if min_tokens < share < aligned_tokens and unit:
        share = _aligned(max(granule, (share + granule - 1) // granule * granule), unit,
                         granule, stretch)
    return (share + granule - 1) // granule * granule


def split_lengths(const int[::1] lens, long long groups, long long slots,
                  long long granule, long long min_tokens, long long aligned_tokens,
                  double stretch, long long sms=0, long long piece_cost=0,
                  long long quantum=1, double margin=1.0, double whole_waves=0.0,
                  double lone_fill=0.0, long long lean_slots=0, long long lean_tokens=0,
                  bint with_first_seq=True):
    """``planning.plan_work`` over real lengths in one call: (num_ctas, per_cta, total,
    cum16, first_seq) of ``len(lens)`` sequences of ``groups`` units each (see
    ``prefix_sums``, ``first_sequences`` and ``_share``). With ``sms`` (the device's
    multiprocessors; 0: unknown) a launch of at most ``slots`` units is padded to piece
    boundaries instead where ``padded_share`` finds a share (``lone_fill``: see there), and
    a launch of ``whole_waves`` waves of units or more (``_whole``; 0: never), or one that
    ``_lean`` takes at ``lean_slots`` (0: none), to one unit a CTA: ``cum16`` then
    counts each sequence's work tokens rounded up to a multiple of ``per_cta``, the padding
    past its length skipped by the kernel. Returns (num_ctas, per_cta, total, cum16,
    first_seq, whole, lean): ``whole`` when no unit is cut (every unit one CTA's, so no
    partial records), ``lean`` for the lean occupancy; ``first_seq`` None unless
    ``with_first_seq`` (the kernel's uniform mode finds its units without it)."""
    cdef SplitRule rule = SplitRule(granule, min_tokens, aligned_tokens, stretch, sms,
                                    piece_cost, quantum, margin, whole_waves, lone_fill,
                                    lean_slots, lean_tokens)
    cdef Py_ssize_t n = lens.shape[0]
    cum16 = np.empty(n + 1, np.int64)
    cdef long long[::1] c = cum16
    cdef long long per_cta, total
    cdef bint whole = False, lean = False
    _split_share(_ints(lens), n, groups, slots, &rule, &c[0], &per_cta, &total, &whole, &lean)
    cdef Py_ssize_t ctas = (total + per_cta - 1) // per_cta
    first_seq = None
    if with_first_seq:
        first_seq = np.empty(ctas, np.int32)
        first_sequences(cum16, groups, per_cta, first_seq)
    return ctas, per_cta, total, cum16, first_seq, bool(whole), bool(lean)


cdef Py_ssize_t split_into(const int* lens, Py_ssize_t n, long long groups, long long slots,
                           const SplitRule* rule, long long* cum16, int* first_seq,
                           Py_ssize_t capacity, long long* per_cta, long long* total,
                           bint* whole, bint* lean) noexcept:
    """``split_lengths`` of ``n`` lengths (n >= 1) into memory the caller owns: ``cum16``
    (``n + 1`` entries) and ``first_seq`` (room for ``capacity``), ``per_cta`` and
    ``total``. Returns the CTAs, or -1 with ``first_seq`` untouched when they are more
    than ``capacity`` (a split never has more than ``max(slots, n * groups, 1)``)."""
    _split_share(lens, n, groups, slots, rule, cum16, per_cta, total, whole, lean)
    cdef Py_ssize_t ctas = (total[0] + per_cta[0] - 1) // per_cta[0]
    if ctas > capacity:
        return -1
    _first(cum16, n, groups, per_cta[0], first_seq, ctas)
    return ctas


cdef void _split_share(const int* lens, Py_ssize_t n, long long groups, long long slots,
                       const SplitRule* rule, long long* c, long long* per_cta,
                       long long* total, bint* whole, bint* lean) noexcept:
    """``split_lengths``' share: ``c`` (cum16, ``n + 1`` entries), ``per_cta``, ``total``,
    ``whole`` (no unit cut: each sequence padded to the share, which holds the longest) and
    ``lean`` (the launch runs at ``rule.lean_slots``' occupancy)."""
    cdef Py_ssize_t i
    cdef long long unit = 0, padded = 0, longest = 0
    total[0] = _prefix(lens, n, rule.granule, c) * groups
    if n:
        unit = c[1]
        for i in range(n):
            if c[i + 1] - c[i] != unit:
                unit = 0
            if c[i + 1] - c[i] > longest:
                longest = c[i + 1] - c[i]
    lean[0] = rule.sms > 0 and n > 0 and _lean(n * groups, longest, total[0], slots,
                                               rule.lean_slots, rule.lean_tokens)
    if lean[0] or (rule.sms > 0 and slots > 0 and n and _whole(n * groups, longest, total[0],
                                                               slots, rule.whole_waves)):
        padded = longest  # one CTA a unit: the hardware's scheduler balances the waves
    elif rule.sms > 0 and n * groups <= slots:
        padded = _padded(c, n, groups, slots, rule.sms, rule.granule, rule.min_tokens,
                         rule.piece_cost, rule.quantum, rule.margin, rule.lone_fill)
    per_cta[0] = padded or _share(total[0], slots, unit, rule.granule, rule.min_tokens,
                                  rule.aligned_tokens, rule.stretch)
    whole[0] = padded > 0 and padded >= longest
    if padded:
        for i in range(n):  # each sequence's work up to a multiple of per_cta, from the end
            c[n - i] = (c[n - i] - c[n - i - 1] + padded - 1) // padded * padded
        c[0] = 0
        for i in range(n):
            c[i + 1] += c[i]
        total[0] = c[n] * groups


def padded_share(const long long[::1] cum16, long long groups, long long slots,
                 long long sms, long long granule, long long min_tokens,
                 long long piece_cost, long long quantum=1, double margin=1.0,
                 double lone_fill=0.0) -> int:
    """The share per CTA (work tokens, a multiple of ``granule``, at least ``min_tokens``)
    of sequences whose work ``cum16`` sums (``prefix_sums``), each sequence's work padded up
    to a multiple of it so that every CTA holds one piece of one unit; 0 for none.

    A CTA's cost is its share rounded up to ``quantum`` (the kernel's tile: a piece costs
    whole tiles) plus ``piece_cost`` (a piece's fixed work, tokens); a multiprocessor's load
    is its CTAs' cost, the busiest one's ``ceil(ctas / sms)`` of them. The candidates cut
    the longest sequence's work into k pieces for each k (each the least share for its k),
    within one wave of at most ``slots`` CTAs and, but for the first, with two CTAs on some
    multiprocessor, or one CTA on at least ``lone_fill`` of them (0: never; for instances
    whose one CTA streams at the copy's rate alone); the least load wins, then the fewer
    pieces. It is taken only if its load is at most ``margin`` times the balanced split's
    (``_share`` of the unpadded work, which cuts units anywhere), else 0: with
    lengths far apart, whole pieces would leave a long sequence to one CTA."""
    if cum16.shape[0] < 2:
        return 0
    return _padded(&cum16[0], cum16.shape[0] - 1, groups, slots, sms, granule, min_tokens,
                   piece_cost, quantum, margin, lone_fill)


cdef inline bint _whole(long long units, long long longest, long long total, long long slots,
                        double waves) noexcept:
    """Whether one CTA a unit (each ``longest`` work tokens at most, ``total`` in all) is the
    split: at least ``waves`` waves of them over ``slots`` (0: never), and the longest unit
    at most a ``waves``-th of a slot's work, so the hardware's scheduler, which starts a CTA
    wherever one ends, evens the multiprocessors' loads out (native/NOTES.md v30)."""
    return waves > 0 and units >= waves * slots and longest * slots * waves <= total


# A lean launch's least wave efficiency (units over its slots, over the waves rounded up).
cdef double LEAN_EFFICIENCY = 0.9


cdef inline double _efficiency(long long units, long long slots) noexcept:
    cdef long long waves = (units + slots - 1) // slots
    return <double>units / (<double>slots * waves)


cdef inline bint _lean(long long units, long long longest, long long total, long long slots,
                       long long lean_slots, long long tokens) noexcept:
    """Whether one CTA a unit at ``lean_slots`` CTAs at once (one fewer a multiprocessor
    than ``slots``) is the split: units of at least ``tokens`` work tokens, their mean
    within a tenth of the longest, more than a wave at ``slots``, whose waves at
    ``lean_slots`` are at least LEAN_EFFICIENCY full and fuller than at ``slots`` (NOTES.md
    v30: 64 x 4096, 1.29 waves at three CTAs a SM, 1.94 at two, 3 % faster than one wave of
    shares)."""
    if lean_slots <= 0 or lean_slots >= slots or longest < tokens or units <= slots:
        return False
    if 10 * total < 9 * longest * units:
        return False
    cdef double full = _efficiency(units, lean_slots)
    return full >= LEAN_EFFICIENCY and full > _efficiency(units, slots)


cdef inline long long _cost(long long share, long long quantum, long long piece_cost
                            ) noexcept:
    return (share + quantum - 1) // quantum * quantum + piece_cost


cdef long long _padded(const long long* cum16, Py_ssize_t n, long long groups,
                       long long slots, long long sms, long long granule,
                       long long min_tokens, long long piece_cost, long long quantum,
                       double margin, double lone_fill) noexcept:
    cdef Py_ssize_t i
    cdef long long k, share, last = 0, pieces, load, longest = 0, total, balanced
    cdef long long best = 0, best_load = 0, best_pieces = 0
    if n <= 0 or sms <= 0 or slots <= 0 or quantum <= 0:
        return 0
    for i in range(n):
        if cum16[i + 1] - cum16[i] > longest:
            longest = cum16[i + 1] - cum16[i]
    total = cum16[n] * groups
    balanced = _share(total, slots, 0, granule, min_tokens, 0, 1.0)
    k = (longest + balanced - 1) // balanced  # fewer pieces: a larger share than balanced
    while k >= 1:
        share = max((longest + k - 1) // k, min_tokens)
        share = (share + granule - 1) // granule * granule
        k -= 1
        if share == last:
            continue
        last = share
        if best and _cost(share, quantum, piece_cost) > best_load:
            break  # every later share loads its multiprocessors more
        if groups * (n - 1 + (longest + share - 1) // share) > slots:
            continue  # with a piece at least for every other sequence: more than a wave
        pieces = 0
        for i in range(n):
            pieces += (cum16[i + 1] - cum16[i] + share - 1) // share
        pieces *= groups
        if pieces > slots:
            continue
        if best and pieces <= sms and not (lone_fill > 0 and pieces >= lone_fill * sms):
            break  # one CTA a multiprocessor: too few loads in flight to stream
        load = (pieces + sms - 1) // sms * _cost(share, quantum, piece_cost)
        if not best or load < best_load or (load == best_load and pieces < best_pieces):
            best, best_load, best_pieces = share, load, pieces
    if best and best_load <= margin * (
            ((total + balanced - 1) // balanced + sms - 1) // sms
            * _cost(balanced, quantum, piece_cost)):
        return best
    return 0
