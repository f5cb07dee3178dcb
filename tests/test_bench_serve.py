"""``pensieve bench serve`` against a minimal stand-in OpenAI server (only /v1/models and a
streaming /v1/chat/completions: no conversation endpoints, no /metrics) and against
``pensieve serve``: the JSON result has vLLM ``bench serve`` field names, its counts agree with
what the server received, and every turn re-sends the whole history."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pensieve.bench.loadgen import LoadResult, RequestRecord
from pensieve.bench.serve_metrics import vllm_metrics
from pensieve.cli import main as pensieve_main

VLLM_FIELDS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput",
               *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                 for s in ("mean", "median", "std", "p99"))]


class StandIn:
    """A tiny OpenAI-compatible chat server: each answer is ``max_tokens`` one-word chunks
    (``w0 w1 ...``), then a finish chunk and a usage chunk; it records every request body."""

    def __init__(self) -> None:
        app = FastAPI()
        self.bodies: list[dict[str, Any]] = []

        @app.get("/health")
        def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> StreamingResponse:
            body = await request.json()
            self.bodies.append(body)
            n = int(body["max_tokens"])
            prompt = sum(len(m["content"].split()) for m in body["messages"])

            async def events() -> AsyncIterator[str]:
                def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
                    c = {"id": "x", "object": "chat.completion.chunk", "model": "stand-in",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                    return f"data: {json.dumps(c)}\n\n"

                yield chunk({"role": "assistant", "content": ""})
                for i in range(n):
                    yield chunk({"content": f" w{i}" if i else f"w{i}"})
                yield chunk({}, "length")
                usage = {"prompt_tokens": prompt, "completion_tokens": n,
                         "total_tokens": prompt + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "stand-in server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def stand_in() -> Iterator[StandIn]:
    s = StandIn()
    yield s
    s.stop()


def run_bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert pensieve_main(["bench", "serve", "--no-progress", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def check_histories(bodies: list[dict[str, Any]]) -> int:
    """Every turn's messages are a first user message, or an earlier turn's messages plus the
    exact answer it got plus one user message; returns how many later turns there were."""
    answered: dict[tuple[str, ...], str] = {}
    later = 0
    for b in bodies:
        msgs = tuple(m["content"] for m in b["messages"])
        roles = [m["role"] for m in b["messages"]]
        assert roles == ["user", "assistant"] * (len(msgs) // 2) + ["user"]
        if len(msgs) > 1:
            later += 1
            assert answered.get(msgs[:-2]) == msgs[-2]
        answered[msgs] = " ".join(f"w{i}" for i in range(b["max_tokens"]))
    return later


@pytest.mark.parametrize("workload", ["agentic", "ultrachat", "sharegpt"])
def test_bench_serve_against_a_plain_openai_server(stand_in: StandIn, workload: str,
                                                   capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Any) -> None:
    stand_in.bodies.clear()
    out = run_bench(capsys, "--url", stand_in.url, "--workload", workload, "--rate", "4",
                    "--duration", "2", "--drain", "60", "--think-time", "0.05",
                    "--num-conversations", "6", "--length-scale", "0.1", "--no-calibrate",
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == out
    for k in VLLM_FIELDS:
        assert k in out, k
    bodies = stand_in.bodies
    assert out["requests_sent"] == len(bodies) > 0
    assert out["failed"] == 0 and out["http_errors"] == 0 and out["unfinished"] == 0
    assert out["completed"] == out["num_prompts"] <= len(bodies)
    assert out["duration"] == 2.0
    assert out["request_throughput"] == pytest.approx(out["completed"] / 2.0)
    # answers are exactly max_tokens long; the window's turns are the first ones sent
    window = bodies[: out["completed"]]
    assert out["total_output_tokens"] == sum(b["max_tokens"] for b in window)
    assert out["output_throughput"] == pytest.approx(out["total_output_tokens"] / 2.0)
    assert out["model_id"] == "stand-in" and all(b["model"] == "stand-in" for b in bodies)
    assert all(b["stream"] and b["ignore_eos"] for b in bodies)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < out[f"median_{m}_ms"] <= out[f"p99_{m}_ms"], m
    assert out["mean_ttft_ms"] < out["mean_e2el_ms"]
    assert check_histories(bodies) > 0


def test_vllm_metrics_by_hand() -> None:
    """Three turns, one failed, one sent after the window: the fields by hand."""
    recs = [RequestRecord("c0", 0, "a", 0.0, 10, 3, context_len=10, first_token=0.1,
                          finished=0.5, output_tokens=3),
            RequestRecord("c1", 0, "b", 1.0, 20, 5, context_len=20, first_token=1.3,
                          finished=2.1, output_tokens=5),
            RequestRecord("c2", 0, "c", 1.5, 20, 5, error=True),
            RequestRecord("c0", 1, "d", 4.5, 20, 5, context_len=30, first_token=4.6,
                          finished=4.9, output_tokens=5)]
    res = LoadResult(recs, duration_s=4.0, end_s=5.0, unfinished=0)
    times = {"a": [0.1, 0.3, 0.5], "b": [1.3, 1.5, 1.7, 1.9, 2.1]}
    m = vllm_metrics(res, 0.0, times)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 8)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(2.0)
    assert m["total_token_throughput"] == pytest.approx(38 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)  # 100 and 300 ms
    assert m["median_e2el_ms"] == pytest.approx(800.0)  # 500 and 1100 ms
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # 400/2 and 800/4 ms
    assert m["p99_itl_ms"] == pytest.approx(200.0) and m["std_itl_ms"] == pytest.approx(0.0)
    assert vllm_metrics(res, 0.0)["mean_itl_ms"] is None  # no chunk times: no ITL


@pytest.mark.slow
def test_bench_serve_against_pensieve_serve(pensieve_server: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    server = pensieve_server("--max-model-len", "2048")
    for workload in ("agentic", "sharegpt"):
        out = run_bench(capsys, "--url", server.url, "--workload", workload, "--rate", "1",
                        "--duration", "3", "--drain", "120", "--think-time", "0.1",
                        "--num-conversations", "3", "--length-scale", "0.05")
        for k in VLLM_FIELDS:
            assert k in out, k
        assert out["failed"] == out["http_errors"] == out["unfinished"] == 0
        assert out["completed"] == out["num_prompts"] > 0
        assert out["http_history_misses"] == 0  # the server recognised every history
        if workload == "agentic":  # (seed 0: a later turn lands in the window) its KV is kept
            assert out["pensieve"]["gpu_hit_tokens"] + out["pensieve"]["cpu_hit_tokens"] > 0
        assert out["mean_ttft_ms"] > 0 and out["p99_itl_ms"] >= out["median_itl_ms"] > 0
