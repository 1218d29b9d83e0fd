"""A hostile user's probes over every public module and the CLI, each crash-isolated.

Each probe is one bad call (or one bad command line) with the exception type it must raise
and the words its message must contain: the bad value itself, so that the user sees what
was wrong. All probes run in one child interpreter, each in its own fork of it, so a probe
that would segfault fails its own test instead of the suite, and no probe sees what another
did. CLI probes call
``cli.main`` in the child and must end with exit status 2 and one line on stderr.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

import rocmforge_raw as rf
from rocmforge_raw.cache import BlockPool, CacheConfig, KvCache


@dataclass(frozen=True)
class Probe:
    id: str
    kind: str  # "call": Python statements; "cli": an argv for cli.main
    payload: str | list[str]
    error: str  # exception class (or a base of it) the call must raise; "" for cli
    words: tuple[str, ...]


def P(id: str, code: str, error: str, *words: str) -> Probe:
    return Probe(id, "call", code, error, words)


def C(id: str, argv: str, *words: str) -> Probe:
    return Probe(id, "cli", argv.split(), "", words)


# Helpers every probe can use (run once in each child interpreter).
SETUP = """
import copy, math, pickle
import numpy as np
import rocmforge_raw as rf
from rocmforge_raw import (DeviceArray, Event, HipBuffer, LaunchConfig, MemoryPool, Module,
                           Stream, load_kernels, ops)
from rocmforge_raw.cache import BlockPool, CacheConfig, KvCache
from rocmforge_raw.common import procs
from rocmforge_raw.kernels.module import pack_args
from rocmforge_raw.memory import dlpack
from rocmforge_raw.memory.ipc import IpcHandle
from rocmforge_raw.runtime import get_backend
from rocmforge_raw.soak import SoakConfig
from rocmforge_raw.transport import MooncakeTransport, PeerTransport

HOST = get_backend("host")
CFG = CacheConfig(2, 1, 64, 8, 16, "float32", num_q_heads=2)

def buf(n=64):
    return HipBuffer(n, backend="host")

def arr(shape, dtype=np.float32):
    return DeviceArray.empty(shape, dtype, backend="host")

def closed(obj):
    obj.close()
    return obj

def cache(**kwargs):
    c = KvCache(CFG, backend="host", **kwargs)
    c.add_sequence("a", 5)
    c.add_sequence("b", 9)
    return c

def attn(q_shape=(1, 2, 64), cache_shape=(4, 1, 8, 64), dtype=np.float32):
    q, kc = arr(q_shape, dtype), arr(cache_shape, dtype)
    return q, q, kc, kc, np.ones((q_shape[0], 1), np.int32), np.ones(q_shape[0], np.int32)

def kv(n=1):
    return arr((n, 1, 64))

def slab():
    return arr((1, 2, 4, 1, 8, 64))

from rocmforge_raw.cache import Request, Scheduler
from rocmforge_raw.runtime.host import HostBackend

def unchanged(call, *state):
    # run the bad call and re-raise its error once each of state (callables) reads as
    # before it: a call that changed any raises AssertionError instead (half done)
    before = [s() for s in state]
    try:
        call()
    except Exception:
        after = [s() for s in state]
        if after != before:
            raise AssertionError(f"half done: {before} -> {after}") from None
        raise

def fp8(scales=((0.5, 2.0),), **kwargs):
    c = KvCache(CacheConfig(len(scales), 2, 64, 16, 9, "float8_e4m3fn", kv_scales=scales,
                            **kwargs), backend="host")
    c.add_sequence("a", 5)
    return c

def sched(**kwargs):
    c = KvCache(CacheConfig(1, 1, 64, 8, 12, "float32"), backend="host")
    return Scheduler(c, **kwargs)

def running(new=1, **kwargs):
    s = sched(**kwargs)
    s.submit(Request("r", 3, new))
    return s, s.step()

def pooled(limit=None):
    p = MemoryPool(backend="host", limit=limit)
    p.free(p.allocate(2048))
    return p
"""

# --- the probes, by area ----------------------------------------------------------------------
RUNTIME = [
    P("runtime-get_backend-int", "get_backend(5)", "TypeError", "5"),
    P("runtime-get_backend-unknown", "get_backend('nope')", "BackendUnavailableError",
      "'nope'"),
    P("runtime-set_allocator-int", "rf.set_allocator(5)", "TypeError", "5"),
    P("runtime-set_allocator-backend-allocator", "rf.set_allocator(HOST.allocator)",
      "TypeError", "HostAllocator"),
    P("runtime-set_allocator-str", "rf.set_allocator('pool')", "TypeError", "'pool'"),
    P("runtime-device-99", "HOST.resolve_device(99)", "BackendUnavailableError", "99"),
    P("runtime-device-negative", "HOST.resolve_device(-1)", "ValueError", "-1"),
    P("runtime-device-float", "HOST.resolve_device(1.5)", "TypeError", "1.5"),
    P("runtime-device-bool", "HOST.resolve_device(True)", "TypeError", "True"),
    P("runtime-track_stacks-str", "rf.track_stacks('yes')", "TypeError", "'yes'"),
]

BUFFER = [
    P("buffer-nbytes-bool", "HipBuffer(True, backend='host')", "TypeError", "True"),
    P("buffer-nbytes-false", "HipBuffer(False, backend='host')", "TypeError", "False"),
    P("buffer-nbytes-float", "HipBuffer(1.5, backend='host')", "TypeError", "1.5"),
    P("buffer-nbytes-numpy-float", "HipBuffer(np.float64(8), backend='host')", "TypeError",
      "8.0"),
    P("buffer-nbytes-str", "HipBuffer('8', backend='host')", "TypeError", "'8'"),
    P("buffer-nbytes-none", "HipBuffer(None, backend='host')", "TypeError", "None"),
    P("buffer-nbytes-negative", "HipBuffer(-1, backend='host')", "ValueError", "-1"),
    P("buffer-nbytes-2**70", "HipBuffer(2**70, backend='host')", "OutOfMemoryError",
      str(2**70)),
    P("buffer-device-bool", "HipBuffer(8, device=True, backend='host')", "TypeError", "True"),
    P("buffer-device-negative", "HipBuffer(8, device=-1, backend='host')", "ValueError", "-1"),
    P("buffer-device-float", "HipBuffer(8, device=1.5, backend='host')", "TypeError", "1.5"),
    P("buffer-device-1e9-empty", "HipBuffer(0, device=10**9, backend='host')",
      "BackendUnavailableError", "1000000000"),
    P("buffer-device-absent", "HipBuffer(8, device=64, backend='host')",
      "BackendUnavailableError", "device 64"),
    P("buffer-backend-int", "HipBuffer(8, backend=5)", "TypeError", "5"),
    P("buffer-backend-unknown", "HipBuffer(8, backend='nope')", "BackendUnavailableError",
      "'nope'"),
    P("buffer-pool-int", "HipBuffer(8, pool=5)", "TypeError", "5"),
    P("buffer-pool-allocator", "HipBuffer(8, pool=HOST.allocator)", "TypeError",
      "HostAllocator"),
    P("buffer-pool-other-backend", "HipBuffer(8, backend='nope', pool=MemoryPool(backend="
      "'host'))", "ValueError", "nope"),
    P("buffer-view-float", "buf().view(1.5)", "TypeError", "1.5"),
    P("buffer-view-bool", "buf().view(True)", "TypeError", "True"),
    P("buffer-view-negative", "buf().view(-1)", "ValueError", "-1"),
    P("buffer-view-nbytes-negative", "buf().view(0, -1)", "ValueError", "-1"),
    P("buffer-view-past-end", "buf().view(65)", "ValueError", "65"),
    P("buffer-view-overrun", "buf().view(60, 8)", "ValueError", "8 bytes at offset 60"),
    P("buffer-typed-object", "buf().typed(object)", "TypeError", "object"),
    P("buffer-typed-void0", "buf().typed('V0')", "TypeError", "V0"),
    P("buffer-typed-unicode", "buf().typed('U4')", "TypeError", "U4"),
    P("buffer-typed-structured", "buf().typed([('a', 'i4')])", "TypeError", "'a'"),
    P("buffer-typed-not-a-dtype", "buf().typed('foo')", "TypeError", "'foo'"),
    P("buffer-typed-byte-order", "buf().typed('>f4')", "TypeError", ">f4"),
    P("buffer-typed-misaligned", "buf().typed(np.float32, (4,), 3)", "ValueError",
      "offset 3"),
    P("buffer-typed-overrun", "buf().typed(np.float32, 100)", "ValueError", "(100,)"),
    P("buffer-to_numpy-object", "buf().to_numpy(object)", "TypeError", "object"),
    P("buffer-to_numpy-void0", "buf().to_numpy('V0')", "TypeError", "V0"),
    P("buffer-to_numpy-datetime", "buf().to_numpy('M8[s]')", "TypeError", "M8"),
    P("buffer-to_numpy-shape-float", "buf().to_numpy(np.float32, 2.5)", "TypeError", "2.5"),
    P("buffer-to_numpy-shape-bool", "buf().to_numpy(np.float32, True)", "TypeError", "True"),
    P("buffer-to_numpy-dim-bool", "buf().to_numpy(np.float32, (True,))", "TypeError",
      "True"),
    P("buffer-to_numpy-shape-str", "buf().to_numpy(np.float32, '4')", "TypeError", "'4'"),
    P("buffer-to_numpy-offset-negative", "buf().to_numpy(offset=-1)", "ValueError", "-1"),
    P("buffer-to_numpy-offset-float", "buf().to_numpy(offset=1.5)", "TypeError", "1.5"),
    P("buffer-to_numpy-stream-int", "buf().to_numpy(stream=5)", "TypeError", "5"),
    P("buffer-to_numpy-overrun", "buf().to_numpy(np.float32, (100,))", "ValueError", "(100,)"),
    P("buffer-to_numpy-ragged-bytes", "buf(63).to_numpy(np.float32)", "ValueError", "63"),
    P("buffer-copy_from_host-object", "buf().copy_from_host(np.array([object()] * 8))",
      "TypeError", "object"),
    P("buffer-copy_from_host-str", "buf().copy_from_host('abc')", "TypeError", "U3"),
    P("buffer-copy_from_host-ragged", "buf().copy_from_host([[1], [1, 2]])", "TypeError",
      "[[1], [1, 2]]"),
    P("buffer-copy_from_host-overrun", "buf().copy_from_host(np.zeros(65, np.uint8))",
      "ValueError", "65 bytes"),
    P("buffer-copy_from_host-offset-bool",
      "buf().copy_from_host(np.zeros(4, np.uint8), offset=True)", "TypeError", "True"),
    P("buffer-copy_from_host-stream-str",
      "buf().copy_from_host(np.zeros(4, np.uint8), stream='s')", "TypeError", "'s'"),
    P("buffer-copy_from-int", "buf().copy_from(5)", "TypeError", "5"),
    P("buffer-copy_from-nbytes-float", "buf().copy_from(buf(), nbytes=1.5)", "TypeError",
      "1.5"),
    P("buffer-copy_from-nbytes-negative", "buf().copy_from(buf(), nbytes=-1)", "ValueError",
      "-1"),
    P("buffer-copy_from-src-offset-negative", "buf().copy_from(buf(), src_offset=-1)",
      "ValueError", "-1"),
    P("buffer-copy_from-dst-offset-float", "buf().copy_from(buf(), dst_offset=0.5)",
      "TypeError", "0.5"),
    P("buffer-copy_from-longer-source", "buf().copy_from(buf(128))", "ValueError", "128"),
    P("buffer-fill-256", "buf().fill(256)", "ValueError", "256"),
    P("buffer-fill-negative", "buf().fill(-1)", "ValueError", "-1"),
    P("buffer-fill-float", "buf().fill(1.5)", "TypeError", "1.5"),
    P("buffer-fill-bool", "buf().fill(True)", "TypeError", "True"),
    P("buffer-fill-offset-negative", "buf().fill(0, offset=-1)", "ValueError", "-1"),
    P("buffer-fill-overrun", "buf().fill(0, nbytes=1000)", "ValueError", "1000"),
    P("buffer-fill-stream-int", "buf().fill(0, stream=5)", "TypeError", "5"),
    P("buffer-closed-ptr", "closed(buf()).ptr", "BufferClosedError", "closed"),
    P("buffer-closed-to_numpy", "closed(buf()).to_numpy()", "BufferClosedError", "closed"),
    P("buffer-closed-fill", "closed(buf()).fill(0)", "BufferClosedError", "closed"),
    P("buffer-closed-view", "closed(buf()).view(0)", "BufferClosedError", "closed"),
    P("buffer-closed-view-of-view", "b = buf(); v = b.view(8); b.close(); v.to_numpy()",
      "BufferClosedError", "closed"),
    P("buffer-from_numpy-object", "HipBuffer.from_numpy(np.array([None, 1]), backend='host')",
      "TypeError", "object"),
    P("buffer-from_numpy-str", "HipBuffer.from_numpy('abc', backend='host')", "TypeError",
      "U3"),
    P("buffer-from_numpy-dict", "HipBuffer.from_numpy({'a': 1}, backend='host')", "TypeError",
      "object"),
    P("buffer-pickle", "pickle.dumps(buf())", "TypeError", "HipBuffer"),
]

ARRAY = [
    P("array-buffer-int", "DeviceArray(5, np.float32)", "TypeError", "5"),
    P("array-dtype-object", "DeviceArray(buf(), object)", "TypeError", "object"),
    P("array-misaligned", "DeviceArray(buf(), np.float32, (4,), 3)", "ValueError", "offset 3"),
    P("array-offset-float", "DeviceArray(buf(), np.float32, None, 1.5)", "TypeError", "1.5"),
    P("array-offset-str", "DeviceArray(buf(), np.float32, None, 'a')", "TypeError", "'a'"),
    P("array-offset-past-end", "DeviceArray(buf(), np.float32, None, 100)", "ValueError",
      "100"),
    P("array-shape-str", "DeviceArray(buf(), np.float32, 'ab')", "TypeError", "'ab'"),
    P("array-shape-float-dim", "DeviceArray(buf(), np.float32, (2.5,))", "TypeError", "2.5"),
    P("array-shape-too-big", "DeviceArray(buf(), np.float32, (100,))", "ValueError", "(100,)"),
    P("array-empty-2**63", "arr(2**63)", "ValueError", str(2**63)),
    P("array-empty-product-overflow", "arr((2**40, 2**40))", "ValueError", str(2**40)),
    P("array-empty-negative", "arr(-1)", "ValueError", "-1"),
    P("array-empty-float", "arr(1.5)", "TypeError", "1.5"),
    P("array-empty-bool", "arr(True)", "TypeError", "True"),
    P("array-empty-dim-none", "arr((4, None))", "TypeError", "None"),
    P("array-empty-object", "arr(4, object)", "TypeError", "object"),
    P("array-empty-unicode", "arr(4, 'U4')", "TypeError", "U4"),
    P("array-empty-not-a-dtype", "arr(4, 'foo')", "TypeError", "'foo'"),
    P("array-object-to_numpy", "arr(4, object).to_numpy()", "TypeError", "object"),
    P("array-from_numpy-object", "DeviceArray.from_numpy(np.array([object()]))", "TypeError",
      "object"),
    P("array-from_numpy-ragged", "DeviceArray.from_numpy([[1], [1, 2]])", "TypeError",
      "[[1], [1, 2]]"),
    P("array-set-shape", "a = arr(4); a.shape = (1000,)", "AttributeError", "shape"),
    P("array-set-dtype", "a = arr(4); a.dtype = np.dtype(np.int8)", "AttributeError",
      "dtype"),
    P("array-set-buffer", "a = arr(4); a.buffer = buf()", "AttributeError", "buffer"),
    P("array-del-shape", "a = arr(4); del a.shape", "AttributeError", "shape"),
    P("array-copy_from_host-shape", "arr(16).copy_from_host(np.zeros(2, np.float32))",
      "ValueError", "float32[2]"),
    P("array-copy_from_host-object", "arr(2).copy_from_host(np.array([object()] * 2))",
      "TypeError", "object"),
    P("array-to_numpy-stream-int", "arr(4).to_numpy(stream=5)", "TypeError", "5"),
    P("array-deepcopy", "copy.deepcopy(arr(4))", "TypeError", "DeviceArray"),
]

DLPACK = [
    P("dlpack-max_version-int", "arr(4).__dlpack__(max_version=5)", "TypeError", "5"),
    P("dlpack-max_version-short", "arr(4).__dlpack__(max_version=(1,))", "TypeError", "(1,)"),
    P("dlpack-max_version-str", "arr(4).__dlpack__(max_version=('1', '0'))", "TypeError",
      "'1'"),
    P("dlpack-stream-str", "arr(4).__dlpack__(stream='x')", "TypeError", "'x'"),
    P("dlpack-stream-bool", "arr(4).__dlpack__(stream=True)", "TypeError", "True"),
    P("dlpack-dl_device-int", "arr(4).__dlpack__(dl_device=5)", "TypeError", "5"),
    P("dlpack-dl_device-other", "arr(4).__dlpack__(dl_device=(2, 0))", "BufferError",
      "(2, 0)"),
    P("dlpack-copy-true", "arr(4).__dlpack__(copy=True)", "BufferError", "copy=True"),
    P("dlpack-copy-str", "arr(4).__dlpack__(copy='yes')", "TypeError", "'yes'"),
    P("dlpack-closed", "b = buf(); t = b.typed(np.float32); b.close(); np.from_dlpack(t)",
      "BufferClosedError", "closed"),
    P("dlpack-float4", "import ml_dtypes; np.from_dlpack(arr(4, ml_dtypes.float4_e2m1fn))",
      "BufferError", "float4_e2m1fn"),
]

STREAM = [
    P("stream-device-5", "Stream(device=5, backend='host')", "BackendUnavailableError", "5"),
    P("stream-device-negative", "Stream(device=-1, backend='host')", "ValueError", "-1"),
    P("stream-device-float", "Stream(device=1.5, backend='host')", "TypeError", "1.5"),
    P("stream-device-bool", "Stream(device=True, backend='host')", "TypeError", "True"),
    P("stream-backend-int", "Stream(backend=5)", "TypeError", "5"),
    P("stream-closed-synchronize", "closed(Stream(backend='host')).synchronize()",
      "BufferClosedError", "Stream was closed"),
    P("stream-closed-handle", "closed(Stream(backend='host')).handle", "BufferClosedError",
      "Stream was closed"),
    P("stream-closed-in-copy", "buf().fill(0, stream=closed(Stream(backend='host')))",
      "BufferClosedError", "Stream was closed"),
    P("stream-pickle", "pickle.dumps(Stream(backend='host'))", "TypeError", "Stream"),
    P("event-device-9", "Event(device=9, backend='host')", "BackendUnavailableError", "9"),
    P("event-record-int", "Event(backend='host').record(5)", "TypeError", "5"),
    P("event-record-closed-stream",
      "Event(backend='host').record(closed(Stream(backend='host')))", "BufferClosedError",
      "Stream was closed"),
    P("event-closed-record", "closed(Event(backend='host')).record()", "BufferClosedError",
      "Event was closed"),
    P("event-closed-synchronize", "closed(Event(backend='host')).synchronize()",
      "BufferClosedError", "Event was closed"),
    P("event-elapsed-int", "Event(backend='host').record().elapsed_ms_since(5)", "TypeError",
      "5"),
    P("event-elapsed-start-unrecorded",
      "Event(backend='host').record().elapsed_ms_since(Event(backend='host'))", "ValueError",
      "start event was never recorded"),
    P("event-elapsed-end-unrecorded",
      "Event(backend='host').elapsed_ms_since(Event(backend='host').record())", "ValueError",
      "this event was never recorded"),
    P("event-copy", "copy.copy(Event(backend='host'))", "TypeError", "Event"),
]

POOL = [
    P("pool-limit-float", "MemoryPool(backend='host', limit=1.5)", "TypeError", "1.5"),
    P("pool-limit-bool", "MemoryPool(backend='host', limit=True)", "TypeError", "True"),
    P("pool-limit-str", "MemoryPool(backend='host', limit='a')", "TypeError", "'a'"),
    P("pool-limit-negative", "MemoryPool(backend='host', limit=-1)", "ValueError", "-1"),
    P("pool-device-negative", "MemoryPool(device=-1, backend='host')", "ValueError", "-1"),
    P("pool-device-5", "MemoryPool(device=5, backend='host')", "BackendUnavailableError", "5"),
    P("pool-device-float", "MemoryPool(device=1.5, backend='host')", "TypeError", "1.5"),
    P("pool-backend-unknown", "MemoryPool(backend='nope')", "BackendUnavailableError",
      "'nope'"),
    P("pool-allocate-float", "MemoryPool(backend='host').allocate(1.5)", "TypeError", "1.5"),
    P("pool-allocate-bool", "MemoryPool(backend='host').allocate(True)", "TypeError", "True"),
    P("pool-allocate-str", "MemoryPool(backend='host').allocate('a')", "TypeError", "'a'"),
    P("pool-allocate-zero", "MemoryPool(backend='host').allocate(0)", "ValueError", "0"),
    P("pool-allocate-negative", "MemoryPool(backend='host').allocate(-5)", "ValueError", "-5"),
    P("pool-allocate-2**70", "MemoryPool(backend='host').allocate(2**70)", "ValueError",
      str(2**70)),
    P("pool-free-foreign", "MemoryPool(backend='host').free(4096)", "ValueError", "0x1000"),
]

MODULE = [
    P("launch-grid-str", "LaunchConfig('12', 64)", "TypeError", "'12'"),
    P("launch-grid-float", "LaunchConfig(1.9, 64)", "TypeError", "1.9"),
    P("launch-grid-bool", "LaunchConfig(True, 64)", "TypeError", "True"),
    P("launch-grid-zero", "LaunchConfig(0, 64)", "ValueError", "0"),
    P("launch-grid-four-dims", "LaunchConfig((1, 2, 3, 4), 64)", "ValueError", "(1, 2, 3, 4)"),
    P("launch-grid-str-dim", "LaunchConfig((1, '2'), 64)", "TypeError", "'2'"),
    P("launch-grid-2**31", "LaunchConfig(2**31, 64)", "ValueError", str(2**31)),
    P("launch-block-zero-dim", "LaunchConfig(1, (1024, 0))", "ValueError", "(1024, 0)"),
    P("launch-shared-negative", "LaunchConfig(1, 64, -1)", "ValueError", "-1"),
    P("launch-shared-float", "LaunchConfig(1, 64, 1.5)", "TypeError", "1.5"),
    P("launch-shared-2**32", "LaunchConfig(1, 64, 2**32)", "ValueError", str(2**32)),
    P("launch-stream-int", "LaunchConfig(1, 64, 0, 5)", "TypeError", "5"),
    P("module-image-int", "Module(5, backend='host')", "TypeError", "5"),
    P("module-image-missing-path", "Module('/nonexistent/k.hsaco', backend='host')",
      "FileNotFoundError", "/nonexistent/k.hsaco"),
    P("module-device-9", "Module(b'x', device=9, backend='host')", "BackendUnavailableError",
      "9"),
    P("load_kernels-stem-int", "load_kernels(5, backend='host')", "TypeError", "5"),
    P("load_kernels-device-9", "load_kernels('basic', device=9, backend='host')",
      "BackendUnavailableError", "9"),
    P("kernel-arg-bool", "pack_args((1, True))", "TypeError", "argument 1"),
    P("kernel-arg-object", "pack_args((object(),))", "TypeError", "object"),
    P("kernel-arg-2**64", "pack_args((2**64,))", "OverflowError", str(2**64)),
    P("kernel-arg-complex", "pack_args((np.complex64(1),))", "TypeError", "complex64"),
]

OPS = [
    P("attention-scale-nan", "ops.paged_attention(*attn(), float('nan'))", "ValueError",
      "nan"),
    P("attention-scale-inf", "ops.paged_attention(*attn(), float('inf'))", "ValueError",
      "inf"),
    P("attention-scale-str", "ops.paged_attention(*attn(), 'a')", "TypeError", "'a'"),
    P("attention-scale-bool", "ops.paged_attention(*attn(), True)", "TypeError", "True"),
    P("attention-partitions-str", "ops.paged_attention(*attn(), num_partitions='a')",
      "TypeError", "'a'"),
    P("attention-partitions-zero", "ops.paged_attention(*attn(), num_partitions=0)",
      "ValueError", "0"),
    P("attention-stream-int", "ops.paged_attention(*attn(), stream=5)", "TypeError", "5"),
    P("attention-workspace-int", "ops.paged_attention(*attn(), workspace=5)", "TypeError",
      "5"),
    P("attention-check-str", "ops.paged_attention(*attn(), check='yes')", "TypeError",
      "'yes'"),
    P("attention-out-int", "a = attn(); ops.paged_attention(5, *a[1:])", "TypeError", "5"),
    P("attention-query-2d", "a = attn(); ops.paged_attention(a[0], arr((1, 64)), *a[2:])",
      "ValueError", "(1, 64)"),
    P("attention-dtype-mismatch",
      "a = attn(); ops.paged_attention(arr((1, 2, 64), np.float16), *a[1:])", "ValueError",
      "float16"),
    P("attention-head-dim-32", "ops.paged_attention(*attn((1, 2, 32), (4, 1, 8, 32)))",
      "ValueError", "32"),
    P("attention-block-size-12", "ops.paged_attention(*attn((1, 2, 64), (4, 1, 12, 64)))",
      "ValueError", "12"),
    P("attention-tables-float",
      "a = attn(); ops.paged_attention(*a[:4], np.ones((1, 1)), a[5])", "ValueError",
      "float64"),
    P("attention-lens-shape",
      "a = attn(); ops.paged_attention(*a[:5], np.ones(3, np.int32))", "ValueError", "(3,)"),
    P("attention-block-id-out-of-range",
      "a = attn(); ops.paged_attention(*a[:4], np.full((1, 1), 9, np.int32), a[5])",
      "ValueError", "block id 9"),
    P("attention-lens-negative",
      "a = attn(); ops.paged_attention(*a[:5], np.full(1, -3, np.int32))", "ValueError",
      "-3"),
    P("write-slot-out-of-range",
      "k = kv(); c = arr((4, 1, 8, 64)); ops.reshape_and_cache(k, k, c, c, "
      "np.array([32], np.int64))", "ValueError", "slot 32"),
    P("write-slot-twice",
      "k = kv(2); c = arr((4, 1, 8, 64)); ops.reshape_and_cache(k, k, c, c, "
      "np.array([3, 3], np.int64))", "ValueError", "slot 3 twice"),
    P("write-slots-float",
      "k = kv(); c = arr((4, 1, 8, 64)); ops.reshape_and_cache(k, k, c, c, np.array([1.0]))",
      "ValueError", "float64"),
    P("write-key-shape",
      "c = arr((4, 1, 8, 64)); ops.reshape_and_cache(arr((1, 2, 64)), arr((1, 2, 64)), c, c, "
      "np.zeros(1, np.int64))", "ValueError", "[2, 64]"),
    P("write-stream-int",
      "k = kv(); c = arr((4, 1, 8, 64)); ops.reshape_and_cache(k, k, c, c, "
      "np.zeros(1, np.int64), stream=5)", "TypeError", "5"),
    P("copy_blocks-pairs-2x3", "ops.copy_blocks(slab(), np.zeros((2, 3), np.int64))",
      "ValueError", "(2, 3)"),
    P("copy_blocks-pairs-float", "ops.copy_blocks(slab(), np.zeros((2, 2)))", "ValueError",
      "float64"),
    P("copy_blocks-pair-out-of-range", "ops.copy_blocks(slab(), np.array([[1, 7]]))",
      "ValueError", "[1, 7]"),
    P("copy_blocks-slab-5d", "ops.copy_blocks(arr((1, 2, 4, 8, 64)), np.array([[1, 2]]))",
      "ValueError", "(1, 2, 4, 8, 64)"),
    P("copy_blocks-stream-int", "ops.copy_blocks(slab(), np.array([[1, 2]]), stream=5)",
      "TypeError", "5"),
    P("host_view-int", "ops.host_view(5)", "TypeError", "5"),
    P("workspace-nbytes-str", "ops.Workspace().get('64', 4, arr(4))", "TypeError", "'64'"),
    P("workspace-counters-negative", "ops.Workspace().get(64, -4, arr(4))", "ValueError",
      "-4"),
    P("workspace-like-int", "ops.Workspace().get(64, 4, 5)", "TypeError", "5"),
]

CONFIG = [
    P("config-layers-float", "CacheConfig(1.5, 1, 64, 8, 8)", "TypeError", "1.5"),
    P("config-layers-bool", "CacheConfig(True, 1, 64, 8, 8)", "TypeError", "True"),
    P("config-layers-zero", "CacheConfig(0, 1, 64, 8, 8)", "ValueError", "0"),
    P("config-head-dim-32", "CacheConfig(1, 1, 32, 8, 8)", "ValueError", "32"),
    P("config-block-size-12", "CacheConfig(1, 1, 64, 12, 8)", "ValueError", "12"),
    P("config-blocks-one", "CacheConfig(1, 1, 64, 8, 1)", "ValueError", "1"),
    P("config-blocks-2**40", "CacheConfig(1, 1, 64, 8, 2**40)", "ValueError", str(2**40)),
    P("config-dtype-int8", "CacheConfig(1, 1, 64, 8, 8, 'int8')", "ValueError", "int8"),
    P("config-dtype-object", "CacheConfig(1, 1, 64, 8, 8, object)", "ValueError", "object"),
    P("config-dtype-int", "CacheConfig(1, 1, 64, 8, 8, 5)", "ValueError", "5"),
    P("config-q-heads-not-multiple", "CacheConfig(1, 2, 64, 8, 8, num_q_heads=3)",
      "ValueError", "3"),
    P("config-q-heads-past-int32", "CacheConfig(1, 1, 64, 8, 8, num_q_heads=2**40)",
      "ValueError", str(2**40)),
    P("config-budget-float", "CacheConfig.for_memory(1, 1, 64, 8, budget_bytes=1.5)",
      "TypeError", "1.5"),
    P("config-fraction-nan", "CacheConfig.for_memory(1, 1, 64, 8, fraction=float('nan'))",
      "ValueError", "nan"),
    P("config-fraction-str", "CacheConfig.for_memory(1, 1, 64, 8, fraction='a')", "TypeError",
      "'a'"),
    P("config-fraction-two", "CacheConfig.for_memory(1, 1, 64, 8, fraction=2.0)",
      "ValueError", "2.0"),
]

CACHE = [
    P("cache-config-int", "KvCache(5)", "TypeError", "5"),
    P("cache-strict-str", "KvCache(CFG, backend='host', strict='yes')", "TypeError", "'yes'"),
    P("cache-max_finished-negative", "KvCache(CFG, backend='host', max_finished=-1)",
      "ValueError", "-1"),
    P("cache-ttl-nan", "KvCache(CFG, backend='host', finished_ttl_s=float('nan'))",
      "ValueError", "nan"),
    P("cache-clock-int", "KvCache(CFG, backend='host', clock=5)", "TypeError", "5"),
    P("cache-clock-returns-str", "cache(clock=lambda: 'noon')", "TypeError", "'noon'"),
    P("cache-stream-int", "KvCache(CFG, backend='host', stream=5)", "TypeError", "5"),
    P("cache-device-9", "KvCache(CFG, device=9, backend='host')", "BackendUnavailableError",
      "9"),
    P("cache-add-float", "cache().add_sequence('c', 2.0)", "TypeError", "2.0"),
    P("cache-add-numpy-float", "cache().add_sequence('c', np.float64(3.0))", "TypeError",
      "3.0"),
    P("cache-add-bool", "cache().add_sequence('c', True)", "TypeError", "True"),
    P("cache-add-zero", "cache().add_sequence('c', 0)", "ValueError", "0"),
    P("cache-add-str", "cache().add_sequence('c', '3')", "TypeError", "'3'"),
    P("cache-add-unhashable", "cache().add_sequence(['x'], 2)", "TypeError", "['x']"),
    P("cache-add-existing", "cache().add_sequence('a', 2)", "ValueError", "'a'"),
    P("cache-add-past-the-cache", "cache().add_sequence('c', 10**6)", "CacheFullError",
      "1000000"),
    P("cache-append-str", "cache().append('a')", "TypeError", "'a'"),
    P("cache-append-int", "cache().append(5)", "TypeError", "5"),
    P("cache-append-twice", "cache().append(['a', 'a'])", "ValueError", "'a'"),
    P("cache-append-unknown", "cache().append(['zz'])", "KeyError", "'zz'"),
    P("cache-append-unhashable", "cache().append([['x']])", "TypeError", "['x']"),
    P("cache-append-stream-int", "cache().append(['a'], stream=5)", "TypeError", "5"),
    P("cache-batch-twice", "cache().batch(['a', 'a'])", "ValueError", "'a'"),
    P("cache-batch-str", "cache().batch('ab')", "TypeError", "'ab'"),
    P("cache-batch-unknown", "cache().batch([1.5])", "KeyError", "1.5"),
    P("cache-batch-stream-str", "cache().batch(['a'], stream='s')", "TypeError", "'s'"),
    P("cache-fork-unknown", "cache().fork('zz', 'q')", "KeyError", "'zz'"),
    P("cache-fork-existing", "cache().fork('a', 'b')", "ValueError", "'b'"),
    P("cache-fork-unhashable", "cache().fork('a', ['q'])", "TypeError", "['q']"),
    P("cache-finish-unknown", "cache().finish('zz')", "KeyError", "'zz'"),
    P("cache-remove-unhashable", "cache().remove(['x'])", "TypeError", "['x']"),
    P("cache-seq_len-unknown", "cache().seq_len('zz')", "KeyError", "'zz'"),
    P("cache-block_ids-unhashable", "cache().block_ids({})", "TypeError", "{}"),
    P("cache-times-unknown", "cache().times('zz')", "KeyError", "'zz'"),
    P("cache-can_allocate-str", "cache().can_allocate('a')", "TypeError", "'a'"),
    P("cache-can_allocate-float", "cache().can_allocate(1.5)", "TypeError", "1.5"),
    P("cache-can_append-str", "cache().can_append('a')", "TypeError", "'a'"),
    P("cache-can_append-int", "cache().can_append(5)", "TypeError", "5"),
    P("cache-layer-float", "cache().k_cache(1.5)", "TypeError", "1.5"),
    P("cache-layer-past-end", "cache().k_cache(5)", "IndexError", "5"),
    P("cache-layer-negative", "cache().v_cache(-1)", "IndexError", "-1"),
    P("cache-layer-bool", "cache().k_cache(True)", "TypeError", "True"),
    P("cache-write-key-int", "cache().write(0, 5, 5, np.zeros(1, np.int64))", "TypeError", "5"),
    P("cache-write-plan-layer", "c = cache(); m = c.batch(['a']); c.write(7, kv(), kv(), m)",
      "IndexError", "7"),
    P("cache-write-plan-shape", "c = cache(); m = c.batch(['a']); c.write(0, kv(2), kv(2), m)",
      "ValueError", "(2, 1, 64)"),
    P("cache-attention-not-a-plan",
      "c = cache(); q = arr((1, 2, 64)); c.attention(0, q, q, {'seq_ids': ['a']})",
      "TypeError", "'seq_ids'"),
    P("cache-attention-stale",
      "c = cache(); m = c.batch(['a']); c.append(['a']); q = arr((1, 2, 64)); "
      "c.attention(0, q, q, m)", "ValueError", "stale"),
    P("cache-attention-scale-nan",
      "c = cache(); m = c.batch(['a']); q = arr((1, 2, 64)); "
      "c.attention(0, q, q, m, scale=float('nan'))", "ValueError", "nan"),
    P("cache-closed-add", "closed(cache()).add_sequence('c', 1)", "BufferClosedError",
      "KvCache was closed"),
    P("cache-closed-finish", "closed(cache()).finish('a')", "BufferClosedError",
      "KvCache was closed"),
    P("cache-copy", "copy.copy(cache())", "TypeError", "KvCache"),
]

BLOCKS = [
    P("blocks-count-float", "BlockPool(1.5)", "TypeError", "1.5"),
    P("blocks-count-bool", "BlockPool(True)", "TypeError", "True"),
    P("blocks-count-one", "BlockPool(1)", "ValueError", "1"),
    P("blocks-allocate-float", "BlockPool(8).allocate(1.5)", "TypeError", "1.5"),
    P("blocks-allocate-negative", "BlockPool(8).allocate(-1)", "ValueError", "-1"),
    P("blocks-free-float-ids", "BlockPool(8).free([1.5])", "TypeError", "1.5"),
    P("blocks-free-str-ids", "BlockPool(8).free(['a'])", "TypeError", "'a'"),
    P("blocks-free-past-end", "BlockPool(8).free([99])", "ValueError", "99"),
    P("blocks-free-null", "BlockPool(8).free([0])", "ValueError", "block 0"),
    P("blocks-share-unheld", "BlockPool(8).share([3])", "ValueError", "block 3"),
    P("blocks-free-twice", "p = BlockPool(8); p.free([*p.allocate(1)] * 2)", "ValueError",
      "2 times"),
]

SOAK = [
    P("soak-seconds-negative", "SoakConfig(seconds=-5)", "ValueError", "-5"),
    P("soak-seconds-nan", "SoakConfig(seconds=float('nan'))", "ValueError", "nan"),
    P("soak-seconds-too-short", "SoakConfig(seconds=2)", "ValueError", "2-second"),
    P("soak-leak-rate-negative", "SoakConfig(leak_bytes_per_s=-1)", "ValueError", "-1"),
    P("soak-workloads-unknown", "SoakConfig(workloads=('x',))", "ValueError", "'x'"),
    P("soak-workloads-str", "SoakConfig(workloads='buffers')", "ValueError", "'buffers'"),
    P("soak-leak-flag-str", "SoakConfig(inject_leak='yes')", "TypeError", "'yes'"),
    P("soak-drift-float", "SoakConfig(max_rss_drift_bytes=1.5)", "TypeError", "1.5"),
    P("soak-out_dir-none", "SoakConfig(out_dir=None)", "TypeError", "None"),
]

CLI = [
    C("cli-soak-seconds-negative", "soak --seconds -5", "-5"),
    C("cli-soak-seconds-nan", "soak --seconds nan", "'nan'"),
    C("cli-soak-seconds-inf", "soak --seconds inf", "'inf'"),
    C("cli-soak-seconds-text", "soak --seconds soon", "'soon'"),
    C("cli-soak-too-short", "soak --seconds 2", "2-second"),
    C("cli-soak-rss-leak-negative", "soak --inject-rss-leak-mib -0.5", "-0.5"),
    C("cli-soak-rss-leak-nan", "soak --inject-rss-leak-mib nan", "'nan'"),
    C("cli-soak-too-short-to-judge", "soak --seconds 9.5", "9.5-second"),
    C("cli-soak-minutes-zero", "soak --minutes 0", "0"),
    C("cli-soak-out-under-a-file", "soak --seconds 5 --out /etc/passwd/x", "/etc/passwd"),
    C("cli-soak-drift-negative", "soak --max-rss-drift-mib -1", "-1"),
    C("cli-soak-drift-nan", "soak --max-device-drift-mib nan", "'nan'"),
    C("cli-soak-seed-negative", "soak --seed -1", "-1"),
    C("cli-soak-workload-unknown", "soak --workloads disks", "'disks'"),
    C("cli-info-device-99", "info --device 99 --backend host", "99"),
    C("cli-info-device-negative", "info --device -1", "-1"),
    C("cli-info-device-text", "info --device gpu0", "'gpu0'"),
    C("cli-info-backend-unknown", "info --backend rocm", "'rocm'"),
    C("cli-bench-iters-zero", "bench --iters 0", "0"),
    C("cli-bench-iters-text", "bench --iters many", "'many'"),
    C("cli-bench-device-5", "bench --cache --backend host --device 5", "5"),
    C("cli-bench-from-device-64", "bench --transfer --backend host --from-device 64",
      "device 64"),
    C("cli-bench-from-device-negative", "bench --transfer --from-device -1", "-1"),
    C("cli-demo-scale-zero", "demo --scale 0", "0"),
    C("cli-demo-scale-nan", "demo --scale nan", "'nan'"),
    C("cli-demo-seed-negative", "demo --seed -2", "-2"),
    C("cli-unknown-command", "frobnicate", "'frobnicate'"),
]

IPC = [  # handles built by hand where a real one is not needed: no segment outlives a fork
    P("ipc-shareable-str", "HipBuffer(64, backend='host', shareable='yes')", "TypeError",
      "'yes'"),
    P("ipc-shareable-pool", "HipBuffer(64, pool=MemoryPool(backend='host'), shareable=True)",
      "ValueError", "pooled"),
    P("ipc-handle-plain", "buf().ipc_handle()", "ValueError", "not shareable", "64 bytes"),
    P("ipc-from_ipc-bytes", "HipBuffer.from_ipc(b'abc')", "TypeError", "b'abc'"),
    P("ipc-from_ipc-other-host",
      "HipBuffer.from_ipc(IpcHandle('host', 0, 64, b'/x', 'y', 1, 1, 'other-host'))",
      "IpcError", "other-host"),
    P("ipc-from_ipc-backend-unknown",
      "HipBuffer.from_ipc(IpcHandle('rocm', 0, 64, b'/x', 'y', 1, 1, procs.boot_id()))",
      "BackendUnavailableError", "'rocm'"),
    P("ipc-from_ipc-nbytes-negative",
      "HipBuffer.from_ipc(IpcHandle('host', 0, -64, b'/x', 'y', 1, 1, procs.boot_id()))",
      "ValueError", "-64"),
    P("ipc-from_ipc-key-str",
      "HipBuffer.from_ipc(IpcHandle('host', 0, 64, '/x', 'y', 1, 1, procs.boot_id()))",
      "TypeError", "'/x'"),
    P("ipc-from_ipc-lease-missing",
      "HipBuffer.from_ipc(IpcHandle('host', 0, 64, b'/x', 'no-lease', 1, 1, procs.boot_id()))",
      "IpcError", "no-lease"),
]

TRANSFER = [
    P("transfer-export-unknown", "cache().export_sequence('zz')", "KeyError", "'zz'"),
    P("transfer-import-dict", "cache().import_sequence({'a': 1}, PeerTransport())",
      "TypeError", "{'a': 1}"),
    P("transfer-import-transport-str",
      "c = cache(); c.import_sequence(c.export_sequence('a'), 'ipc')", "TypeError", "'ipc'"),
    P("transfer-import-existing-id",
      "c = cache(); c.import_sequence(c.export_sequence('a'), PeerTransport())", "ValueError",
      "'a'"),
    P("transfer-import-unpublished",
      "c = cache(); c.import_sequence(c.export_sequence('a'), PeerTransport(), 'new')",
      "ValueError", "'peer'"),
    P("transfer-import-other-layout",
      "c = cache(); d = KvCache(CacheConfig(2, 1, 64, 16, 16, 'float32'), backend='host');"
      "d.import_sequence(c.export_sequence('a'), PeerTransport())", "ValueError",
      "block_size 8"),
    P("transfer-mooncake-hostname-int", "MooncakeTransport(5)", "TypeError", "5"),
    P("transfer-mooncake-protocol-none", "MooncakeTransport('127.0.0.1', None)", "TypeError",
      "None"),
    P("transfer-mooncake-protocol-unknown", "MooncakeTransport('127.0.0.1', 'carrier-pigeon')",
      "ValueError", "'carrier-pigeon'"),
    P("transfer-publish-str", "PeerTransport().publish('slab')", "TypeError", "'slab'"),
    C("cli-bench-transport-unknown", "bench --transfer --transport tcp", "'tcp'"),
]

# --- issue 27: the scheduler, the pool, fp8 scales, step plans, streams and the CLI ----------
# A half-done probe checks, with ``unchanged``, that the state it names reads as before.
POOL_STATE = "p.stats, p.lane_states, p.lent_blocks"
SCHEDULER = [
    P("scheduler-clock-int", "sched(clock=5)", "TypeError", "clock", "5"),
    P("scheduler-clock-str", "sched(clock='now')", "TypeError", "'now'"),
    P("scheduler-ttl-negative", "sched(finished_ttl_s=-5)", "ValueError", "finished_ttl_s",
      "-5"),
    P("scheduler-ttl-nan", "sched(finished_ttl_s=float('nan'))", "ValueError", "nan"),
    P("scheduler-ttl-str", "sched(finished_ttl_s='x')", "TypeError", "'x'"),
    P("scheduler-max-finished-float", "sched(max_finished=2.5)", "TypeError", "2.5"),
    P("scheduler-advance-clock-noon",
      "s, p = running(clock=lambda: 'noon'); unchanged(lambda: s.advance(p), "
      "lambda: list(s.running), lambda: s.cache.seq_ids(), lambda: dict(s._finished._records),"
      " lambda: s.running['r'].generated)", "TypeError", "'noon'"),
    P("scheduler-advance-clock-nan",
      "s, p = running(clock=lambda: float('nan')); unchanged(lambda: s.advance(p), "
      "lambda: list(s.running), lambda: s.cache.seq_ids())", "ValueError", "nan"),
    P("scheduler-advance-cache-clock-fails",
      "s, p = running(); t = iter([]); s.cache.clock = lambda: next(t); "
      "unchanged(lambda: s.advance(p), lambda: list(s.running), lambda: s.cache.seq_ids(), "
      "lambda: s.running['r'].generated)", "StopIteration"),
    P("scheduler-preemptions-negative", "sched().submit(Request('a', 3, 3, preemptions=-4))",
      "ValueError", "preemptions", "-4"),
    P("scheduler-overtaken-negative", "sched().submit(Request('a', 3, 3, overtaken=-50))",
      "ValueError", "overtaken", "-50"),
    P("scheduler-overtaken-str", "sched().submit(Request('a', 3, 3, overtaken='x'))",
      "TypeError", "overtaken", "'x'"),
    P("scheduler-generated-float", "sched().submit(Request('a', 3, 3, generated=1.0))",
      "TypeError", "generated", "1.0"),
    P("scheduler-id-unhashable", "sched().submit(Request({'a': 1}, 3, 3))", "TypeError",
      "hashable", "{'a': 1}"),
    P("scheduler-mutate-after-submit",
      "s = sched(); r = Request('a', 3, 3); s.submit(r); r.prompt_tokens = 10**9",
      "AttributeError", "'a'", "prompt_tokens"),
    P("scheduler-mutate-running",
      "s, p = running(); s.running['r'].max_new_tokens = 10**9", "AttributeError",
      "max_new_tokens"),
    P("scheduler-delete-field-after-submit",
      "s = sched(); r = Request('a', 3, 3); s.submit(r); del r.generated", "AttributeError",
      "generated"),
    P("scheduler-submit-twice", "s = sched(); r = Request('a', 3, 3); s.submit(r); "
      "s.submit(r)", "ValueError", "'a'", "submitted already"),
    P("scheduler-plan-frozen", "s, p = running(); p.step = 5", "AttributeError", "step"),
    P("scheduler-queue-read-only", "s = sched(); s.waiting.append(Request('x', 1, 1))",
      "AttributeError", "append"),
    P("scheduler-running-read-only", "s, p = running(); del s.running['r']", "TypeError",
      "mappingproxy"),
    P("scheduler-abort-unknown", "sched().abort('zz')", "KeyError", "'zz'"),
    P("scheduler-abort-unhashable", "sched().abort(['x'])", "TypeError", "hashable", "['x']"),
    P("scheduler-abort-twice", "s, p = running(); s.abort('r'); s.abort('r')", "KeyError",
      "'r'"),
    P("scheduler-step-after-outside-finish",
      "s, p = running(new=3); s.advance(p); s.cache.finish('r'); s.step()", "KeyError", "'r'",
      "abort('r')"),
]

POOL27 = [
    P("pool-free-stream-int-keeps-the-block",
      f"p = MemoryPool(backend='host'); ptr = p.allocate(1000); "
      f"unchanged(lambda: p.free(ptr, stream=5), {POOL_STATE})", "TypeError", "stream", "5"),
    P("pool-free-str", "MemoryPool(backend='host').free('abc')", "TypeError", "ptr", "'abc'"),
    P("pool-free-device-5",
      f"p = MemoryPool(backend='host'); ptr = p.allocate(64); "
      f"unchanged(lambda: p.free(ptr, device=5), {POOL_STATE})", "ValueError", "device 5"),
    P("pool-allocate-closed-seen-stream",
      f"p = MemoryPool(backend='host'); s = Stream(backend='host'); "
      f"p.free(p.allocate(64, stream=s)); s.close(); "
      f"unchanged(lambda: p.allocate(64, stream=s), {POOL_STATE})", "BufferClosedError",
      "closed"),
    P("pool-free-closed-seen-stream",
      f"p = MemoryPool(backend='host'); s = Stream(backend='host'); "
      f"p.free(p.allocate(64, stream=s)); ptr = p.allocate(64); s.close(); "
      f"unchanged(lambda: p.free(ptr, stream=s), {POOL_STATE})", "BufferClosedError",
      "closed"),
    P("pool-buffer-closed-seen-stream",
      "p = MemoryPool(backend='host'); s = Stream(backend='host'); a = p.on(s); "
      "HipBuffer(64, pool=a).close(); s.close(); HipBuffer(64, pool=a)",
      "BufferClosedError", "closed"),
    P("pool-stream-of-another-host-object",
      f"p = MemoryPool(backend='host'); s = Stream(backend=HostBackend()); "
      f"unchanged(lambda: p.allocate(64, stream=s), {POOL_STATE})", "ValueError",
      "another host backend object"),
    P("pool-over-the-limit-keeps-the-cache",
      f"p = pooled(limit=4096); unchanged(lambda: p.allocate(8192), {POOL_STATE})",
      "OutOfMemoryError", "8192"),
    P("pool-over-the-limit-on-a-new-stream",
      f"p = pooled(limit=4096); s = Stream(backend='host'); "
      f"unchanged(lambda: p.allocate(8192, stream=s), {POOL_STATE})", "OutOfMemoryError",
      "8192"),
    P("pool-larger-than-the-device-keeps-the-cache",
      f"p = pooled(); unchanged(lambda: p.allocate(2**61), {POOL_STATE})", "OutOfMemoryError",
      str(2**61)),
    P("pool-close-in-use",
      f"p = MemoryPool(backend='host'); b = HipBuffer(64, pool=p); p.allocate(8); "
      f"unchanged(p.close, {POOL_STATE}, lambda: p.closed)", "RuntimeError", "2 blocks"),
    P("pool-closed-allocate", "p = pooled(); p.close(); p.allocate(64)", "BufferClosedError",
      "MemoryPool was closed"),
    P("pool-closed-buffer", "p = pooled(); p.close(); HipBuffer(64, pool=p)",
      "BufferClosedError", "MemoryPool was closed"),
    P("pool-closed-on", "p = pooled(); p.close(); p.on(Stream(backend='host'))",
      "BufferClosedError", "MemoryPool was closed"),
    P("pool-closed-set_allocator", "p = pooled(); p.close(); rf.set_allocator(p)",
      "BufferClosedError", "closed MemoryPool"),
]

PREFIX = [
    P("prefix-negative-ids", "cache().add_sequence('x', tokens=[-1, -2, -3])", "ValueError",
      ">= 0", "-3"),
    P("prefix-negative-numpy-ids", "cache().add_sequence('x', tokens=np.array([4, -9]))",
      "ValueError", "-9"),
    P("prefix-empty-list", "cache().add_sequence('x', tokens=[])", "ValueError", "non-empty",
      "[]"),
    P("prefix-beyond-int64", "cache().add_sequence('x', tokens=[1, 2**70])", "ValueError",
      "tokens[1]", str(2**70)),
    P("prefix-float-in-list", "cache().add_sequence('x', tokens=[1, 1.5])", "TypeError",
      "tokens[1]", "1.5"),
    P("prefix-none-in-list", "cache().add_sequence('x', tokens=[1, None])", "TypeError",
      "tokens[1]", "None"),
    P("prefix-a-set", "cache().add_sequence('x', tokens={1, 2})", "ValueError", "1-D",
      "{1, 2}"),
    P("prefix-unchanged-index",
      "c = cache(); c.add_sequence('p', tokens=np.arange(16)); "
      "unchanged(lambda: c.add_sequence('x', tokens=[*range(16), -1]), "
      "lambda: dict(c.pool.index), lambda: c.stats(), lambda: c.seq_ids())", "ValueError",
      "-1"),
    P("cache-batch-a-set", "cache().batch({'a', 'b'})", "TypeError", "in order", "set"),
    P("cache-contains-unhashable", "['a'] in cache()", "TypeError", "hashable", "['a']"),
    P("prefix-register-one-hash-short", "p = BlockPool(8); p.register(p.allocate(2), [b'h'])",
      "ValueError", "one hash", "[b'h']"),
    P("prefix-register-unheld", "BlockPool(8).register([3], [b'h'])", "ValueError",
      "block 3"),
    P("prefix-take-the-null-block",
      "p = BlockPool(8); unchanged(lambda: p.take([0]), lambda: p.ref_cnt.tolist())",
      "ValueError", "[0]"),
    P("prefix-lookup-a-set", "BlockPool(8).lookup({b'h'})", "TypeError", "hashes", "set"),
    P("cache-append-a-dict", "cache().append({'a': 1})", "TypeError", "{'a': 1}"),
    P("cache-ttl-str", "KvCache(CFG, backend='host', finished_ttl_s='x')", "TypeError",
      "finished_ttl_s", "'x'"),
    P("cache-max-finished-float", "KvCache(CFG, backend='host', max_finished=1.5)",
      "TypeError", "max_finished", "1.5"),
]

FP8 = [
    P("fp8-scale-too-small", "fp8(((1e-40, 1.0),))", "ValueError", "k_scale", "1e-40",
      "float32"),
    P("fp8-scale-too-large", "fp8(((1.0, 1e39),))", "ValueError", "v_scale", "1e+39"),
    P("fp8-scale-2**1100", "fp8(((2**1100, 1.0),))", "ValueError", "k_scale", "float range"),
    P("fp8-scale-negative", "fp8(((-1.0, 1.0),))", "ValueError", "k_scale", "-1.0"),
    P("fp8-scale-a-set", "fp8(({4.0, 0.5},))", "TypeError", "kv_scales[0]", "{"),
    P("fp8-scales-a-set-of-pairs", "fp8({(4.0, 0.5), (1.0, 2.0)})", "TypeError", "kv_scales",
      "set"),
    P("fp8-scales-a-dict", "fp8({0: (1.0, 1.0)})", "TypeError", "kv_scales", "dict"),
    P("fp8-scales-a-string-pair", "fp8(('12',))", "TypeError", "kv_scales[0]", "'12'"),
    P("fp8-ops-k-scale-too-small",
      "c = fp8(); k = arr((1, 2, 64), np.float16); "
      "ops.reshape_and_cache(k, k, c.k_cache(0), c.v_cache(0), np.zeros(1, np.int64), "
      "k_scale=1e-40)", "ValueError", "k_scale", "1e-40"),
    P("fp8-ops-v-scale-too-large",
      "c = fp8(); q = arr((1, 2, 64), np.float16); "
      "ops.paged_attention(arr((1, 2, 64), np.float16), q, c.k_cache(0), c.v_cache(0), "
      "np.ones((1, 1), np.int32), np.ones(1, np.int32), v_scale=1e39)", "ValueError",
      "v_scale", "1e+39"),
    P("fp8-ops-scale-2**1100",
      "c = fp8(); k = arr((1, 2, 64), np.float16); "
      "ops.reshape_and_cache(k, k, c.k_cache(0), c.v_cache(0), np.zeros(1, np.int64), "
      "v_scale=2**1100)", "ValueError", "v_scale", "float range"),
    P("fp8-keys-into-an-fp8-cache",
      "c = fp8(); import ml_dtypes; k = arr((5, 2, 64), ml_dtypes.float8_e4m3fn); "
      "c.write(0, k, k, c.add_sequence('b', 5).slot_mapping)", "ValueError", "key",
      "float8_e4m3fn"),
    P("fp8-folded-scale-overflows",
      "c = fp8(((1e30, 1.0),), num_q_heads=2); m = c.batch(['a']); "
      "c.attention(0, arr((1, 2, 64), np.float16), arr((1, 2, 64), np.float16), m, "
      "scale=1e10)", "ValueError", "float32", "1e+10"),
]

STEP = [
    P("step-first-attention-bad-out-plans-nothing",
      "c = KvCache(CacheConfig(1, 1, 64, 8, 16, 'float32'), backend='host'); "
      "c.add_sequence('a', 5); m = c.batch(['a']); unchanged(lambda: c.attention(0, "
      "arr((1, 2, 64)), arr((1, 4, 64)), m), lambda: m._q_shape)", "ValueError", "out",
      "(1, 2, 64)"),
    P("step-first-attention-bad-layer-plans-nothing",
      "c = KvCache(CacheConfig(1, 1, 64, 8, 16, 'float32'), backend='host'); "
      "c.add_sequence('a', 5); m = c.batch(['a']); q = arr((1, 4, 64)); "
      "unchanged(lambda: c.attention(3, arr((1, 4, 64)), q, m), lambda: m._q_shape)",
      "IndexError", "3"),
    P("step-scale-1e300", "c = cache(); m = c.batch(['a']); "
      "c.attention(0, arr((1, 2, 64)), arr((1, 2, 64)), m, scale=1e300)", "ValueError",
      "scale", "float32", "1e+300"),
    P("step-scale-subnormal", "c = cache(); m = c.batch(['a']); "
      "c.attention(0, arr((1, 2, 64)), arr((1, 2, 64)), m, scale=1e-45)", "ValueError",
      "1e-45"),
    P("step-out-aliases-the-slab",
      "c = cache(); m = c.batch(['a']); "
      "c.attention(0, DeviceArray(c.slab.buffer, np.float32, (1, 2, 64)), arr((1, 2, 64)), m)",
      "ValueError", "out overlaps the cache's slab"),
    P("step-out-is-the-query", "c = cache(); m = c.batch(['a']); q = arr((1, 2, 64)); "
      "c.attention(0, q, q, m)", "ValueError", "out overlaps query"),
    P("step-key-in-the-slab",
      "c = cache(); m = c.batch(['a']); k = DeviceArray(c.slab.buffer, np.float32, (1, 1, 64), "
      "4096); c.write(0, k, kv(), m)", "ValueError", "key overlaps the cache's slab"),
    P("step-write-stream-int", "c = cache(); m = c.batch(['a']); c.write(0, kv(), kv(), m, "
      "stream=5)", "TypeError", "stream", "5"),
    P("step-attention-stream-str", "c = cache(); m = c.batch(['a']); "
      "c.attention(0, arr((1, 2, 64)), arr((1, 2, 64)), m, stream='s')", "TypeError", "'s'"),
    P("step-two-host-backend-objects",
      "c = cache(); m = c.batch(['a']); k = DeviceArray.empty((1, 1, 64), np.float32, "
      "backend=HostBackend()); c.write(0, k, k, m)", "ValueError",
      "another host backend object"),
    P("step-plan-frozen", "c = cache(); m = c.batch(['a']); m.stream = Stream(backend='host')",
      "AttributeError", "stream"),
    P("ops-out-is-the-query", "a = attn(); ops.paged_attention(*a)", "ValueError",
      "out overlaps query"),
    P("ops-key-in-the-cache",
      "c = arr((4, 1, 8, 64)); k = DeviceArray(c.buffer, np.float32, (1, 1, 64)); "
      "ops.reshape_and_cache(k, kv(), c, arr((4, 1, 8, 64)), np.array([9]))", "ValueError",
      "k_cache overlaps key"),
    P("ops-two-host-backend-objects",
      "c = arr((4, 1, 8, 64)); k = DeviceArray.empty((1, 1, 64), np.float32, "
      "backend=HostBackend()); ops.reshape_and_cache(k, k, c, c, np.array([9]))",
      "ValueError", "another host backend object"),
]

STREAMS = [
    P("stream-record-on-another-host-object",
      "Event(backend='host').record(Stream(backend=HostBackend()))", "ValueError",
      "another host backend object"),
    P("stream-fill-on-another-host-object",
      "buf().fill(0, stream=Stream(backend=HostBackend()))", "ValueError",
      "another host backend object"),
    P("stream-copy-from-another-host-object",
      "buf().copy_from(HipBuffer(64, backend=HostBackend()))", "ValueError",
      "another host backend object"),
    P("stream-workspace-on-another-host-object",
      "ops.Workspace().get(64, 4, arr(4), Stream(backend=HostBackend()))", "ValueError",
      "another host backend object"),
]

CLI27 = [
    C("cli-soak-drift-1e308", "soak --max-device-drift-mib 1e308", "--max-device-drift-mib",
      "1e308"),
    C("cli-soak-rss-drift-1e308", "soak --max-rss-drift-mib 1e308", "--max-rss-drift-mib"),
    C("cli-soak-minutes-1e308", "soak --minutes 1e308", "--minutes", "1e308"),
    C("cli-soak-rss-leak-1e308", "soak --inject-rss-leak-mib 1e308", "--inject-rss-leak-mib",
      "1e308"),
    C("cli-soak-seconds-1e12", "soak --seconds 1e12", "--seconds", "1e12"),
    C("cli-bench-iters-10**20", "bench --alloc --iters 100000000000000000000", "--iters",
      "100000000000000000000"),
    C("cli-demo-seed-2**70", f"demo --seed {2**70}", "--seed", str(2**70)),
    C("cli-info-device-2**40", f"info --device {2**40}", "--device", str(2**40)),
    C("cli-bench-iters-5000-digits", "bench --iters " + "9" * 5000, "--iters", "..."),
]

PROBES = (RUNTIME + BUFFER + ARRAY + DLPACK + STREAM + POOL + MODULE + OPS + CONFIG + CACHE
          + BLOCKS + SOAK + CLI + IPC + TRANSFER + SCHEDULER + POOL27 + PREFIX + FP8 + STEP
          + STREAMS + CLI27)

# --- running them, crash-isolated ------------------------------------------------------------
# One child interpreter imports the package once, then forks for every probe: a probe that
# crashes or hangs (30 s) takes down only its own fork, and no probe sees another's state
# (a probe that wrongly succeeded at, say, set_allocator would otherwise break the rest).
RUNNER = r"""
import contextlib, io, json, os, signal, sys, warnings
warnings.simplefilter("ignore")
setup, probes = json.load(sys.stdin)
base = {}
exec(setup, base)
from rocmforge_raw.cli import main

def run(pid, kind, payload):
    record = {"id": pid, "raised": None}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if kind == "call":
                exec(payload, dict(base))
            else:
                try:
                    record["exit"] = main(payload)
                except SystemExit as exc:
                    record["exit"] = exc.code
    except BaseException as exc:
        record.update(raised=type(exc).__name__, message=str(exc),
                      mro=[c.__name__ for c in type(exc).__mro__])
    record.update(stdout=out.getvalue(), stderr=err.getvalue())
    return record

for pid, kind, payload in probes:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        signal.alarm(30)
        os.write(write, json.dumps(run(pid, kind, payload)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(child, 0)
    if data:
        record = json.loads(data)
    else:
        record = {"id": pid, "crashed": f"wait status {status}"}
    print(json.dumps(record), flush=True)
"""


def run_probes(probes: list[Probe]) -> dict[str, dict]:
    """Each probe's outcome by id (see ``RUNNER``)."""
    done = subprocess.run(
        [sys.executable, "-c", RUNNER], capture_output=True, text=True, timeout=600,
        input=json.dumps([SETUP, [(p.id, p.kind, p.payload) for p in probes]]))
    results = {}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        results[record["id"]] = record
    for probe in probes:  # the runner itself died: blame what it did not report
        results.setdefault(probe.id, {"id": probe.id, "crashed": done.returncode,
                                      "stderr": done.stderr[-3000:]})
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    return run_probes(PROBES)


@pytest.fixture(autouse=True)
def no_leaked_buffers():
    """The probes allocate in child interpreters only: nothing to count here (and the
    conftest's count, a full garbage collection per test, would triple this file's time)."""
    yield


@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_bad_input_is_refused_clearly(probe: Probe, outcomes: dict[str, dict]) -> None:
    found = outcomes[probe.id]
    assert "crashed" not in found, f"the probe crashed ({found['crashed']}): {found}"
    if probe.kind == "cli":
        assert found["raised"] is None, f"traceback: {found['raised']}: {found['message']}"
        assert found["exit"] == 2, f"exit status {found['exit']}, stderr {found['stderr']!r}"
        lines = found["stderr"].splitlines()
        assert len(lines) == 1, f"not one line: {found['stderr']!r}"
        message = lines[0]
    else:
        assert found["raised"], "accepted silently"
        assert probe.error in found["mro"], (
            f"raised {found['raised']}, not {probe.error}: {found['message']}")
        message = found["message"]
    for word in probe.words:
        assert word in message, f"message does not name {word!r}: {message!r}"


def test_enough_probes_over_every_area():
    areas = {p.id.split("-")[0] for p in PROBES}
    assert len(PROBES) >= 150 and len({p.id for p in PROBES}) == len(PROBES)
    assert {"buffer", "array", "dlpack", "stream", "event", "pool", "launch", "module",
            "attention", "write", "copy_blocks", "workspace", "config", "cache", "blocks",
            "soak", "cli", "runtime", "ipc", "transfer", "scheduler", "prefix", "fp8", "step",
            "ops"} <= areas


def test_a_probe_that_crashes_is_blamed_alone():
    probes = [P("before", "int('x')", "ValueError", "'x'"),
              P("segfault", "import ctypes; ctypes.string_at(0)", "ValueError"),
              P("after", "[][1]", "IndexError", "out of range")]
    found = run_probes(probes)
    assert found["segfault"]["crashed"] == "wait status 11"  # SIGSEGV
    assert found["before"]["raised"] == "ValueError" and found["after"]["raised"] == "IndexError"


def test_numpy_integers_work_wherever_ints_do():
    i64, i32 = np.int64, np.int32
    with rf.HipBuffer(i64(64), device=i32(0), backend="host") as buf:
        assert buf.view(i64(8), i32(16)).nbytes == 16
        assert buf.typed(np.float32, (i64(2), i32(4)), i64(16)).shape == (2, 4)
        assert buf.to_numpy(np.uint8, i64(4), offset=i32(4)).shape == (4,)
        buf.fill(i32(7), i64(0), i64(8))
    array = rf.DeviceArray.empty(i64(4), np.float32, backend="host")
    assert array.shape == (4,) and type(array.shape[0]) is int
    array.buffer.root.close()
    assert rf.LaunchConfig(i64(2), (i32(64), i64(2))).block == (64, 2, 1)
    pool = rf.MemoryPool(device=i64(0), backend="host", limit=i64(1 << 20))
    pool.free(pool.allocate(i64(64)))
    config = CacheConfig(i64(1), i32(1), i64(64), i32(8), i64(8), "float32")
    with KvCache(config, backend="host") as cache:
        assert cache.add_sequence("a", i64(9)).slot_mapping.size == 9
        assert cache.can_allocate(i32(8)) and cache.k_cache(i64(0)).shape == (8, 1, 8, 64)
    blocks = BlockPool(i64(8))
    blocks.free(blocks.allocate(i32(2)).astype(np.int16))
