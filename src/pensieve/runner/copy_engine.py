"""Many host <-> device copies in one call: the copy engines' batch entry point.

A swap of n scattered chunks is n copies (or n per group of layers). Issued one
``cudaMemcpyAsync`` at a time from Python their host time sank the grouped copies;
``cuMemcpyBatchAsync`` (CUDA 12.8+ drivers) takes them all in one call (chosen by
measurement: docs/performance_history.md, "Swaps between the GPU and CPU tiers", the item "Staged
swap-ins by groups of layers, in one driver call per group").

:class:`CopyEngine` takes the copies as numpy arrays of addresses and sizes (built by
arithmetic, no tensor view per copy) and issues them on the current stream: the batch call on
CUDA, one ``cuMemcpyAsync`` each where the driver has no batch call, and ``memmove`` on the
CPU (where every address is a host address: the tests run the same address arithmetic).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import torch

_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_LOC_DEVICE, _LOC_HOST = 1, 2  # CU_MEM_LOCATION_TYPE_DEVICE / _HOST
_U64P = ctypes.POINTER(ctypes.c_uint64)


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attrs(ctypes.Structure):
    """``CUmemcpyAttributes``."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Loc),
                ("dstLocHint", _Loc), ("flags", ctypes.c_uint)]


@functools.cache
def _driver() -> tuple[Any, Any, bool] | None:
    """``(batch call or None, cuMemcpyAsync, batch call has the CUDA 13 signature)``."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v2 = getattr(lib, "cuMemcpyBatchAsync_v2", None)  # CUDA 13: no failIdx argument
    batch = v2 if v2 is not None else getattr(lib, "cuMemcpyBatchAsync", None)
    single = lib.cuMemcpyAsync
    return batch, single, v2 is not None


class CopyEngine:
    """Issues copies given as addresses on ``device`` (CUDA: on the current stream)."""

    def __init__(self, device: torch.device, *, batch: bool = True) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        drv = _driver() if self.cuda else None
        if self.cuda and drv is None:
            raise RuntimeError("libcuda.so.1 not found")
        self._batch, self._single, self._v2 = drv or (None, None, False)
        if not batch:
            self._batch = None
        self.batched = self._batch is not None
        """Whether copies go in one driver call (else one call each)."""
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            dev_loc = _Loc(_LOC_DEVICE, index)
            host_loc = _Loc(_LOC_HOST, 0)
            self._attrs = {True: _Attrs(_ORDER_STREAM, host_loc, dev_loc, 0),
                           False: _Attrs(_ORDER_STREAM, dev_loc, host_loc, 0)}

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, to_device: bool
             ) -> None:
        """Copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` (uint64 arrays) for every
        i; ``to_device``: host -> device (else device -> host)."""
        n = len(dsts)
        if n == 0:
            return
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        if not self.cuda:
            for d, s, k in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
                ctypes.memmove(d, s, k)
            return
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        if self._batch is None:
            for d, s, k in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
                self._check(self._single(ctypes.c_uint64(d), ctypes.c_uint64(s),
                                         ctypes.c_size_t(k), stream), 1)
            return
        zero = ctypes.c_size_t(0)
        args: list[Any] = [dsts.ctypes.data_as(_U64P), srcs.ctypes.data_as(_U64P),
                           sizes.ctypes.data_as(_U64P), ctypes.c_size_t(n),
                           ctypes.byref(self._attrs[to_device]), ctypes.byref(zero),
                           ctypes.c_size_t(1)]
        if not self._v2:
            fail = ctypes.c_size_t(0)
            args.append(ctypes.byref(fail))
        args.append(stream)
        self._check(self._batch(*args), n)

    @staticmethod
    def _check(err: int, n: int) -> None:
        if err != 0:
            raise RuntimeError(f"CUDA driver copy of {n} piece(s) failed: CUresult {err}")


def pieces(dst_base: int, dst_index: np.ndarray, dst_stride: int, src_base: int,
           src_index: np.ndarray, src_stride: int, size: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptors copying ``size`` bytes from ``src_base + src_index[i] * src_stride`` to
    ``dst_base + dst_index[i] * dst_stride`` for every i."""
    dsts = np.asarray(dst_index, dtype=np.uint64) * np.uint64(dst_stride) + np.uint64(dst_base)
    srcs = np.asarray(src_index, dtype=np.uint64) * np.uint64(src_stride) + np.uint64(src_base)
    return dsts, srcs, np.full(len(dsts), size, dtype=np.uint64)


def run_pieces(stage_base: int, host_base: int, runs: list[tuple[int, int, int]],
               chunk_bytes: int, to_host: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptors copying whole runs ``(row, chunk, length)`` between ``length`` rows of the
    staging buffer at ``stage_base`` from ``row`` on and as many chunks of the host tier at
    ``host_base`` from ``chunk`` on (both chunk-major, chunks of ``chunk_bytes``)."""
    a = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    cb = np.uint64(chunk_bytes)
    stage = a[:, 0] * cb + np.uint64(stage_base)
    host = a[:, 1] * cb + np.uint64(host_base)
    sizes = a[:, 2] * cb
    return (host, stage, sizes) if to_host else (stage, host, sizes)
