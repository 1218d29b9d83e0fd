"""Argument checks shared by the public entry points, written once.

Each check returns the value in the one form the code below it trusts (a plain ``int``, a
``float``, a ``np.dtype``, a tuple of dimensions) or raises ``TypeError`` (wrong kind of
value) or ``ValueError`` (right kind, out of range) with a message that names the argument
and shows its bad value. NumPy integers pass wherever ints do; bools are not numbers here.
Nothing here touches a device: it is the layer below the runtime and the compiled core.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, TypeVar

import numpy as np

#: Largest byte count or dimension the package accepts: a signed 64-bit size (DLPack's and
#: the kernels' index type).
MAX_SIZE = (1 << 63) - 1
#: The float32 range: kernels take their scales as float32, and a value outside this range
#: becomes 0 or infinity there (every result NaN or 0).
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened to ``limit`` characters for a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_N = TypeVar("_N", int, float)


def _kind(value: Any) -> str:
    return f"{show(value)} ({type(value).__name__})"


def integer(value: Any, name: str, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """``value`` as a plain ``int`` in [``minimum``, ``maximum``] (bounds optional)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {_kind(value)}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {_kind(value)}") from None
    return _within(number, name, minimum, maximum, str(number))


def size(value: Any, name: str) -> int:
    """A count or offset of bytes or elements: an integer >= 0 (what it must fit in is
    checked where it is used, with the numbers)."""
    return integer(value, name, 0)


def real(value: Any, name: str, minimum: float | None = None,
         maximum: float | None = None) -> float:
    """``value`` as a finite ``float`` in [``minimum``, ``maximum``] (bounds optional)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a number, got {_kind(value)}")
    if isinstance(value, np.complexfloating):
        raise TypeError(f"{name} must be a real number, got {_kind(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        raise ValueError(f"{name} must be a finite number, got {show(value)}, beyond the "
                         "float range") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {show(value)}")
    return _within(number, name, minimum, maximum, show(value))


def float32(value: Any, name: str, minimum: float | None = None,
            maximum: float | None = None) -> float:
    """A ``real`` that a kernel takes as float32: 0, or of a magnitude in [FLOAT32_TINY,
    FLOAT32_MAX], so that it neither overflows to infinity nor flushes to 0 or a
    subnormal there."""
    number = real(value, name, minimum, maximum)
    if number and not FLOAT32_TINY <= abs(number) <= FLOAT32_MAX:
        raise ValueError(f"{name} must fit float32 (0, or a magnitude in [{FLOAT32_TINY:.8g}, "
                         f"{FLOAT32_MAX:.8g}]), got {show(value)}")
    return number


def positive_float32(value: Any, name: str, maximum: float = FLOAT32_MAX) -> float:
    """A ``float32`` in [FLOAT32_TINY, ``maximum``]: a scale whose inverse fits too."""
    number = float32(value, name, maximum=maximum)
    if number <= 0.0:
        raise ValueError(f"{name} must be positive, got {show(value)}")
    return number


def function(value: Any, name: str, what: str) -> Any:
    """``value`` if it can be called (a clock, a callback); ``what`` says what it must be."""
    if not callable(value):
        raise TypeError(f"{name} must be {what}, got {_kind(value)}")
    return value


def _within(number: _N, name: str, minimum: _N | None, maximum: _N | None, shown: str) -> _N:
    """``number`` if it lies in [``minimum``, ``maximum``] (either may be None)."""
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {shown}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {shown}")
    return number


def flag(value: Any, name: str) -> bool:
    """A ``bool`` (NumPy's too); nothing else is taken for true or false."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_kind(value)}")
    return bool(value)


def plain_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """A dtype whose elements are plain numbers in native byte order: bool, integers,
    floats, complex, and ml_dtypes' numbers (bfloat16, float8). Only these cross to the
    device: an object, string, void or structured dtype would copy raw pointers or
    padding into device memory, or read device bytes back as Python objects."""
    try:
        found: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy dtype, got {_kind(dtype)}") from None
    ml = found.kind == "V" and found.type.__module__.split(".")[0] == "ml_dtypes"
    if not (found.kind in _NUMERIC_KINDS or ml) or found.fields or found.subdtype:
        shown = str(dtype) if isinstance(dtype, np.dtype) else show(dtype)
        raise TypeError(f"{name} {shown} is not a plain numeric dtype: use bool, an "
                        "integer, float or complex type, or an ml_dtypes number")
    if found.byteorder not in "=|":
        raise TypeError(f"{name} {found.str} is not in native byte order")
    return found


def dims(shape: Any, name: str = "shape") -> tuple[int, ...]:
    """A shape (an integer or an iterable of them) as a tuple of sizes."""
    if isinstance(shape, (str, bytes)) or not (
            hasattr(shape, "__index__") or hasattr(shape, "__iter__")):
        raise TypeError(f"{name} must be an integer or a tuple of integers, got "
                        f"{_kind(shape)}")
    if hasattr(shape, "__index__") and not (isinstance(shape, np.ndarray) and shape.ndim):
        return (integer(shape, name, 0, MAX_SIZE),)
    return tuple(integer(d, f"{name}[{i}]", 0, MAX_SIZE) for i, d in enumerate(shape))


def nbytes_of(dtype: np.dtype, shape: tuple[int, ...], name: str = "shape") -> int:
    """Bytes of ``shape`` of ``dtype``; ``ValueError`` past a 64-bit size."""
    total = dtype.itemsize * math.prod(shape)
    if total > MAX_SIZE:
        raise ValueError(f"{name} {shape} of {dtype} is {total} bytes, more than a 64-bit "
                         f"size ({MAX_SIZE})")
    return total


def hashable(value: Any, name: str) -> Hashable:
    """``value`` if it can be a dictionary key (a sequence or request id)."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{name} must be hashable, got {_kind(value)}") from None
    key: Hashable = value
    return key


def ordered(values: Any, name: str, what: str) -> list[Any]:
    """An ordered collection (a list, tuple, array, range or iterator) as a list; a set, a
    mapping or a string is refused: a set's order is not the caller's, a mapping and a
    string would be read as their keys and characters."""
    if isinstance(values, (str, bytes, AbstractSet, Mapping)) or not hasattr(
            values, "__iter__"):
        raise TypeError(f"{name} must be {what} (a list, tuple or array, in order), got "
                        f"{_kind(values)}")
    return list(values)


def colocated(name: str, backend: Any, device: int | None, other_name: str,
              other_backend: Any, other_device: int | None) -> None:
    """``ValueError`` unless ``name`` and ``other_name`` live on one backend object and one
    device; the message tells two objects of one backend apart."""
    if backend is other_backend and device == other_device:
        return
    if backend is not other_backend and backend.name == other_backend.name:
        raise ValueError(f"{name} is on another {backend.name} backend object than "
                         f"{other_name} ({id(backend):#x} and {id(other_backend):#x}): use "
                         f"one, as get_backend({backend.name!r}) returns")
    raise ValueError(f"{name} is on {backend.name}:{device}, {other_name} on "
                     f"{other_backend.name}:{other_device}")


def id_list(values: Any, name: str, in_order: bool = True) -> list[Hashable]:
    """An iterable of ids as a list (a ``list`` is taken as is: the caller's hot path); a
    string is refused, not read as its characters, and so are a mapping and, where the
    answer follows the order of the ids (``in_order``), a set."""
    if type(values) is list:
        return values
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__") or (
            in_order and isinstance(values, AbstractSet)):
        raise TypeError(f"{name} must be an iterable of ids{' in order' if in_order else ''}"
                        f" (a list or tuple), got {_kind(values)}")
    return list(values)


def host_array(value: Any, name: str) -> np.ndarray:
    """``value`` as a C-contiguous NumPy array of a plain numeric dtype (see
    ``plain_dtype``), ready to be copied to a device."""
    try:
        array = np.ascontiguousarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be array-like, got {_kind(value)}: {exc}") from None
    plain_dtype(array.dtype, f"{name} dtype")
    return array


def spans(value: Any, src_nbytes: int, dst_nbytes: int, name: str = "spans") -> np.ndarray:
    """``value`` as int64 ``[n, 3]`` rows (src offset, dst offset, bytes), each inside the
    source's ``src_nbytes`` and the destination's ``dst_nbytes``, no two destinations
    overlapping (each byte lands once, whatever order the copies run in)."""
    array = np.asarray(value)
    if array.size == 0 and array.ndim in (1, 2):  # nothing to copy ([] or [0, 3])
        array = np.zeros((0, 3), np.int64)
    if array.dtype.kind not in "iu" or array.ndim != 2 or array.shape[1] != 3:
        raise ValueError(f"{name} must be integers shaped [n, 3] (src offset, dst offset, "
                         f"bytes), got {array.dtype} {array.shape}")
    if array.dtype == np.uint64 and array.size and array.max() > MAX_SIZE:
        raise ValueError(f"{name} holds {int(array.max())}, past a signed 64-bit size")
    array = array.astype(np.int64, copy=False)
    sizes = array[:, 2]  # compared as limit - offset: an offset + size could wrap past 2**63
    if array.size and (array.min() < 0 or (sizes > src_nbytes - array[:, 0]).any()
                       or (sizes > dst_nbytes - array[:, 1]).any()):
        raise ValueError(f"{name} has a span outside the {src_nbytes}-byte source or the "
                         f"{dst_nbytes}-byte destination")
    landing = array[:, 1:] if array[:, 2].all() else array[array[:, 2] > 0][:, 1:]
    if len(landing) > 1 and (landing[1:, 0] < landing[:-1, 0]).any():  # else sorted already
        landing = landing[np.argsort(landing[:, 0], kind="stable")]
    early = landing[1:, 0] < landing[:-1, 0] + landing[:-1, 1]  # starts before the last ends
    if early.any():
        first = int(np.flatnonzero(early)[0])
        raise ValueError(f"{name} overlap in the destination: bytes {landing[first, 0]}.."
                         f"{landing[first].sum()} and {landing[first + 1, 0]}..")
    checked: np.ndarray = array
    return checked
