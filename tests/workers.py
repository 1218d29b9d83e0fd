"""Processes that the IPC and transfer tests start: each a fresh interpreter (spawned), bounded
in time, stopped at the end, reporting through a pipe (an exception as its traceback)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

#: Seconds any exchange with a worker may take before the test fails (never hangs).
TIMEOUT = 120.0


class Worker:
    """A spawned process and the parent's end of its pipe."""

    def __init__(self, process: Any, conn: Any) -> None:
        self.process, self.conn = process, conn

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def receive(self) -> Any:
        """The worker's next message; the test fails if it raised or sent nothing in time."""
        if not self.conn.poll(TIMEOUT):
            raise TimeoutError(f"the worker sent nothing in {TIMEOUT} s")
        message = self.conn.recv()
        if isinstance(message, tuple) and message[:1] == ("error",):
            raise AssertionError(f"the worker failed:\n{message[1]}")
        return message

    def kill(self) -> None:
        """SIGKILL the worker (it cannot clean up anything) and wait for its end."""
        self.process.kill()
        self.process.join()


@contextlib.contextmanager
def spawned(target: Any, *args: Any) -> Iterator[Worker]:
    """Run ``target(*args, conn)`` in a spawned process. On leaving, the process gets
    ``TIMEOUT`` seconds to end, then is killed."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_guarded, args=(target, args, child_conn), daemon=True)
    process.start()
    try:
        yield Worker(process, conn)
    finally:
        process.join(TIMEOUT)
        if process.is_alive():
            process.kill()
            process.join()
        conn.close()


def _guarded(target: Any, args: tuple, conn: Any) -> None:
    try:
        _on_the_suites_device()
        target(*args, conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _on_the_suites_device() -> None:
    """A worker makes what names no device on the suite's device (``RF_DEVICE``, as
    conftest does for the tests): each backend that answers starts there."""
    device = os.environ.get("RF_DEVICE", "")
    if device.isdigit() and int(device):
        from rocmforge_raw import available_backends, get_backend

        for name, status in available_backends().items():
            if status == "ok":
                get_backend(name).set_device(int(device))


# --- IPC ---------------------------------------------------------------------------------------
def map_and_write(handle: Any, hold: bool, conn: Any) -> None:
    """Map ``handle``, send its first 8 int32, write 7, 7 at its start; unless ``hold``, close
    it; send "closed" or "holding", then wait for "exit"."""
    from rocmforge_raw import HipBuffer

    buf = HipBuffer.from_ipc(handle)
    conn.send(buf.to_numpy(np.int32, 8).tolist())
    buf.copy_from_host(np.array([7, 7], np.int32))
    buf.backend.synchronize(buf.device)
    if not hold:
        buf.close()
    conn.send("holding" if hold else "closed")
    if conn.poll(TIMEOUT):
        conn.recv()
    buf.close()


def map_then_close_when_told(handle: Any, conn: Any) -> None:
    """Map ``handle`` and send "holding"; when told, close it and send "closed", then stay
    alive until told again (a living process that let go)."""
    from rocmforge_raw import HipBuffer

    buf = HipBuffer.from_ipc(handle)
    conn.send("holding")
    if conn.poll(TIMEOUT):
        conn.recv()
    buf.close()
    conn.send("closed")
    if conn.poll(TIMEOUT):
        conn.recv()


def map_twice(handle: Any, conn: Any) -> None:
    """Import ``handle`` twice: send both addresses, then the data seen through the second
    after the first closed, and the count of mappings."""
    from rocmforge_raw import HipBuffer
    from rocmforge_raw.memory import ipc

    first, second = HipBuffer.from_ipc(handle), HipBuffer.from_ipc(handle)
    addresses = (first.ptr, second.ptr)
    first.close()
    conn.send((addresses, second.to_numpy(np.int32, 4).tolist(), ipc.pending()["imported"]))
    second.close()
    conn.send(ipc.pending()["imported"])


def map_and_ask(handle: Any, conn: Any) -> None:
    """Import ``handle``; send whether ipc.mapped sees its first and last byte, the byte past
    it and a buffer of this process's own; then the same for the first byte once closed."""
    from rocmforge_raw import HipBuffer
    from rocmforge_raw.memory import ipc

    buf, own = HipBuffer.from_ipc(handle), HipBuffer(64, handle.device, handle.backend)
    conn.send([ipc.mapped(p) for p in (buf.ptr, buf.ptr + buf.nbytes - 1,
                                       buf.ptr + buf.nbytes, own.ptr)])
    start = buf.ptr
    buf.close()
    own.close()
    conn.send(ipc.mapped(start))


def try_map(handle: Any, conn: Any) -> None:
    """Try to import ``handle``; send the error's type name and message (or "mapped")."""
    from rocmforge_raw import HipBuffer

    try:
        HipBuffer.from_ipc(handle).close()
        conn.send(("mapped", ""))
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc)))


def try_map_each(handles: list, conn: Any) -> None:
    """``try_map`` each of ``handles`` in turn (one message each)."""
    for handle in handles:
        try_map(handle, conn)


def try_map_while_mapping(held: Any, handle: Any, conn: Any) -> None:
    """Map ``held``, then try to import ``handle`` too; send as ``try_map`` does."""
    from rocmforge_raw import HipBuffer

    with HipBuffer.from_ipc(held):
        try_map(handle, conn)


def map_and_map_again(handle: Any, conn: Any) -> None:
    """Map ``handle`` and send "holding"; once told, ``try_map`` it again (still mapping it)."""
    from rocmforge_raw import HipBuffer

    with HipBuffer.from_ipc(handle):
        conn.send("holding")
        if conn.poll(TIMEOUT):
            conn.recv()
            try_map(handle, conn)


def export_and_wait(backend: str, *args: Any) -> None:
    """Export a shareable buffer holding 0..1023 (int32) on device ``args[0]`` if given (else
    the process's), send its handle, wait to be killed. Called as (backend, [device,] conn)."""
    from rocmforge_raw import HipBuffer

    *device, conn = args
    buf = HipBuffer(4096, *device, backend=backend, shareable=True)
    buf.copy_from_host(np.arange(1024, dtype=np.int32))
    conn.send(buf.ipc_handle())
    conn.poll(TIMEOUT)


def share_once(backend: str, conn: Any) -> None:
    """Export a shareable buffer (the first export sweeps what dead processes left) and send
    the names of this package's files in /dev/shm."""
    from rocmforge_raw import HipBuffer
    from rocmforge_raw.common import procs

    with HipBuffer(64, backend=backend, shareable=True) as buf:
        buf.ipc_handle()
        conn.send(sorted(n for n in os.listdir(procs.SHM_DIR) if n.startswith(procs.PREFIX)))


# --- sequence transfer -------------------------------------------------------------------------
def kv(seed: int, num_tokens: int, config: Any) -> tuple[np.ndarray, np.ndarray]:
    """K and V of ``num_tokens`` tokens (``[tokens, kv heads, head dim]``, the activation
    dtype), the same for the same seed in any process."""
    rng = np.random.default_rng(seed)
    shape = (num_tokens, config.num_kv_heads, config.head_dim)
    return tuple(rng.standard_normal(shape, np.float32).astype(config.activation_dtype)
                 for _ in range(2))


def prefill(backend: str, device: int, transport: str, config: Any, num_tokens: int,
            seed: int, conn: Any) -> None:
    """The prefill side: a cache on ``device`` whose slab is published through
    ``transport``, a prompt written layer by layer (K/V from ``kv(seed + layer)``), its
    description sent; then it waits for "done" to finish the sequence, close the cache and
    stop the transport."""
    from rocmforge_raw.cache import KvCache
    from rocmforge_raw.transport import IpcTransport, MooncakeTransport

    link = IpcTransport() if transport == "ipc" else MooncakeTransport("127.0.0.1")
    with link, KvCache(config, device, backend, shareable=transport == "ipc") as cache:
        _write_prompt(cache, link, num_tokens, seed)
        conn.send(cache.export_sequence("prompt"))
        if conn.poll(TIMEOUT) and conn.recv() == "done":
            cache.finish("prompt")
            conn.send(cache.stats()["used_blocks"])


def _write_prompt(cache: Any, link: Any, num_tokens: int, seed: int) -> None:
    """Publish ``cache``'s slab through ``link``, then add "prompt" (``num_tokens``, after
    3 warm-up blocks) with the K/V of ``kv(seed + layer)`` written layer by layer."""
    from rocmforge_raw import DeviceArray

    config, device, backend = cache.config, cache.slab.device, cache.slab.backend
    link.publish(cache.slab)
    cache.add_sequence("warm-up", num_tokens=3 * config.block_size)  # blocks differ
    slots = cache.add_sequence("prompt", tokens=np.arange(num_tokens)).slot_mapping
    for layer in range(config.num_layers):
        k, v = (DeviceArray.from_numpy(x, device, backend)
                for x in kv(seed + layer, num_tokens, config))
        cache.write(layer, k, v, slots)
        k.buffer.close()
        v.buffer.close()


def prefill_then_close(backend: str, device: int, config: Any, num_tokens: int, conn: Any
                       ) -> None:
    """``prefill`` over IPC, the description sent; then, on "close", close the cache (the
    transport stays open) and send ``ipc.pending()``; on "collect", retry deferred frees and
    send (the live buffers, ``ipc.pending()``); stay alive until told "exit"."""
    import gc

    import rocmforge_raw as rf
    from rocmforge_raw.cache import KvCache
    from rocmforge_raw.memory import ipc
    from rocmforge_raw.transport import IpcTransport

    with IpcTransport() as link:
        cache = KvCache(config, device, backend, shareable=True)
        _write_prompt(cache, link, num_tokens, 7)
        conn.send(cache.export_sequence("prompt"))
        while conn.poll(TIMEOUT) and (word := conn.recv()) != "exit":
            if word == "close":
                cache.close()
                conn.send(ipc.pending())
            elif word == "collect":
                gc.collect()
                ipc.collect()
                rf.free_waiting()
                conn.send((rf.memory_stats()["live_buffers"], ipc.pending()))
