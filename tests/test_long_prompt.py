"""A long prompt on the CPU does not stall the other streams (`pensieve serve`, default model).

Three greedy streams decode while a 4,096-token prompt arrives. At the CPU's default step
budget the prompt is prefilled in chunks that share their steps with the streams' decodes, so
no stream waits for more than one chunk's step for its next token. Under one 4k-token step
each stream would wait for the whole prefill (~20 s on a 2-core machine). Checked in steps,
from the server's step log (``PENSIEVE_STEP_LOG``), not in seconds: every step that prefills
part of the prompt also decodes a token of each stream, and no step prefills more than the
budget. The longest wait in seconds is printed for information (it depends on the machine's
load).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_util import Server

from pensieve.core.scheduling_config import STEP_TOKEN_BUDGETS
from pensieve.models.builtin import DEFAULT_MODEL

LONG_PROMPT = 4096
CPU_STEP_BUDGET = STEP_TOKEN_BUDGETS["cpu"]
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_cache: Path) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("long")
    srv = Server(d / "conv.db", smollm2_cache, "--max-model-len", "8192",
                 "--num-gpu-blocks", "320", model=DEFAULT_MODEL, budget=None,
                 env={"PENSIEVE_STEP_LOG": str(d / "steps.jsonl")})
    srv.step_log = d / "steps.jsonl"  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def _stream(url: str, prompt: list[int], times: list[float], stop: threading.Event) -> None:
    """Stream a greedy completion, appending each token's arrival time, until ``stop``."""
    body = {"prompt": prompt, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"]:
                times.append(time.monotonic())
                if stop.is_set():
                    return


def _longest_gap(times: list[float], start: float, end: float) -> float:
    """Longest wait between tokens among those that overlap ``[start, end]``."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b >= start and a <= end]
    return max(gaps)


def test_streams_keep_flowing_during_a_long_prefill(server: Server) -> None:
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(server.url, [200 + i] * 16, t, stop))
               for i, t in enumerate(times)]
    for th in threads:
        th.start()
    while min(len(t) for t in times) < 3:  # every stream decoding
        assert all(th.is_alive() for th in threads)
        time.sleep(0.05)
    try:
        start = time.monotonic()
        r = httpx.post(server.url + COMPLETIONS, timeout=600,
                       json={"prompt": [100] * LONG_PROMPT, "max_tokens": 1})
        end = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == LONG_PROMPT
    for t in times:
        assert t[-1] > end, "a stream ended before the long prompt was done"
        during = sum(start <= x <= end for x in t)
        assert during >= LONG_PROMPT // 512, f"{during} tokens during the prefill"
        print(f"longest wait for a token during the prefill: "
              f"{_longest_gap(t, start, end):.2f} s (prefill {end - start:.1f} s)")
    steps = [json.loads(line) for line in server.step_log.read_text().splitlines()]
    prefill = [s for s in steps if s["prefill_tokens"] > 0]
    assert sum(s["prefill_tokens"] for s in prefill) >= LONG_PROMPT
    budget = max(s["prefill_tokens"] + s["decode_tokens"] for s in steps)
    assert budget <= CPU_STEP_BUDGET, budget
    # the prompt's chunks: every one shares its step with the three streams' decodes
    long_steps = [s for s in prefill if s["prefill_tokens"] >= 64]
    assert len(long_steps) >= LONG_PROMPT // CPU_STEP_BUDGET
    assert all(s["decode_tokens"] == 3 for s in long_steps), \
        [(s["prefill_tokens"], s["decode_tokens"]) for s in long_steps]
