"""Issue 60, fault 2: a constrained request's grammar compiles where the engine lives, in a
thread of its own and before the request is added, never inside a step; past
``--grammar-compile-timeout`` it is a 400. Checked with a runner whose compiles wait for the
test (the mechanism, not the machine's speed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_scripted import build_tokenizer
from test_server_audit import CHAT, MSGS, _enc, _serve
from test_server_stateless import _Slow


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer("chatml")


@pytest.fixture
def served(tok: Any, tmp_path: Path) -> Iterator[tuple[TestClient, Any, Any]]:
    yield from _serve(tok, tmp_path)


class _HeldCompiler:
    """A runner's grammar compiler whose compiles wait until :attr:`release` is set."""

    def __init__(self) -> None:
        import threading

        self.started, self.release = threading.Event(), threading.Event()
        self.compiled: list[Any] = []

    def compile(self, spec: Any) -> None:
        self.started.set()
        assert self.release.wait(60)
        self.compiled.append(spec)

    def grammar_compiler(self) -> _HeldCompiler:  # the runner's interface
        return self


JSON_OBJECT = {"type": "json_object"}


def _post_into(http: TestClient, body: dict[str, Any], out: list[Any]) -> None:
    out.append(http.post(CHAT, json=body))


def _stream_tokens(http: TestClient, body: dict[str, Any], times: list[float]) -> None:
    import time

    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                times.append(time.monotonic())


def test_a_grammar_compiles_off_the_step_loop(tok: Any, tmp_path: Path) -> None:
    """A constrained request's grammar compiles where the engine lives but in a thread of its
    own: a stream already running keeps producing tokens while it compiles, and the request
    reaches the engine only once it compiled (it used to compile inside a step, which paused
    every stream for as long as the compile took)."""
    import threading
    import time

    for http, ex, _ in _serve(tok, tmp_path, wrap=_Slow):
        held = _HeldCompiler()
        http.app.state.pensieve.engine.engine.runner = held  # the engine's runner
        ex.script = _enc(tok, " ok") * 40
        times: list[float] = []
        streaming = threading.Thread(target=_stream_tokens, args=(http, {
            "messages": MSGS, "max_tokens": 60, "ignore_eos": True}, times))
        streaming.start()
        while not times:
            time.sleep(0.01)
        answers: list[Any] = []
        constrained = threading.Thread(target=_post_into, args=(http, {
            "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 4,
            "response_format": JSON_OBJECT}, answers))
        constrained.start()
        assert held.started.wait(30)
        at_start = len(times)
        deadline = time.monotonic() + 30
        while len(times) < at_start + 10 and streaming.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(times) >= at_start + 10  # the stream went on while the grammar compiled
        assert not held.compiled and not answers
        assert len(ex.sampled_with) == 1  # the constrained request is not in the engine yet
        held.release.set()
        constrained.join(30)
        streaming.join(30)
        assert answers[0].status_code == 200, answers[0].text
        assert [s.kind for s in held.compiled] == ["json_object"]
        gaps = [b - a for a, b in zip(times, times[1:])]
        print(f"\nstream: {len(times)} tokens, widest gap {max(gaps) * 1e3:.0f} ms")


def test_a_grammar_past_the_compile_time_is_a_400(tok: Any, tmp_path: Path) -> None:
    """A bound on compile time: past it a 400 (``grammar_too_complex``) naming the field;
    the same grammar again is refused at once, without a second compile."""
    for http, _, _ in _serve(tok, tmp_path, grammar_compile_timeout_s=0.5):
        held = _HeldCompiler()
        http.app.state.pensieve.engine.engine.runner = held
        schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}}}
        body = {"messages": MSGS, "max_tokens": 4, "response_format": schema}
        r = http.post(CHAT, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("response_format", "grammar_too_complex"), err
        assert "0.5 s" in err["message"]
        held.started.clear()
        r2 = http.post(CHAT, json=body)
        assert r2.status_code == 400 and "refused again" in r2.json()["error"]["message"]
        assert not held.started.is_set()  # not compiled a second time
        held.release.set()


class _SlowBuild:
    """A runner whose grammar compiler takes a while to build (the tokenizer and its
    xgrammar info, on a loaded host) until :attr:`release` is set, and compiles at once."""

    def __init__(self) -> None:
        import threading

        self.building, self.release = threading.Event(), threading.Event()
        self.compiled: list[Any] = []

    def grammar_compiler(self) -> _SlowBuild:  # the runner's interface: built on first use
        self.building.set()
        assert self.release.wait(60)
        return self

    def compile(self, spec: Any) -> None:
        self.compiled.append(spec)


def test_the_compile_timeout_does_not_count_the_compilers_build(tok: Any,
                                                                tmp_path: Path) -> None:
    """The first constrained request used to build the compiler within its compile timeout
    (in the compile thread, at nice 10) and got a 400 on a loaded host. The build is waited
    for apart: here it outlasts the 0.5 s timeout twice over, and the request is answered."""
    import threading
    import time

    for http, _, _ in _serve(tok, tmp_path, grammar_compile_timeout_s=0.5):
        runner = _SlowBuild()
        http.app.state.pensieve.engine.engine.runner = runner
        answers: list[Any] = []
        constrained = threading.Thread(target=_post_into, args=(http, {
            "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 4,
            "response_format": JSON_OBJECT}, answers))
        constrained.start()
        assert runner.building.wait(30)
        time.sleep(1.0)  # the build outlasts the timeout
        assert not answers and not runner.compiled
        runner.release.set()
        constrained.join(30)
        assert answers[0].status_code == 200, answers[0].text
        assert [s.kind for s in runner.compiled] == ["json_object"]


def test_the_grammar_compiler_is_built_when_the_engine_starts() -> None:
    """The engine loop starts building its runner's grammar compiler (a real tokenizer and
    its xgrammar info, demo model) when it is made, before any constrained request."""
    from server_util import ensure_demo

    from pensieve import LLM
    from pensieve.server.engine_loop import EngineLoop

    ensure_demo()
    llm = LLM("demo", device="cpu", num_gpu_blocks=16, num_cpu_blocks=0, max_model_len=256)
    runner = llm.engine.runner
    assert runner.grammar is None
    loop = EngineLoop(llm.engine, lambda *_: None)
    assert loop.grammar_compiler is not None
    compiler = loop.grammar_compiler.result(timeout=120)
    assert runner.grammar is not None and compiler is runner.grammar.compiler
    assert compiler.vocab_size == 32000
    llm.engine.shutdown()
