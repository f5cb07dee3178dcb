"""A template process for the tests' ``pensieve serve`` processes (``server_util.Server``).

Most of a demo server's start is imports: ``python -m pensieve.cli serve`` took 4.3-4.6 s of
CPU to its first ``/health`` on the test machine, ~4 s of it importing torch, transformers,
xgrammar, FastAPI and the engine. This process imports them once (after ``pensieve.cli``'s
thread settings, as ``main`` sets them before torch loads), then forks one child per server
the test process asks for; the child takes the request's environment, working directory,
session and log file and runs ``pensieve.cli`` as ``__main__`` (``runpy``, as ``python -m``
does) with the request's arguments. The server is then the process ``python -m pensieve.cli``
would be, less the imports: it settles its config, forks (or spawns) its engine process,
handles its signals and exits with its status as before.

The test process talks to it over a socket pair, one JSON line each way per request:
``{"op": "start", ...}`` answers the child's pid, ``{"op": "status", "pid": N}`` its exit
status once it has ended (None before; this process reaps its children on SIGCHLD). It exits
when the test process closes its end. It must stay single-threaded: a forked server forks its
CPU engine only from a process with no other thread (``pensieve.server.main._forks_engine``).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import threading


def _warm() -> None:
    """Import what ``pensieve serve`` imports before it settles its config and builds the
    app (nothing is run: no thread is started, no torch op runs)."""
    from pensieve.threads import set_thread_env

    set_thread_env()  # before torch loads, as pensieve.cli.main does
    import pensieve.cli  # noqa: F401
    import pensieve.engine.llm  # noqa: F401
    import pensieve.server.app  # noqa: F401
    import pensieve.server.main  # noqa: F401
    import pensieve.server.shutdown  # noqa: F401
    import pensieve.server.store_check  # noqa: F401


_status: dict[int, int] = {}


def _reap(signum: int, frame: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _status[pid] = os.waitstatus_to_exitcode(status)


def _serve(chan: socket.socket) -> dict | None:
    """Answer requests until the test process closes its end (None) or, in a forked child,
    return the request that child is to run."""
    reader = chan.makefile("r", encoding="utf-8")
    for line in reader:
        req = json.loads(line)
        if req["op"] == "status":
            reply: dict = {"rc": _status.pop(req["pid"], None)}
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                reader.close()
                chan.close()
                return req
            reply = {"pid": pid}
        chan.sendall((json.dumps(reply) + "\n").encode())
    return None


def _become(req: dict) -> None:
    """In the forked child: the process ``subprocess.Popen`` would have started."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if req["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = req["cwd"]  # as python -m puts the working directory first
    sys.argv = ["pensieve.cli", *req["argv"]]


def main() -> None:
    chan = socket.socket(fileno=int(sys.argv[1]))
    _warm()
    assert threading.active_count() == 1, threading.enumerate()
    signal.signal(signal.SIGCHLD, _reap)
    req = _serve(chan)
    if req is None:
        return
    _become(req)
    # python -m pensieve.cli: its module runs as __main__ only (sys.exit(main()), then this
    # process's interpreter exit), so the copy imported above leaves sys.modules
    del sys.modules["pensieve.cli"]
    runpy.run_module("pensieve.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
