"""The shared fixtures behave as the suite relies on."""

from __future__ import annotations


def test_rng_draws_the_same_numbers_in_every_process(rng):
    # seeded from this test's id by CRC-32: a per-process salted hash() would fail this
    assert rng.integers(1 << 30, size=3).tolist() == [425627275, 140261013, 960509305]
