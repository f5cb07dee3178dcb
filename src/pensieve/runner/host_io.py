"""The compute stream's own host transfers: a step's inputs up, its sampled tokens back.

Two ways (``PENSIEVE_HOST_IO``, read once):

- ``mapped``: the host writes the inputs into page-locked, device-mapped host arrays and a
  kernel (:func:`~pensieve.kernels.launch_swap.copy_words`) reads them into device arrays; a
  kernel writes the sampled tokens into a mapped host array and the host waits for an event
  recorded after it. The compute stream then never uses a copy engine, so none of its work
  queues behind the swap copies there;
- ``copy`` (the default, and the CPU's way): pinned uploads (``Tensor.to(device,
  non_blocking=True)``) and ``.tolist()``: copies on the compute stream, so on the GPU's copy
  engines, where they wait for the swapper's copies queued before them. On the H200
  (``benchmarks/step_copies_behind_swaps.py``, ``docs/results/step_copies_57306fd/``) a step
  beside 256 chunks of background swap-outs had its tokens on the host at 32.3 ms against 4.6
  mapped (its compute ended at 6.8 ms), and a step's uploads waited for all of its swap-ins,
  so its layer 0 could not start before the last swap-in (layer pipelining lost). Serving
  ShareGPT at 1.45 sessions/s over HTTP with ``mapped``
  (``docs/results/churn/sharegpt_40_60_mapped_pensieve_1.45/``), decode steps were unchanged
  (22.1 against 22.2 ms) and steps with prefill took longer (73.0 against 53.2 ms, their host
  issue 32.4 against 12.7 ms), for reasons not found. The runner now uploads a step's inputs
  before it issues the step's swaps, so with ``copy`` they no longer queue behind them: a
  ShareGPT-like eager step with 64-256 swap-ins then took 33.0-37.6 ms with copies and
  32.2-36.8 ms mapped, against 36.7-60.0 ms with the uploads after the swaps
  (``benchmarks/step_swap_ins.py``, ``docs/results/step_swap_ins_9e5770c/``). ``copy`` stays
  the default.

A mapped host array is rewritten only by the next step's inputs, after the step's tokens have
been read back, which waits for the compute stream: no kernel still reads it.
"""

from __future__ import annotations

import os
import weakref

import torch

HOST_IO_MODES = ("copy", "mapped")


def host_io_mode() -> str:
    """``PENSIEVE_HOST_IO``: ``copy`` (default) or ``mapped`` (CUDA only; the CPU always
    copies); anything else is an error."""
    mode = os.environ.get("PENSIEVE_HOST_IO", "copy")
    if mode not in HOST_IO_MODES:
        raise ValueError(f"PENSIEVE_HOST_IO={mode!r}: expected one of {HOST_IO_MODES}")
    return mode


class MappedArray:
    """A flat page-locked, device-mapped host array of ``dtype`` and (``mirror``) its device
    mirror: write ``host`` (or ``np``, its numpy view) and call :meth:`upload`; grows on
    demand. On the CPU (tests, with Triton's interpreter) the host array itself stands for the
    mapped one."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device,
                 mirror: bool = True) -> None:
        self.dtype, self.device, self._mirror = dtype, device, mirror
        self._alloc(max(n, 1))

    def _alloc(self, n: int) -> None:
        from pensieve.kernels.launch_swap import register_host, unregister_host

        release = getattr(self, "_release", None)
        self.host = torch.zeros(n, dtype=self.dtype)
        self.np = self.host.numpy()
        cuda = self.device.type == "cuda"
        self.mapped = register_host(self.host, self.device) if cuda else self.host
        # unregistered when this array is collected, or replaced (below): a registration left
        # behind would make a later cudaHostRegister of reused memory fail
        self._release = weakref.finalize(self, unregister_host, self.host) if cuda else None
        self.dev = torch.zeros(n if self._mirror else 0, dtype=self.dtype, device=self.device)
        if release is not None:  # the last step's kernels are done (its read-back waited)
            release()

    def reserve(self, n: int) -> None:
        """Room for ``n`` elements (a grown array forgets its contents)."""
        if n > self.host.numel():
            self._alloc(max(n, 2 * self.host.numel()))

    def upload(self, n: int) -> torch.Tensor:
        """The first ``n`` host elements onto the device (a kernel on the current stream)."""
        from pensieve.kernels.launch_swap import copy_words

        copy_words(self.mapped, self.dev, n)
        return self.dev[:n]


class StepUploads:
    """A step's input arrays, packed into one :class:`MappedArray` per dtype and uploaded
    with one kernel each."""

    def __init__(self, device: torch.device) -> None:
        self._arrays = {dt: MappedArray(1 << 16, dt, device) for dt in (torch.int64, torch.int32)}

    def upload(self, arrays: list[tuple[list[int], torch.dtype]]) -> list[torch.Tensor]:
        """``arrays`` (values, dtype) onto the device: their device tensors in that order
        (views into the mirrors, valid until the next call)."""
        spans = []
        sizes = dict.fromkeys(self._arrays, 0)
        for values, dt in arrays:
            spans.append((dt, sizes[dt], len(values)))
            sizes[dt] += len(values)
        for dt, n in sizes.items():
            self._arrays[dt].reserve(n)
        for (values, _), (dt, off, n) in zip(arrays, spans, strict=True):
            self._arrays[dt].np[off:off + n] = values
        dev = {dt: self._arrays[dt].upload(n) for dt, n in sizes.items() if n}
        return [dev[dt][off:off + n] for dt, off, n in spans]


class MappedReadback:
    """Reads a small 1-D int64 device tensor back to the host through a mapped host array
    (a kernel writes it; the host waits for an event after the kernel)."""

    def __init__(self, device: torch.device, n: int = 4096) -> None:
        self.device = device
        self._array = MappedArray(n, torch.int64, device, mirror=False)
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def read(self, t: torch.Tensor) -> list[int]:
        from pensieve.kernels.launch_swap import copy_words

        n = t.numel()
        self._array.reserve(n)
        copy_words(t.reshape(-1).to(torch.int64).contiguous(), self._array.mapped, n)
        if self._event is not None:
            self._event.record()
            self._event.synchronize()
        return self._array.host[:n].tolist()
