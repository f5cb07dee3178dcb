"""A profiler trace of a window of a server's engine steps (``PENSIEVE_PROFILE_STEPS``).

``PENSIEVE_PROFILE_STEPS=START:COUNT:PATH`` in a server's environment records steps
``START`` to ``START + COUNT - 1`` (counted from 0 since the engine started) with
``torch.profiler`` (the host's calls and, on CUDA, every kernel, copy and stream wait) and
writes them as a Chrome trace to ``PATH`` (``{pid}`` in it becomes the process id), once the
window ends, or with the steps it has when the server stops inside it. What it is for: the
timeline of steps under a real serving load (which copies run beside which compute, how long
a step's host work leaves the device idle), where the benchmarks' steps are built by hand.
Profiling slows the steps it records; the others run as usual.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("pensieve.server")

ENV = "PENSIEVE_PROFILE_STEPS"


class StepProfile:
    """Starts the profiler before step ``start`` and writes the trace after ``count`` steps."""

    def __init__(self, start: int, count: int, path: str) -> None:
        if start < 0 or count < 1:
            raise ValueError(f"{ENV}: START >= 0 and COUNT >= 1, got {start} and {count}")
        self.start, self.count = start, count
        self.path = path.replace("{pid}", str(os.getpid()))
        self.steps = 0
        """Steps seen so far."""
        self._prof: Any = None
        self.done = False
        """Whether the trace has been written."""

    @classmethod
    def from_env(cls) -> StepProfile | None:
        """The profile ``PENSIEVE_PROFILE_STEPS`` asks for; None when it is unset, or (with a
        warning: the server serves anyway) malformed."""
        spec = os.environ.get(ENV)
        if not spec:
            return None
        try:
            start, count, path = spec.split(":", 2)
            if not path:
                raise ValueError(f"{ENV}: no PATH")
            return cls(int(start), int(count), path)
        except ValueError as e:
            log.warning("%s=%r is not START:COUNT:PATH (%s): no profile", ENV, spec, e)
            return None

    def before_step(self) -> None:
        if self.done or self._prof is not None or self.steps != self.start:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        log.info("profiling engine steps %d-%d", self.start, self.start + self.count - 1)

    def after_step(self) -> None:
        self.steps += 1
        if self._prof is None or self.steps < self.start + self.count:
            return
        self._write()

    def close(self) -> None:
        """The server stops: a window still open is written with the steps it has."""
        if self._prof is not None:
            self._write()

    def _write(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        last = self.steps - 1
        try:
            prof.export_chrome_trace(self.path)
            log.info("wrote the profile of steps %d-%d to %s", self.start, last, self.path)
        except OSError as e:  # serve anyway
            log.warning("%s: cannot write %s (%s)", ENV, self.path, e)
        self.done = True
