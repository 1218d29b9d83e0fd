# cython: language_level=3
"""The C callbacks of the DLPack capsules ``dlpack.py`` makes: the managed tensor's deleter
(the consumer is done with it) and the capsule's destructor (nobody consumed it).

Either may run with an exception pending: NumPy calls the deleter while it raises for a tensor
it cannot read, and a capsule may die while an exception propagates. A ctypes callback cannot
run then (its arguments fail to convert), so the export would never end and the buffer never
be freed. These put the pending exception aside, hand the tensor's address to Python
(``set_release``), and put the exception back. The destructor reads the capsule without taking
a reference to it: it is being destroyed.
"""

from cpython.exc cimport PyErr_Fetch, PyErr_Restore
from cpython.ref cimport PyObject

cdef extern from "Python.h":
    int _capsule_is_valid "PyCapsule_IsValid"(PyObject *capsule, const char *name)
    void *_capsule_pointer "PyCapsule_GetPointer"(PyObject *capsule, const char *name)

cdef object _release = None


def set_release(release):
    """Call ``release(address)`` with each managed tensor's address when it is let go."""
    global _release
    _release = release


def deleter_address():
    """The address of ``void deleter(void *managed)`` (both DLManagedTensor kinds)."""
    return <size_t>&_deleter


def destructor_address():
    """The address of the ``PyCapsule_Destructor`` of the capsules."""
    return <size_t>&_destructor


cdef void _hand_back(size_t address) noexcept with gil:
    cdef PyObject *kind
    cdef PyObject *value
    cdef PyObject *trace
    PyErr_Fetch(&kind, &value, &trace)
    try:
        if _release is not None:
            _release(address)
    except BaseException:
        pass  # a release never raises (dlpack._forget); there is no caller to tell
    PyErr_Restore(kind, value, trace)


cdef void _deleter(void *managed) noexcept with gil:
    _hand_back(<size_t>managed)


cdef void _destructor(PyObject *capsule) noexcept with gil:
    for name in (b"dltensor", b"dltensor_versioned"):  # not renamed "used_...": unconsumed
        if _capsule_is_valid(capsule, name):
            _hand_back(<size_t>_capsule_pointer(capsule, name))
            return
