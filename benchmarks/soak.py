"""Memory under a long steady load: the resident set of ``pensieve serve`` and its engine
process, sampled while short conversations run against it.

    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid SERVER_PID --minutes 30 \
        [--clients 4] [--turns 3] [--max-tokens 16] [--out soak.json] [--plot soak.png]

``--clients`` threads each run conversations of ``--turns`` turns one after another (an
OpenAI client re-sending the history, greedy, ``--max-tokens`` a turn), each with a new
opening message, so conversations keep arriving and older ones age out of the tiers. Every
``--every`` seconds the RSS of ``--pid`` and of its child processes (the engine) is sampled
with the server's ``/metrics`` KV blocks in use. Reported: the RSS curve, and the growth
from the first sample after the tiers filled (``pensieve_blocks_used`` at its maximum) to
the end, against the first such sample.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from typing import Any


def _rss(pid: int) -> tuple[int, int]:
    import psutil

    p = psutil.Process(pid)
    kids = sum(c.memory_info().rss for c in p.children(recursive=True))
    return p.memory_info().rss, kids


def _blocks(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r'^pensieve_blocks_used\{tier="(\w+)"\}\s+([0-9.e+]+)', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def _client(url: str, model: str, turns: int, max_tokens: int, stop: threading.Event,
            counts: dict[str, int], seed: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
    n = 0
    while not stop.is_set():
        msgs: list[dict[str, str]] = [
            {"role": "user", "content": f"Conversation {seed}-{n}: tell me about topic {n}."}]
        for t in range(turns):
            if stop.is_set():
                break
            try:
                r = client.chat.completions.create(model=model, messages=msgs, temperature=0,
                                                   max_tokens=max_tokens)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": f"And then? ({t})"}]
                counts["turns"] += 1
            except Exception:  # noqa: BLE001 - counted; the soak goes on
                counts["errors"] += 1
                break
        n += 1


def run(url: str, pid: int, minutes: float, clients: int, turns: int, max_tokens: int,
        every: float, model: str) -> dict[str, Any]:
    from tqdm import tqdm

    stop = threading.Event()
    counts = {"turns": 0, "errors": 0}
    threads = [threading.Thread(target=_client, daemon=True,
                                args=(url, model, turns, max_tokens, stop, counts, i))
               for i in range(clients)]
    for t in threads:
        t.start()
    samples = []
    t0 = time.monotonic()
    end = t0 + minutes * 60
    with tqdm(total=int(minutes * 60), desc="soak", unit="s") as bar:
        while time.monotonic() < end:
            server, engine = _rss(pid)
            samples.append({"t": time.monotonic() - t0, "server_rss": server,
                            "engine_rss": engine, "blocks": _blocks(url), **counts})
            time.sleep(every)
            bar.n = int(time.monotonic() - t0)
            bar.refresh()
    stop.set()
    for t in threads:
        t.join(timeout=150)
    total = [s["server_rss"] + s["engine_rss"] for s in samples]
    full = max(sum(s["blocks"].values()) for s in samples)
    first_full = next(i for i, s in enumerate(samples) if sum(s["blocks"].values()) >= full)
    return {"samples": samples, "turns": counts["turns"], "errors": counts["errors"],
            "tiers_full_at_s": samples[first_full]["t"],
            "rss_at_full_mb": total[first_full] / 2**20, "rss_end_mb": total[-1] / 2**20,
            "rss_max_after_full_mb": max(total[first_full:]) / 2**20,
            "growth_after_full": total[-1] / total[first_full] - 1}


def _plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["samples"]
    t = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot(t, [x["server_rss"] / 2**20 for x in s], label="server process")
    ax.plot(t, [x["engine_rss"] / 2**20 for x in s], label="engine process")
    ax.axvline(res["tiers_full_at_s"] / 60, color="gray", ls="--", label="tiers full")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax2 = ax.twinx()
    ax2.plot(t, [sum(x["blocks"].values()) for x in s], color="C2", lw=0.8, alpha=0.6)
    ax2.set_ylabel("KV blocks used (all tiers)", color="C2")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/soak.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, required=True, help="the pensieve serve process")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--every", type=float, default=10.0)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    res = run(a.url, a.pid, a.minutes, a.clients, a.turns, a.max_tokens, a.every, a.model)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f)
    if a.plot:
        _plot(res, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
