"""PENSIEVE_PROFILE_STEPS: a profiler trace of a window of a server's engine steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pensieve.server.engine_loop import EngineLoop
from pensieve.server.step_profile import StepProfile


def _fake_engine() -> SimpleNamespace:
    """What EngineLoop.step touches: a step that does some torch work and finishes nothing."""
    def step() -> list:  # type: ignore[type-arg]
        a = torch.randn(64, 64)
        (a @ a).sum().item()
        eng.steps += 1
        return []

    eng = SimpleNamespace(step_observers=[], step=step, last_sampled={}, last_logprobs={},
                          steps=0)
    return eng


def test_the_window_of_steps_is_written_as_a_chrome_trace(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    path = tmp_path / "trace_{pid}.json"
    monkeypatch.setenv("PENSIEVE_PROFILE_STEPS", f"2:3:{path}")
    eng = _fake_engine()
    loop = EngineLoop(eng, lambda *a: None)
    assert loop.profile is not None and loop.profile.start == 2 and loop.profile.count == 3
    written = list(tmp_path.glob("trace_*.json"))
    for i in range(6):
        loop.step()
        written = list(tmp_path.glob("trace_*.json"))
        assert bool(written) == (i >= 4), f"after step {i}"  # written once step 4 is done
    assert eng.steps == 6 and loop.profile.done
    trace = json.loads(written[0].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("matmul" in n or "mm" in n for n in names)


def test_a_failing_step_still_counts(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("PENSIEVE_PROFILE_STEPS", f"0:1:{tmp_path / 't.json'}")
    eng = _fake_engine()

    def boom() -> list:  # type: ignore[type-arg]
        raise RuntimeError("step failed")

    eng.step = boom
    loop = EngineLoop(eng, lambda *a: None)
    loop.step()  # the loop contains the failure (logs it) and the profile ends
    assert loop.profile is not None and loop.profile.done and (tmp_path / "t.json").exists()


def test_a_server_stopped_inside_the_window_writes_the_steps_it_has(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    path = tmp_path / "t.json"
    monkeypatch.setenv("PENSIEVE_PROFILE_STEPS", f"1:100:{path}")
    loop = EngineLoop(_fake_engine(), lambda *a: None)
    for _ in range(3):
        loop.step()
    assert not path.exists()  # steps 1-2 of a window of 100
    loop.close()
    assert loop.profile is not None and loop.profile.done
    names = {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}
    assert any("matmul" in n or "mm" in n for n in names)
    loop.close()  # a second close writes nothing more


@pytest.mark.parametrize("spec", ["10", "a:b:c", "1:0:/tmp/x", "-1:2:/tmp/x", "1:2:"])
def test_a_malformed_spec_serves_without_a_profile(spec: str, monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setenv("PENSIEVE_PROFILE_STEPS", spec)
    with caplog.at_level("WARNING", logger="pensieve.server"):
        assert StepProfile.from_env() is None
    assert "PENSIEVE_PROFILE_STEPS" in caplog.text


def test_unset_means_no_profile(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("PENSIEVE_PROFILE_STEPS", raising=False)
    assert StepProfile.from_env() is None
    assert EngineLoop(_fake_engine(), lambda *a: None).profile is None
