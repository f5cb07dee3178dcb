"""Launcher of the block-copy kernel (:mod:`pensieve.kernels.triton_swap`): argument checks,
word size, tile, persistent grid; and the view of pinned host memory a CUDA kernel uses.

Same semantics as :func:`pensieve.kernels.reference.swap_blocks_ref`; every check raises
:class:`ValueError`. No check synchronises with the device, so block ids are trusted.

Host memory. A kernel reaches the CPU tier through its device-mapped address: the tier is
page-locked with ``cudaHostRegister(..., cudaHostRegisterPortable | cudaHostRegisterMapped)``
(:func:`register_host`) and passed as a :class:`MappedHost` (the CPU tensor, for shapes and
strides, plus the address the device sees). With unified addressing (every 64-bit CUDA
platform) that address equals the host pointer; :func:`host_device_pointer` asks the driver
anyway. Triton takes any object with ``data_ptr()`` and ``dtype`` as a pointer argument and
its launcher accepts mapped host memory (``cuPointerGetAttribute`` knows it).

On the CPU (tests), with ``TRITON_INTERPRET=1`` set before :mod:`~pensieve.kernels.triton_swap`
is imported, the same kernel runs through Triton's interpreter over two plain CPU tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from pensieve.kernels import triton_swap as _k

DEFAULT_PROGRAMS = 32
"""Persistent grid size (programs, at most one per SM in practice) of one copy launch.
``benchmarks/swap_bandwidth.py --sweep`` measures the bandwidth per program count."""
DEFAULT_TILE_BYTES = 16384
"""Bytes each program moves per loop iteration (its loads in flight)."""
DEFAULT_NUM_WARPS = 4

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


class _Pointer:
    """A Triton pointer argument: an address as the device sees it and an element dtype."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._ptr


@dataclass(frozen=True)
class MappedHost:
    """Pinned host memory mapped into ``device``'s address space: ``tensor`` (a CPU tensor:
    shape, strides, dtype) and ``device_ptr``, the device address of ``tensor.data_ptr()``.
    ``m[a:b]`` slices dim 0 (layers) like the tensor; ``m.permute(...)`` reorders dims."""

    tensor: torch.Tensor
    device_ptr: int
    device: torch.device

    def __getitem__(self, index: slice) -> MappedHost:
        t = self.tensor[index]
        return MappedHost(t, self.device_ptr + (t.data_ptr() - self.tensor.data_ptr()),
                          self.device)

    def permute(self, *dims: int) -> MappedHost:
        """The same memory with its dims reordered (e.g. a chunk-major tier ``[blocks, L, 2,
        C, Hkv, D]`` seen as ``[L, 2, blocks, C, Hkv, D]`` by ``permute(1, 2, 0, 3, 4, 5)``;
        the kernel takes any strides above a block)."""
        return MappedHost(self.tensor.permute(*dims), self.device_ptr, self.device)


def register_host(t: torch.Tensor, device: torch.device) -> MappedHost:
    """Page-lock the CPU tensor ``t`` in place (exact size, unlike ``pin_memory=True``, whose
    caching allocator rounds every allocation up to a power of two), mapped into the device's
    address space; returns its :class:`MappedHost`. Undo with :func:`unregister_host`."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("register_host needs a contiguous CPU tensor")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    nbytes = t.numel() * t.element_size()
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    with torch.cuda.device(device):
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, flags))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister({nbytes / 2**30:.1f} GiB, mapped): error {err}")
        return MappedHost(t, host_device_pointer(t.data_ptr()), device)


def unregister_host(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:  # interpreter shutdown: the process releases the memory anyway
        pass


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def host_device_pointer(host_ptr: int) -> int:
    """Device address of registered, mapped host memory at ``host_ptr`` (the current device's
    context): ``cudaHostGetDevicePointer`` where torch exposes it, else the driver's
    ``cuMemHostGetDevicePointer``, else the host pointer itself (unified addressing)."""
    cudart = torch.cuda.cudart()
    get = getattr(cudart, "cudaHostGetDevicePointer", None)
    if get is not None:  # not exposed by torch up to 2.11 at least
        try:
            res = get(host_ptr, 0)
            if isinstance(res, tuple) and len(res) == 2 and int(res[0]) == 0:
                return int(res[1])
        except Exception:  # unknown binding signature: ask the driver
            pass
    lib = _libcuda()
    if lib is not None:
        dev = ctypes.c_uint64(0)
        fn = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        err = fn(ctypes.byref(dev), ctypes.c_void_p(host_ptr), ctypes.c_uint(0))
        if err == 0:
            return int(dev.value)
    return host_ptr


def _word_size(nbytes: list[int]) -> int:
    """Widest word (8, 4, 2, 1 bytes) that divides every size and address in ``nbytes``."""
    for w in (8, 4, 2, 1):
        if all(n % w == 0 for n in nbytes):
            return w
    return 1


def _shape_of(x: torch.Tensor | MappedHost) -> torch.Tensor:
    return x.tensor if isinstance(x, MappedHost) else x


def _check_tier(name: str, t: torch.Tensor) -> None:
    if t.dim() != 6 or t.shape[1] != 2:
        raise ValueError(f"{name} {tuple(t.shape)} is not [layers, 2, blocks, C, Hkv, D]")
    c, h, d = t.shape[3:]
    if t.numel() and (t.stride(5) != 1 or t.stride(4) != d or t.stride(3) != h * d):
        raise ValueError(f"{name}: a block must be contiguous, got strides {t.stride()}")


class BlockCopy:
    """A validated copy of whole blocks from one tier to another: ``copy(pairs)`` does
    ``dst[l, :, d] = src[l, :, s]`` for every row ``(s, d)`` of ``pairs``, every layer ``l`` of
    ``[start, stop)`` (default: all) and K and V, on the current stream.

    src, dst: ``[layers, 2, blocks, chunk_size, num_kv_heads, head_dim]`` of one dtype, same
    layers and block shape (block counts may differ), each block contiguous (any strides
    above it; a layer range ``t[a:b]`` is fine). On CUDA each is a CUDA tensor or a
    :class:`MappedHost` of that device; without CUDA both are CPU tensors (interpreter).
    Shapes, strides and the word size are checked once here; each call checks only
    ``pairs``: ``[n, 2]`` int64, contiguous, on the kernel's device, dst ids distinct within
    a call (else which source wins is undefined; ids are not checked against the tiers).
    ``num_programs`` (the persistent grid bound) may be changed between calls.
    """

    def __init__(
        self,
        src: torch.Tensor | MappedHost,
        dst: torch.Tensor | MappedHost,
        *,
        num_programs: int = DEFAULT_PROGRAMS,
        tile_bytes: int = DEFAULT_TILE_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
    ) -> None:
        s_t, d_t = _shape_of(src), _shape_of(dst)
        _check_tier("src", s_t)
        _check_tier("dst", d_t)
        if s_t.dtype != d_t.dtype:
            raise ValueError(f"src {s_t.dtype} and dst {d_t.dtype} differ in dtype")
        if s_t.shape[0] != d_t.shape[0] or s_t.shape[3:] != d_t.shape[3:]:
            raise ValueError(f"src {tuple(s_t.shape)} and dst {tuple(d_t.shape)}: layers or "
                             "block shape differ")
        if num_programs < 1 or tile_bytes < 1 or num_warps < 1:
            raise ValueError("num_programs, tile_bytes and num_warps must be >= 1")
        devices = {x.device for x in (src, dst) if isinstance(x, MappedHost) or x.is_cuda}
        if len(devices) > 1:
            raise ValueError(f"src and dst are on different devices {devices}")
        device = devices.pop() if devices else torch.device("cpu")
        if device.type == "cuda":
            for name, x in (("src", src), ("dst", dst)):
                if not isinstance(x, MappedHost) and x.device != device:
                    raise ValueError(f"{name} is a {x.device} tensor: pass host memory as "
                                     "MappedHost")
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("src and dst are CPU tensors: the kernel needs CUDA (one side may "
                             "be MappedHost), or TRITON_INTERPRET=1 set before "
                             "pensieve.kernels.triton_swap is imported")
        self.device = device
        self.num_layers = s_t.shape[0]
        self.num_programs = num_programs
        self.num_warps = num_warps
        esize = s_t.element_size()
        # the unit copied: one K or V block of one layer of the tensors given (the GPU cache,
        # the host tier, a staging buffer), for the word size; not the bytes per chunk
        row_bytes = math.prod(s_t.shape[3:]) * esize
        addrs = [x.device_ptr if isinstance(x, MappedHost) else x.data_ptr() for x in (src, dst)]
        w = _word_size([row_bytes, *addrs,
                        *(st * esize for t in (s_t, d_t) for st in t.stride()[:3])])
        self.word = _WORDS[w]
        self.word_bytes = w
        self.block_words = row_bytes // w
        self.tile_bytes = tile_bytes
        self._strides = [st * esize // w for t in (s_t, d_t) for st in t.stride()[:3]]
        self._addrs = addrs
        self._layer_bytes = [s_t.stride(0) * esize, d_t.stride(0) * esize]
        # the interpreter needs real tensors: the same bytes seen as words
        self._words = (None if device.type == "cuda"
                       else [t.flatten(3).view(self.word) for t in (s_t, d_t)])

    @property
    def tile_bytes(self) -> int:
        """Bytes each program moves per loop iteration (rounded to a power-of-two number of
        words, at most the next power of two above a block); may be changed between calls."""
        return self.tile * self.word_bytes

    @tile_bytes.setter
    def tile_bytes(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"tile_bytes {value} < 1")
        self.tile = min(triton.next_power_of_2(max(1, value // self.word_bytes)),
                        triton.next_power_of_2(max(1, self.block_words)))

    def __call__(self, pairs: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        stop = self.num_layers if stop is None else stop
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"layers [{start}, {stop}) not in [0, {self.num_layers}]")
        if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype != torch.int64:
            raise ValueError(f"pairs must be [n, 2] int64, got {tuple(pairs.shape)} "
                             f"{pairs.dtype}")
        if pairs.device != self.device:
            raise ValueError(f"pairs is on {pairs.device}, expected {self.device}")
        n = pairs.shape[0]
        if n == 0 or start == stop or self.block_words == 0:
            return
        if not pairs.is_contiguous():
            raise ValueError("pairs must be contiguous")
        layers = stop - start
        grid = (min(self.num_programs, n * layers * 2),)
        if self._words is None:
            ptrs: list[object] = [_Pointer(a + start * lb, self.word)
                                  for a, lb in zip(self._addrs, self._layer_bytes, strict=True)]
            guard: contextlib.AbstractContextManager[object] = torch.cuda.device(self.device)
        else:
            ptrs = [t[start:stop] for t in self._words]
            guard = contextlib.nullcontext()
        with guard:
            _k._swap_blocks_kernel[grid](
                ptrs[0], ptrs[1], pairs, n, layers, *self._strides,
                BLOCK_WORDS=self.block_words, TILE=self.tile, num_warps=self.num_warps,
            )


def swap_blocks_triton(
    src: torch.Tensor | MappedHost,
    dst: torch.Tensor | MappedHost,
    pairs: torch.Tensor,
    *,
    num_programs: int = DEFAULT_PROGRAMS,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> None:
    """``dst[:, :, d] = src[:, :, s]`` for every row ``(s, d)`` of ``pairs``: whole blocks of
    every layer, K and V, on the current stream (one-off :class:`BlockCopy`; see it for the
    arguments)."""
    BlockCopy(src, dst, num_programs=num_programs, tile_bytes=tile_bytes,
              num_warps=num_warps)(pairs)
