"""A `pensieve serve` process for the tests (demo model, CPU, small tiers, free port): forked
from a template process that imported the server once (server_zygote.py), or started as
`python -m pensieve.cli serve` (a ``preexec`` given, or PENSIEVE_TEST_FORK_SERVERS=0)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


FORK_ENV = "PENSIEVE_TEST_FORK_SERVERS"
"""``0``: every test server is a ``python -m pensieve.cli serve`` of its own (as before
``server_zygote.py``), not a fork of the template process."""


def forks_servers() -> bool:
    """Whether test servers are forked from ``server_zygote.py`` (where ``os.fork`` exists
    and :data:`FORK_ENV` is not ``0``)."""
    return hasattr(os, "fork") and os.environ.get(FORK_ENV, "1") != "0"


class _Zygote:
    """This test process's ``server_zygote.py`` (started on first use, one per process: an
    xdist worker's servers come from its own), over a socket pair; it exits when this process
    does (its end of the pair closes)."""

    _lock = threading.Lock()
    _chan: socket.socket | None = None
    _reader: Any = None
    _owner = 0

    @classmethod
    def ask(cls, req: dict[str, Any]) -> dict[str, Any]:
        with cls._lock:
            if cls._chan is None or cls._owner != os.getpid():
                ours, theirs = socket.socketpair()
                log = open(run_cache() / f"zygote-{os.getpid()}.log", "w")  # noqa: SIM115
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("server_zygote.py")),
                     str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
                theirs.close()
                log.close()
                cls._chan, cls._reader, cls._owner = ours, ours.makefile("r"), os.getpid()
            cls._chan.sendall((json.dumps(req) + "\n").encode())
            line = cls._reader.readline()
            if not line:
                log_text = (run_cache() / f"zygote-{os.getpid()}.log").read_text()
                cls._chan = None
                raise RuntimeError(f"the server template process ended:\n{log_text}")
            return dict(json.loads(line))


class ForkedServer:
    """A ``pensieve serve`` forked from ``server_zygote.py``: the part of ``subprocess.Popen``
    the tests use (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``). Its
    parent is the template process, which reaps it and keeps its status for :meth:`poll`."""

    def __init__(self, argv: list[str], env: dict[str, str], log: str,
                 new_session: bool) -> None:
        self.args = argv
        self.returncode: int | None = None
        self.pid = int(_Zygote.ask({"op": "start", "argv": argv, "env": env, "log": log,
                                    "cwd": os.getcwd(), "new_session": new_session})["pid"])

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _Zygote.ask({"op": "status", "pid": self.pid})["rc"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


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
        argv = ["serve", model, "--port", str(self.port), "--store", str(store), "--device",
                "cpu", "--num-gpu-blocks", "96", "--num-cpu-blocks", "64", "--max-model-len",
                str(MAX_LEN), "--log-level", "warning",
                *(() if budget is None else ("--max-num-batched-tokens", str(budget))), *extra]
        self.proc: subprocess.Popen | ForkedServer
        if preexec is None and forks_servers():
            self.proc = ForkedServer(argv, env, self.log.name, new_session)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pensieve.cli", *argv], env=env, stdout=self.log,
                stderr=subprocess.STDOUT, start_new_session=new_session, preexec_fn=preexec)
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
