# The work split in C for other compiled modules (``_pack.pack_step``): see _worksplit.pyx.

cdef struct SplitRule:  # planning.plan_work's constants, in split_lengths' order
    long long granule, min_tokens, aligned_tokens
    double stretch
    long long sms, piece_cost, quantum
    double margin, whole_waves, lone_fill
    long long lean_slots, lean_tokens


cdef Py_ssize_t split_into(const int* lens, Py_ssize_t n, long long groups, long long slots,
                           const SplitRule* rule, long long* cum16, int* first_seq,
                           Py_ssize_t capacity, long long* per_cta, long long* total,
                           bint* whole, bint* lean) noexcept
