"""CPU emulation of the AMD branch of native/compat.h (see README.md)."""
