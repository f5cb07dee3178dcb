"""CPU decoding beside a CPU-bound process: per-token time of one greedy stream, and the
longest wait of that stream while a long prompt is prefilled, for servers started with
different settings, measured in alternation.

    python scripts/cpu_contention.py --rounds 3 --competitors 1 \\
        --config default= --config passive=OMP_WAIT_POLICY=PASSIVE \\
        --config old=PYTHONPATH=/path/to/old/src --out contention.json

Each ``--config NAME=VAR=VALUE,...`` is one ``pensieve serve`` (default model, CPU) with those
environment variables over this process's; all of them start first, then every round measures
each in turn (so load from elsewhere on the machine falls on all of them alike). While a
server is measured, ``--competitors`` processes spin on the CPU (a Python busy loop each);
``--competitors 0`` measures a quiet machine (as quiet as the host is). Per server and round:
ms per token of a ``--tokens``-token greedy stream after its first token, and the median
and p90 gap between its events, then (with
``--long-prompt N``) the longest gap of a stream while an N-token prompt is prefilled beside
it. Prints one JSON line per measurement and writes them all to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

BUSY_LOOP = "while True: pass"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(name: str, env: dict[str, str], workdir: Path, model: str | None,
                 extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    cmd = [sys.executable, "-m", "pensieve.cli", "serve", *([model] if model else []),
           "--port", str(port), "--device", "cpu", "--store", str(workdir / f"{name}.db"),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {(workdir / f'{name}.log').read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not start")


def stream_times(url: str, prompt: list[int], tokens: int, stop: threading.Event | None = None,
                 usage: dict[str, Any] | None = None, times: list[float] | None = None
                 ) -> list[float]:
    """Arrival times of the events of one greedy completion (until ``stop``, if given; an
    event may carry more than one token when the client reads late), appended to ``times``
    as they arrive; ``usage``: filled with the final usage."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    times = [] if times is None else times
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.monotonic())
                if stop is not None and stop.is_set():
                    break
            if event.get("usage") and usage is not None:
                usage.update(event["usage"])
    return times


def decode_rate(url: str, tokens: int) -> dict[str, float]:
    """ms per token of one stream after its first token (the prefill), and the median and p90
    gap between its events."""
    usage: dict[str, Any] = {}
    times = stream_times(url, [100 + i for i in range(16)], tokens, usage=usage)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    n = int(usage.get("completion_tokens", len(times)))
    return {"ms_per_token": round(1e3 * (times[-1] - times[0]) / max(1, n - 1), 1),
            "median_gap_ms": round(1e3 * statistics.median(gaps), 1),
            "p90_gap_ms": round(1e3 * gaps[int(0.9 * (len(gaps) - 1))], 1), "tokens": n}


def long_prompt_stall(url: str, prompt_len: int) -> dict[str, float]:
    """The longest wait of a running stream for its next token while a ``prompt_len``-token
    prompt is prefilled beside it."""
    stop = threading.Event()
    times: list[float] = []  # appended to as the events arrive

    def run() -> None:
        stream_times(url, [200] * 16, 2000, stop, times=times)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    while len(times) < 3:
        if not th.is_alive():
            raise RuntimeError("the stream beside the long prompt failed")
        time.sleep(0.05)
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", timeout=1200,
                   json={"prompt": [100 + i % 1000 for i in range(prompt_len)], "max_tokens": 1})
    end = time.monotonic()
    time.sleep(0.5)
    stop.set()
    th.join()
    r.raise_for_status()
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return {"prefill_s": round(end - start, 1), "longest_gap_s": round(max(gaps), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, metavar="NAME=VAR=VALUE,...",
                   help="a server to measure: its name and environment (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--competitors", type=int, default=1,
                   help="CPU-bound processes running while a server is measured")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the decode stream")
    p.add_argument("--long-prompt", type=int, default=0,
                   help="also measure the stall of a stream beside a prompt of this many tokens")
    p.add_argument("--model", default=None, help="the model (default: the server's default)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for pensieve serve (repeatable)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    configs: dict[str, dict[str, str]] = {}
    for spec in args.config:
        name, _, rest = spec.partition("=")
        configs[name] = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for name, env in configs.items():
                print(f"starting {name} {env}", file=sys.stderr, flush=True)
                servers[name] = start_server(name, env, Path(tmp), args.model, args.serve_arg)
            for rnd in range(args.rounds):
                for name, (_, url) in servers.items():
                    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
                            for _ in range(args.competitors)]
                    try:
                        time.sleep(1.0)
                        row: dict[str, Any] = {"config": name, "round": rnd,
                                               "competitors": args.competitors,
                                               **decode_rate(url, args.tokens)}
                        if args.long_prompt:
                            row.update(long_prompt_stall(url, args.long_prompt))
                    finally:
                        for b in busy:
                            b.kill()
                            b.wait()
                    print(json.dumps(row), flush=True)
                    results.append(row)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
