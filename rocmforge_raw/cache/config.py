"""CacheConfig: the shape of a paged KV cache, validated, with every size computed checked.

The slab is ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` of ``dtype``
(DESIGN.md). Block 0 is the reserved null block, so ``num_blocks >= 2``. Sizes are bytes.

An fp8 cache (``float8_e4m3fn``, or ``float8_e4m3fnuz``, the format of gfx942) stores codes:
layer ``l``'s K is ``code * k_scale`` and its V ``code * v_scale`` (``kv_scales[l]``, 1.0 by
default); its queries, outputs and the K/V written into it are ``activation_dtype``
(float16 or bfloat16; float16 by default). Other caches hold ``activation_dtype`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..common import checks
from ..kernels.planning import (
    BLOCK_SIZES,
    FP8_DTYPES,
    HEAD_DIMS,
    check_kv_scales,
    check_softcap,
    check_window,
)
from ..kernels.planning import DTYPES as KERNEL_DTYPES

#: What the kernels support, by name: float16, bfloat16, float32, float8_e4m3fn(uz).
DTYPES = {dtype.name: dtype for dtype in (*KERNEL_DTYPES, *FP8_DTYPES)}
#: Element indices in the kernels are signed 64-bit; block ids are int32, and so are the
#: rows of one layer's K (or V) plane, [num_blocks * num_kv_heads * block_size, head_dim].
MAX_SLAB_ELEMENTS = (1 << 63) - 1
MAX_BLOCKS = (1 << 31) - 1
MAX_ROWS = (1 << 31) - 1


def _positive(name: str, value: Any) -> int:
    """A count the kernels take as int32: in [1, 2**31 - 1]."""
    return checks.integer(value, name, 1, MAX_BLOCKS)


def _dtype(value: Any) -> np.dtype | None:
    """The dtype ``value`` names (a name of ``DTYPES`` or anything ``np.dtype`` takes)."""
    if isinstance(value, str):
        return DTYPES.get(value)
    try:
        found: np.dtype[Any] = np.dtype(value)
    except TypeError:
        return None
    return found


@dataclass(frozen=True)
class CacheConfig:
    """A validated cache shape. ``dtype`` is float16, bfloat16, float32, float8_e4m3fn or
    float8_e4m3fnuz. ``num_q_heads`` (optional, a multiple of ``num_kv_heads``) lets
    ``KvCache.batch`` plan attention with the rest of the step; without it the first
    ``attention`` call of a step plans it. ``activation_dtype`` and ``kv_scales`` (one
    ``(k_scale, v_scale)`` pair of positive finite floats per layer) are for fp8 caches (see
    the module docstring); ``kv_scales`` becomes a tuple of float pairs. ``host_blocks``
    (0: none) reserves that many blocks of pinned host memory below the slab: preempted
    sequences are swapped out there and freed prefix blocks demoted there (``KvCache``).

    Attention variants, applied by ``KvCache.attention`` to every step: ``windows`` (None:
    every layer attends to all tokens; an int: every layer's sliding window; or one entry a
    layer, an int or None, as Gemma alternates) becomes a tuple of ``num_layers`` entries; a
    window of W tokens lets the query at position p see positions p - W + 1 .. p (Mistral).
    Where every layer has one, a sequence's blocks wholly before its widest window are
    freed as it grows (``widest_window``). ``logit_softcap`` (None, or a positive float)
    makes each score ``cap * tanh(score / cap)`` in every layer (Gemma 2)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: Any = "float16"
    num_q_heads: int | None = None
    activation_dtype: Any = None
    kv_scales: Any = None
    host_blocks: int = 0
    windows: Any = None
    logit_softcap: Any = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        object.__setattr__(self, "host_blocks",
                           checks.integer(self.host_blocks, "host_blocks", 0, MAX_BLOCKS))
        dtype = _dtype(self.dtype)
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {self.dtype} is not supported: use one of "
                             f"{', '.join(DTYPES)}")
        object.__setattr__(self, "dtype", dtype)
        self._fp8_fields()
        if self.num_q_heads is not None:
            object.__setattr__(self, "num_q_heads", _positive("num_q_heads", self.num_q_heads))
            if self.num_q_heads % self.num_kv_heads:
                raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of "
                                 f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} is not supported: use one of {HEAD_DIMS}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size {self.block_size} is not supported: use one of "
                             f"{BLOCK_SIZES}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be in [2, {MAX_BLOCKS}] (block 0 is the null "
                             f"block), got {self.num_blocks}")
        rows = self.num_blocks * self.num_kv_heads * self.block_size
        if rows > MAX_ROWS:
            raise ValueError(f"{self.num_blocks} blocks x {self.num_kv_heads} kv heads x "
                             f"{self.block_size} tokens = {rows} rows per K/V plane exceed "
                             f"{MAX_ROWS}, the most the kernels index")
        elements = self.total_bytes // self.dtype.itemsize
        if elements > MAX_SLAB_ELEMENTS:
            raise OverflowError(f"a slab of {elements} elements overflows 64-bit indexing")
        object.__setattr__(self, "windows", self._windows())
        if self.logit_softcap is not None:
            object.__setattr__(self, "logit_softcap",
                               check_softcap(self.logit_softcap, "logit_softcap"))

    def _windows(self) -> tuple[int | None, ...]:
        """``windows`` checked, one entry a layer (None: the layer sees every token)."""
        given = self.windows
        if isinstance(given, np.ndarray) and given.ndim == 0:
            given = given.item()  # (one window, as a NumPy scalar holds it)
        if given is None or isinstance(given, (int, np.integer)):
            window = None if given is None else check_window(given, "windows")
            return (window,) * self.num_layers
        entries = checks.ordered(given, "windows", "a window a layer (an int or None)")
        if len(entries) != self.num_layers:
            raise ValueError(f"windows must have {self.num_layers} entries (one a layer), got "
                             f"{checks.show(given)}")
        return tuple(None if w is None else check_window(w, f"windows[{layer}]")
                     for layer, w in enumerate(entries))

    def _fp8_fields(self) -> None:
        """``activation_dtype`` and ``kv_scales`` checked and normalised."""
        if self.activation_dtype is None:
            act = np.dtype(np.float16) if self.is_fp8 else self.dtype
        else:
            act = _dtype(self.activation_dtype)
        if self.is_fp8 and act not in FP8_DTYPES[self.dtype]:
            raise ValueError(f"activation_dtype {self.activation_dtype} of a {self.dtype.name} "
                             "cache must be float16 or bfloat16")
        if not self.is_fp8 and act != self.dtype:
            raise ValueError(f"activation_dtype {self.activation_dtype} differs from dtype "
                             f"{self.dtype.name}: only an fp8 cache holds another type")
        object.__setattr__(self, "activation_dtype", act)
        scales = self.kv_scales
        if scales is None:
            object.__setattr__(self, "kv_scales", ((1.0, 1.0),) * self.num_layers)
            return
        if not self.is_fp8:
            raise ValueError(f"kv_scales apply to fp8 caches only, not {self.dtype.name}")
        what = "one (k_scale, v_scale) pair per layer"
        pairs = [checks.ordered(pair, f"kv_scales[{layer}]", "a (k_scale, v_scale) pair")
                 for layer, pair in enumerate(checks.ordered(scales, "kv_scales", what))]
        if len(pairs) != self.num_layers or any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"kv_scales must be {self.num_layers} (k_scale, v_scale) pairs, "
                             f"got {checks.show(scales)}")
        object.__setattr__(self, "kv_scales", tuple(
            check_kv_scales(self.dtype, k, v, f"kv_scales[{layer}] ")
            for layer, (k, v) in enumerate(pairs)))

    @property
    def is_fp8(self) -> bool:
        """Whether the cache stores fp8 codes (with ``kv_scales``)."""
        return self.dtype in FP8_DTYPES

    @property
    def widest_window(self) -> int | None:
        """The largest window where every layer has one, else None: the tokens a sequence
        keeps of its past (blocks wholly before them leave every layer's window)."""
        if None in self.windows:
            return None
        return int(max(w for w in self.windows if w is not None))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        itemsize: int = self.dtype.itemsize
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes one block id stands for (every layer, K and V)."""
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole slab, the null block included."""
        return self.block_bytes * self.num_blocks

    @property
    def host_bytes(self) -> int:
        """Bytes of pinned host memory the host tier takes (0 without one)."""
        return self.block_bytes * self.host_blocks

    @property
    def slab_shape(self) -> tuple[int, ...]:
        """``(num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)``."""
        return (self.num_layers, 2, self.num_blocks, self.num_kv_heads, self.block_size,
                self.head_dim)

    @property
    def num_slots(self) -> int:
        """Token slots that can be handed out (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @classmethod
    def for_memory(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: Any = "float16", *, num_q_heads: int | None = None,
                   budget_bytes: int | None = None,
                   fraction: float | None = None, device: int | None = None,
                   backend: Any = None, activation_dtype: Any = None,
                   kv_scales: Any = None, host_blocks: int = 0, windows: Any = None,
                   logit_softcap: Any = None) -> CacheConfig:
        """The largest cache within ``budget_bytes``, or within ``fraction`` of the device's
        free memory now (exactly one of the two)."""
        if (budget_bytes is None) == (fraction is None):
            raise ValueError("give exactly one of budget_bytes and fraction")
        if fraction is not None:
            if not 0.0 < checks.real(fraction, "fraction") <= 1.0:
                raise ValueError(f"fraction must be in (0, 1], got {fraction}")
            from ..runtime import get_backend

            dev = get_backend(backend)
            free, _ = dev.mem_info(dev.get_device() if device is None else device)
            budget_bytes = int(free * fraction)
        probe = cls(num_layers, num_kv_heads, head_dim, block_size, 2, dtype)
        num_blocks = min(checks.integer(budget_bytes, "budget_bytes", 1) // probe.block_bytes,
                         MAX_BLOCKS, MAX_ROWS // (probe.num_kv_heads * probe.block_size))
        if num_blocks < 2:
            raise ValueError(f"a budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                             f"{probe.block_bytes} bytes; at least 2 are needed")
        return cls(num_layers, num_kv_heads, head_dim, block_size, num_blocks, dtype,
                   num_q_heads, activation_dtype, kv_scales, host_blocks, windows,
                   logit_softcap)
