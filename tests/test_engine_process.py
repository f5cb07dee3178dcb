"""``pensieve serve --engine-process``: the engine in a child process gives the same answers,
conversation state and errors as the engine in a thread, and a dead engine process fails
requests cleanly (a 500, /health 503) without touching stored conversations."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from test_logprobs import chat_llama  # noqa: F401 - the fixture

from pensieve.server.engine_loop import EngineStartError

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


def _server(path: str, store: str, *extra: str) -> tuple[Any, Any]:
    from pensieve.server.main import add_serve_args, build_server

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args([path, "--device", "cpu", "--dtype", "float32", "--store", store,
                         "--num-gpu-blocks", "64", "--num-cpu-blocks", "32",
                         "--max-model-len", "256", "--chunk-size", "8", "--served-model-name", "m",
                         *extra])
    return build_server(args)


@pytest.fixture(scope="module")
def both(chat_llama: Any, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
         ) -> Iterator[dict[str, tuple[TestClient, openai.OpenAI]]]:
    out: dict[str, tuple[TestClient, openai.OpenAI]] = {}
    closers = []
    try:
        for name, extra in (("thread", ()), ("process", ("--engine-process",))):
            store = tmp_path_factory.mktemp(name) / "conv.db"
            app, close = _server(chat_llama[0], str(store), *extra)
            closers.append(close)
            http = TestClient(app)
            http.__enter__()
            out[name] = (http, openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                                             http_client=http, max_retries=0))
        yield out
    finally:
        for http, _ in out.values():
            http.__exit__(None, None, None)
        for close in closers:
            close()


def _chat(client: openai.OpenAI, turns: list[str], stream: bool = False
          ) -> tuple[list[str], list[Any]]:
    """A conversation re-sent whole each turn; (answers, usages)."""
    msgs: list[dict[str, str]] = []
    answers, usages = [], []
    for text in turns:
        msgs.append({"role": "user", "content": text})
        if stream:
            chunks = list(client.chat.completions.create(
                model="m", messages=msgs, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True}, **GREEDY))
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usages.append(chunks[-1].usage)
        else:
            r = client.chat.completions.create(model="m", messages=msgs,  # type: ignore
                                               **GREEDY)
            answer = r.choices[0].message.content or ""
            usages.append(r.usage)
        answers.append(answer)
        msgs.append({"role": "assistant", "content": answer})
    return answers, usages


def test_engine_process_answers_as_the_thread_does(both: Any) -> None:
    turns = ["Tell me about memory palaces.", "And about tiers?", "Once more, shorter."]
    got = {name: _chat(client, turns) for name, (_, client) in both.items()}
    assert got["process"][0] == got["thread"][0]
    for a, b in zip(got["process"][1], got["thread"][1]):
        assert a.prompt_tokens == b.prompt_tokens and a.completion_tokens == b.completion_tokens
    # streamed, the same conversation continued from its re-sent history
    s = {name: _chat(client, ["Stream this.", "And this."], stream=True)[0]
         for name, (_, client) in both.items()}
    assert s["process"] == s["thread"] and all(s["process"])


def test_engine_process_calls_and_errors(both: Any) -> None:
    """Stop strings (a call that ends the turn on the engine), conversation deletion (a call
    that may raise) and the conversation store behave as with the engine in a thread."""
    results = {}
    for name, (http, client) in both.items():
        first = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Count for me."}], **GREEDY)
        text = first.choices[0].message.content or ""
        stop = text[2:4] if len(text) >= 4 else None
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Count for me."}],
            stop=stop, **GREEDY)
        cid = (r.model_extra or {}).get("conversation_id")
        assert cid
        conv = http.get(f"/v1/conversations/{cid}").json()
        deleted = http.delete(f"/v1/conversations/{cid}")
        missing = http.get(f"/v1/conversations/{cid}")
        results[name] = (r.choices[0].message.content, r.choices[0].finish_reason,
                         len(conv["token_ids"]), deleted.status_code, missing.status_code)
    assert results["process"] == results["thread"]
    assert results["process"][3:] == (200, 404)


def test_engine_process_death_fails_requests_cleanly(chat_llama: Any,  # noqa: F811
                                                     tmp_path: Any) -> None:
    app, close = _server(chat_llama[0], str(tmp_path / "conv.db"), "--engine-process")
    try:
        with TestClient(app) as http:
            client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k",
                                   http_client=http, max_retries=0)
            msgs = [{"role": "user", "content": "Remember this."}]
            r = client.chat.completions.create(model="m", messages=msgs, **GREEDY)
            cid = (r.model_extra or {}).get("conversation_id")
            before = http.get(f"/v1/conversations/{cid}").json()
            assert http.get("/health").status_code == 200
            eng = app.state.pensieve.engine
            eng._proc.kill()
            eng._proc.join(timeout=30)
            eng._reader.join(timeout=30)
            assert not eng.alive
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_down"
            msgs2 = msgs + [{"role": "assistant", "content": r.choices[0].message.content or ""},
                            {"role": "user", "content": "Still there?"}]
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model="m", messages=msgs2, **GREEDY)
            assert "engine" in str(e.value)
            assert http.get(f"/v1/conversations/{cid}").json() == before
    finally:
        close()


def test_engine_process_start_failure_is_an_error(tmp_path: Any) -> None:
    """An engine that cannot be built raises in the server (not a hang): a checkpoint
    directory whose weights are missing."""
    import json

    from pensieve.engine.llm import build_engine_config
    from pensieve.server.engine_process import ProcessEngine

    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}))
    cfg = build_engine_config(model=str(bad), device="cpu", num_gpu_blocks=8)
    with pytest.raises(EngineStartError, match="failed to start"):
        ProcessEngine(cfg)


class _BusyCore:
    """An engine loop with work left: every step has an update to report."""

    busy = True
    compiling: dict[int, object] = {}
    """No grammar compiles in flight (``EngineLoop.compiling``)."""

    def __init__(self) -> None:
        self.steps = 0

    def reply_compiled(self) -> None:
        pass

    def step(self) -> None:
        self.steps += 1

    def take(self) -> list[str]:
        return [f"update {self.steps}"]

    def snapshot(self) -> dict[str, int]:
        return {"steps": self.steps}


def test_engine_process_stops_quietly_when_the_server_is_gone(
        caplog: pytest.LogCaptureFixture) -> None:
    """A server killed under load (its end of the pipe closed, steps still to report): the
    engine process's loop returns with a warning instead of dying on a ``BrokenPipeError``
    traceback."""
    import multiprocessing as mp

    from pensieve.server.engine_process import _serve

    cmd_r, cmd_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    core = _BusyCore()
    out_r.close()  # the server is gone
    with caplog.at_level("WARNING", logger="pensieve.server"):
        _serve(core, cmd_r, out_w)  # type: ignore[arg-type]
    assert core.steps == 1  # it stepped, failed to report and returned
    assert "the server closed its pipe" in caplog.text
    cmd_w.close()


def test_device_auto_forks_the_engine_on_a_torch_built_without_a_gpu(tmp_path: Any) -> None:
    """``--device auto`` (the default) on a CPU-only torch forks the engine process as
    ``--device cpu`` does; on a CUDA or ROCm build it is spawned (CUDA is not asked before)."""
    import threading

    import torch

    from pensieve.server import main as server_main

    built = torch.backends.cuda.is_built() or torch.version.hip is not None
    assert server_main._torch_built_for_gpu() is built
    for text, gpu in (("cuda: Optional[str] = '12.8'\nhip = None\n", True),
                      ("cuda = None\nhip: Optional[str] = '6.4'\n", True),
                      ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False)):
        f = tmp_path / "version.py"
        f.write_text("from typing import Optional\n__version__ = '2.13.0'\n" + text)
        assert server_main._torch_built_for_gpu(f) is gpu
    p = argparse.ArgumentParser()
    server_main.add_serve_args(p)
    single = threading.active_count() == 1
    for device, fork in (("auto", not built), ("cpu", True), ("cuda", False)):
        args = p.parse_args(["m", "--device", device])
        assert server_main._forks_engine(args) is (fork and single)
    args = p.parse_args(["m", "--no-engine-process", "--device", "cpu"])
    assert server_main._forks_engine(args) is False
