"""FlashInfer's decode kernels on the bench's K/V memory, for tools/decode_side_by_side.py
(beside it: run from there): its decode wrapper and its XQA decode, each timed as the bench
times ours (``bench.time_ms``) and its output compared with ours.

torch and flashinfer are imported where a function needs them, so that the comparison's
options and rows work (and are tested) where neither is installed. Times are microseconds;
differences are relative Frobenius norms (float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from rocmforge_raw import bench
from rocmforge_raw.array import DeviceArray
from rocmforge_raw.runtime import get_backend

DEVICE = 0


def window_left(window: int) -> int:
    """FlashInfer's ``window_left`` for a window of ``window`` tokens (0: none): the keys it
    lets a query see left of its own position, so ``window - 1`` (-1: no window)."""
    return window - 1 if window else -1


def find_xqa(torch: Any, flashinfer: Any) -> tuple[Callable[..., Any] | None, str | None]:
    """FlashInfer's XQA decode, or None and why it cannot run here."""
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache
    except ImportError:
        return None, f"FlashInfer {flashinfer.__version__} has no XQA decode"
    major, minor = torch.cuda.get_device_capability(DEVICE)
    if major not in (9, 10, 12):
        return None, f"XQA runs on SM90, SM100 and SM120; this GPU is sm_{major}{minor}"
    return xqa_batch_decode_with_kv_cache, None


def torch_view(array: DeviceArray) -> Any:
    """``array`` as a torch tensor over the same memory (fp8 through its bytes)."""
    import torch

    if array.dtype.itemsize != 1:
        return torch.from_dlpack(array)
    codes = torch.from_dlpack(DeviceArray(array.buffer, np.uint8, array.shape))
    return codes.view(getattr(torch, array.dtype.name))


def relative_diff(got: Any, want: Any) -> float:
    """|got - want| / |want| (Frobenius norms, float64) of two torch tensors; inf on NaN."""
    got, want = got.double(), want.double()
    if not bool(got.isfinite().all()):
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def nearest_window(theirs: Any, want: Any, window: int, edges: dict[int, Any]) -> int:
    """Of ``window`` (ours: ``want``) and the windows of ``edges`` (ours one token shorter
    and longer), the one whose output of ours ``theirs`` lies nearest (tokens)."""
    found = {window: relative_diff(theirs, want),
             **{w: relative_diff(theirs, out) for w, out in edges.items()}}
    return min(found, key=found.__getitem__)


def time_us(fn: Callable[[], Any], iters: int) -> float:
    """``fn``'s median device time in microseconds, as the bench times ours."""
    return 1e3 * bench.time_ms(get_backend("cuda"), DEVICE, fn, iters).ms


def run_wrapper(flashinfer: Any, workspace: Any, shape: bench.Shape, tq: Any,
                kv: tuple[Any, Any], tables: np.ndarray, lens: np.ndarray,
                scales: tuple[float, float], want: Any, edges: dict[int, Any], iters: int
                ) -> dict[str, Any]:
    """FlashInfer's decode wrapper, CUDA-core (cc) and tensor-core (tc) kernels (planned
    with the row's window): each one's time and difference from ours (or its error), on a
    window row the window it matches (``nearest_window``), and the faster one's time."""
    import torch

    need = -(-lens // shape.block_size)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(need)]).astype(np.int32)).cuda()
    indices = torch.tensor(np.concatenate([tables[i, : need[i]] for i in range(len(lens))]))
    last = torch.tensor(((lens - 1) % shape.block_size + 1).astype(np.int32)).cuda()
    k_scale, v_scale = scales
    row: dict[str, Any] = {"wrapper_us": None, "wrapper_kernel": None}
    for tag, tensor_cores in (("cc", False), ("tc", True)):
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "HND", use_tensor_cores=tensor_cores)
            wrapper.plan(indptr, indices.cuda(), last, shape.q_heads, shape.kv_heads,
                         shape.head_dim, shape.block_size, window_left=window_left(shape.window),
                         q_data_type=tq.dtype, kv_data_type=kv[0].dtype)
            theirs = torch.empty_like(tq)
            wrapper.run(tq, kv, k_scale=k_scale, v_scale=None if v_scale == 1.0 else v_scale,
                        out=theirs)
            torch.cuda.synchronize()
            row[f"wrapper_{tag}_diff"] = relative_diff(theirs, want)
            if shape.window:
                row[f"wrapper_{tag}_window"] = nearest_window(theirs, want, shape.window, edges)
            row[f"wrapper_{tag}_us"] = time_us(
                lambda w=wrapper, o=theirs: w.run(tq, kv, k_scale=k_scale, out=o), iters)
        except Exception as exc:  # a shape or type this FlashInfer does not take
            row[f"wrapper_{tag}_error"] = repr(exc)[:300]
            continue
        if row["wrapper_us"] is None or row[f"wrapper_{tag}_us"] < row["wrapper_us"]:
            row.update(wrapper_us=row[f"wrapper_{tag}_us"], wrapper_kernel=tag)
    return row


def run_xqa(xqa: Callable[..., Any], workspace: Any, shape: bench.Shape, tq: Any,
            kv: tuple[Any, Any], tables: np.ndarray, lens: np.ndarray,
            scales: tuple[float, float], want: Any, edges: dict[int, Any], iters: int
            ) -> dict[str, Any]:
    """FlashInfer's XQA decode (with the row's window): its time and difference from ours
    (on a window row also the window it matches), or its error."""
    import torch

    k_scale, v_scale = scales
    try:
        block_tables = torch.from_numpy(tables).cuda()
        seq_lens = torch.from_numpy(lens.astype(np.uint32)).cuda()
        theirs = torch.empty_like(tq)

        def run() -> None:
            xqa(tq, kv, workspace, block_tables, seq_lens, tables.shape[1] * shape.block_size,
                bmm1_scale=k_scale / math.sqrt(shape.head_dim), bmm2_scale=v_scale,
                window_left=window_left(shape.window), out=theirs, kv_layout="HND")

        run()
        torch.cuda.synchronize()
        found = {"xqa_diff": relative_diff(theirs, want)}
        if shape.window:
            found["xqa_window"] = nearest_window(theirs, want, shape.window, edges)
        return {"xqa_us": time_us(run, iters), **found}
    except Exception as exc:  # a shape or GPU XQA does not take
        return {"xqa_us": None, "xqa_error": repr(exc)[:300]}
