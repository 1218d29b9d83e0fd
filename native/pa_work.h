// The work split of paged attention (see paged_attention.cu's top comment): units of
// (sequence, group of query heads) laid end to end, each CTA walking its share of them piece
// by piece. Planned on the host by rocmforge_raw.planning.plan_work.
#pragma once
#include "compat.h"

// What the whole launch shares: the layout of its work.
struct rf_pa_work {
  const int* seq_lens;   // [num_seqs] tokens
  const rf_i64* cum16;   // [num_seqs + 1] or null (uniform16 for every sequence)
  int num_seqs, groups, uniform16;
  rf_i64 per_cta, total;  // work tokens per CTA (a multiple of 16) and in all
  int window;             // > 0: a sequence attends to its last `window` tokens only
};

// One CTA's way through its work range: a piece [start, end) of one unit at a time.
// Everything is uniform across the threads that walk it. The next sequence's length and end
// are loaded one sequence ahead, so stepping into it waits for no load.
struct rf_pa_walker {
  int s, x;             // the unit: sequence, group
  int len, len16;       // tokens the unit attends to and work tokens of sequence s
  int lo;               // work position p of the unit is token lo + p (a window's first
                        // token rounded down to 16: tiles start on 16 tokens, their rows
                        // within blocks; else 0), the tokens before are never read
  int first;            // the first token attended: tokens lo .. first - 1 are masked
  rf_i64 unit;          // work position of the unit's token 0
  rf_i64 range_end;     // end of this CTA's work range
  int start, end;       // this piece's tokens of the unit (end <= len)
  int next_len;         // tokens of sequence s + 1 (0 past the last)
  rf_i64 next_end16;    // cum16[s + 2]: where sequence s + 1's units end (cum16 mode)

  RF_DEVICE void fetch_next(const rf_pa_work& w) {
    next_len = s + 1 < w.num_seqs ? w.seq_lens[s + 1] : 0;
    next_end16 = w.cum16 != nullptr && s + 2 <= w.num_seqs ? w.cum16[s + 2] : 0;
  }
  RF_DEVICE void clip(rf_i64 from) {  // the piece: work positions [from, range_end) of unit
    const rf_i64 work_end = range_end - unit < len16 ? range_end - unit : len16;
    end = work_end < len ? (int)work_end : len;
    start = (int)(from - unit) < end ? (int)(from - unit) : end;
    start += lo;  // as tokens
    end += lo;
  }
  RF_DEVICE void attend(int tokens, int window) {  // sequence s has `tokens` tokens
    first = window > 0 && tokens > window ? tokens - window : 0;
    lo = first & ~15;
    len = tokens - lo;
  }
  // Positions the walker at CTA c's first piece.
  RF_DEVICE void begin(const rf_pa_work& w, const int* first_seq, int c) {
    const rf_i64 p0 = (rf_i64)c * w.per_cta;
    range_end = p0 + w.per_cta < w.total ? p0 + w.per_cta : w.total;
    rf_i64 base;
    if (w.cum16 != nullptr) {
      s = first_seq[c];
      base = w.cum16[s] * w.groups;
      len16 = (int)(w.cum16[s + 1] - w.cum16[s]);
    } else {
      len16 = w.uniform16;
      s = (int)(p0 / ((rf_i64)w.groups * len16));
      base = (rf_i64)s * w.groups * len16;
    }
    attend(w.seq_lens[s], w.window);
    x = (int)((p0 - base) / len16);
    unit = base + (rf_i64)x * len16;
    fetch_next(w);
    clip(p0);
  }
  // Moves to the next piece; false (and the walker unchanged) when the range is done.
  RF_DEVICE bool next(const rf_pa_work& w) {
    if (unit + len16 >= range_end) return false;  // this unit reaches the range's end
    unit += len16;
    if (++x == w.groups) {
      x = 0;
      ++s;
      len16 = w.cum16 != nullptr ? (int)(next_end16 - (unit / w.groups)) : w.uniform16;
      attend(next_len, w.window);
      fetch_next(w);
    }
    clip(unit);
    return true;
  }
  // CTAs whose ranges hold part of this unit: [first, last].
  RF_DEVICE rf_i64 first_cta(const rf_pa_work& w) const { return unit / w.per_cta; }
  RF_DEVICE rf_i64 last_cta(const rf_pa_work& w) const { return (unit + len16 - 1) / w.per_cta; }
};
