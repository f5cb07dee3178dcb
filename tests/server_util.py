"""A `pensieve serve` subprocess for the tests (demo model, CPU, small tiers, free port)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai

MAX_LEN = 512


def run_cache() -> Path:
    """The test run's cache directory (``$PENSIEVE_CACHE_DIR``, set by conftest.py to one
    temporary directory per run): the demo and default models are built there once per run,
    not once per server."""
    return Path(os.environ["PENSIEVE_CACHE_DIR"])


@contextlib.contextmanager
def run_cache_lock() -> Iterator[None]:
    """Held while a built-in model is made in the run's cache directory, so that xdist's
    workers make each one once (the second finds it made) instead of all at once."""
    with open(run_cache() / ".build-lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_demo() -> None:
    """The demo checkpoint in the run's cache directory, made once per run."""
    from pensieve.models.demo import ensure_demo_checkpoint

    with run_cache_lock():
        ensure_demo_checkpoint()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, store: Path, cache_dir: Path, *extra: str, model: str = "demo",
                 new_session: bool = False, budget: int | None = 256,
                 env: dict[str, str] | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        """``budget``: ``--max-num-batched-tokens`` (None: the server's default); ``env``: more
        environment variables for the server (e.g. ``PENSIEVE_STEP_LOG``); ``preexec``: run
        in the server's process before it starts (e.g. a resource limit)."""
        if model == "demo" and Path(cache_dir) == run_cache():
            ensure_demo()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PENSIEVE_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1",
               **(env or {})}
        self.log = open(store.with_suffix(f".{self.port}.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pensieve.cli", "serve", model, "--port", str(self.port),
             "--store", str(store), "--device", "cpu", "--num-gpu-blocks", "96",
             "--num-cpu-blocks", "64", "--max-model-len", str(MAX_LEN),
             "--log-level", "warning",
             *(() if budget is None else ("--max-num-batched-tokens", str(budget))), *extra],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=new_session,
            preexec_fn=preexec)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError("server did not start")

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def metric(self, name: str, key: str | None = None) -> float:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        text = httpx.get(self.url + "/metrics", headers=headers).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    def wait_idle(self) -> None:
        deadline = time.monotonic() + 30
        while self.metric("pensieve_requests_running") or self.metric("pensieve_requests_waiting"):
            assert time.monotonic() < deadline, "requests still in flight"
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)
        self.log.close()
