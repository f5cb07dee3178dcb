"""StepRecord / StepTotals: what an engine step reports to its observers."""

from __future__ import annotations

import importlib
import json
import os

import pytest

from pensieve.core.outputs import (
    QueryRange,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SwapPlan,
)
from pensieve.core.sampling_params import SamplingParams
from pensieve.engine.step_record import StepRecord, StepTotals

P = SamplingParams(max_tokens=4)


def test_record_splits_prefill_and_decode_and_counts_swaps() -> None:
    sched = SchedulerOutput(
        requests=[
            ScheduledRequest("a", [0, 1], [QueryRange(0, [1, 2, 3]), QueryRange(40, [4, 5])],
                             True, P, 0),                       # recompute + new prompt
            ScheduledRequest("b", [2], [QueryRange(7, [9])], True, P, 3),    # a decode
            ScheduledRequest("c", [3], [QueryRange(0, [9])], True, P, 0),    # 1-token prompt
        ],
        swaps=SwapPlan(swap_out_first=[(5, 1)], swap_in=[(2, 6), (3, 7)], swap_out=[(8, 4)]),
    )
    out = RunnerOutput({"a": 1, "b": 2, "c": 3}, step_time_s=0.5, swap_outs_in_flight=1,
                       host_prepare_s=0.01, host_issue_s=0.04, graph_replay=True)
    r = StepRecord.of(sched, out, 0.001, 0.5, 0.002)
    assert (r.prefill_tokens, r.decode_tokens, r.num_requests) == (6, 1, 3)
    assert (r.swap_in_chunks, r.swap_out_chunks, r.urgent_swap_out_chunks) == (2, 1, 1)
    assert r.has_prefill and r.swap_outs_in_flight == 1 and r.step_time_s == 0.5

    totals = StepTotals()
    totals(r)
    decode_only = SchedulerOutput(requests=[sched.requests[1]])
    totals(StepRecord.of(decode_only, RunnerOutput({"b": 1}, host_prepare_s=0.002,
                                                   host_issue_s=0.003), 0.0, 0.25, 0.0))
    d = totals.as_dict()
    assert (d["prefill_step_prepare_s"], d["prefill_step_issue_s"]) == (0.01, 0.04)
    assert (d["decode_step_prepare_s"], d["decode_step_issue_s"]) == (0.002, 0.003)
    assert d["steps"] == 2 and d["prefill_steps"] == 1
    assert d["prefill_step_execute_s"] == 0.5 and d["decode_step_execute_s"] == 0.25
    assert d["decode_tokens"] == 2 and d["prefill_tokens"] == 6
    assert r.graph_replay and (d["graph_steps"], d["prefill_graph_steps"]) == (1, 1)


def test_engine_calls_observers_once_per_step() -> None:
    from pensieve.bench.engine_api import VirtualClock
    from pensieve.core.scheduling_config import SchedulerConfig
    from pensieve.sim.simulator import SimEngine
    from pensieve.sim.step_cost import StepCostModel

    eng = SimEngine(SchedulerConfig(max_num_batched_tokens=512, max_model_len=512), 64, 64,
                    StepCostModel(base_s=0.01), VirtualClock(), lambda ctx: 1e-3,
                    chunk_size=16, vocab_size=256)
    seen: list[StepRecord] = []
    eng.step_observers.append(seen.append)
    eng.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert len(seen) == eng.num_steps == 3
    assert seen[0].prefill_tokens == 39 and [s.decode_tokens for s in seen] == [0, 1, 1]


def test_step_totals_script_reads_metrics_text() -> None:
    mod = importlib.import_module("step_totals")
    text = "\n".join([
        "# HELP pensieve_steps_total Engine steps",
        'pensieve_steps_total{kind="prefill"} 10.0',
        'pensieve_steps_total{kind="decode"} 30.0',
        'pensieve_step_execute_seconds_total{kind="prefill"} 2.0',
        'pensieve_step_execute_seconds_total{kind="decode"} 3.0',
        'pensieve_computed_tokens_total{kind="prefill"} 1e4',
        'pensieve_scheduler_seconds_total{phase="schedule"} 0.03',
        'pensieve_scheduler_seconds_total{phase="update"} 0.01',
        'pensieve_swap_chunks_total{kind="out"} 3.0',
        'pensieve_swap_chunks_total{kind="out_urgent"} 1.0',
        'pensieve_step_host_prepare_seconds_total{kind="prefill"} 0.05',
        'pensieve_step_host_issue_seconds_total{kind="prefill"} 0.2',
        'pensieve_step_host_issue_seconds_total{kind="decode"} 0.06',
        "pensieve_decode_split_span_steps_total 6.0",
        'pensieve_graph_steps_total{kind="prefill"} 4.0',
        'pensieve_graph_steps_total{kind="decode"} 30.0',
    ])
    c = mod.costs(mod.parse(text))
    assert c["us_per_prefill_token"] == 200.0          # 2 s / 10k tokens
    assert c["us_per_prefill_token_net"] == 100.0      # minus 10 steps x 0.1 s of decodes
    assert c["decode_step_ms"] == 100.0 and c["scheduler_ms_per_step"] == 1.0
    assert c["urgent_swap_out_share"] == 0.25
    assert c["split_span_share"] == 0.2                # 6 of 30 decode steps
    assert c["prefill_graph_share"] == 0.4             # 4 of 10 steps with prefill
    assert c["prefill_host_prepare_ms"] == 5.0 and c["prefill_host_issue_ms"] == 20.0
    assert c["decode_host_issue_ms"] == 2.0 and c["decode_host_prepare_ms"] == 0.0


def test_step_totals_script_sums_in_process_step_rows(tmp_path) -> None:  # noqa: ANN001
    """An in-process run's steps.jsonl.gz (rows with and without host times) gives the same
    counters a server's /metrics would, inside a churn.tgz as on its own."""
    import gzip
    import json
    import tarfile

    mod = importlib.import_module("step_totals")
    rows = [
        {"system": "pensieve", "num_prefill_tokens": 400, "num_decode_tokens": 2,
         "swap_in_chunks": 5, "swap_out_chunks": 4, "urgent_swap_out_chunks": 1, "time_s": 0.03,
         "host": {"schedule_s": 0.001, "update_s": 0.001, "execute_s": 0.04,
                  "prepare_s": 0.002, "issue_s": 0.01}},
        {"system": "pensieve", "num_prefill_tokens": 0, "num_decode_tokens": 8, "time_s": 0.01,
         "host": {"schedule_s": 0.0, "update_s": 0.0, "execute_s": 0.01,
                  "prepare_s": 0.0005, "issue_s": 0.001}},
        {"system": "pensieve", "num_prefill_tokens": 0, "num_decode_tokens": 8, "time_s": 0.01},
    ]
    steps = tmp_path / "B" / "steps.jsonl.gz"
    steps.parent.mkdir()
    with gzip.open(steps, "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    tgz = tmp_path / "churn.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(steps.parent, arcname="./B")
    for src in (str(steps), str(tgz)):
        [(name, m)] = mod.sources(src)
        assert name.endswith("steps.jsonl.gz")
        c = mod.costs(m)
        assert c["prefill_steps"] == 1 and c["decode_steps"] == 2
        assert c["prefill_step_ms"] == 40.0 and c["decode_step_ms"] == 10.0
        assert c["us_per_prefill_token"] == 100.0 and c["us_per_prefill_token_net"] == 75.0
        assert c["prefill_host_prepare_ms"] == 2.0 and c["prefill_host_issue_ms"] == 10.0
        assert c["decode_host_prepare_ms"] == 0.25 and c["decode_host_issue_ms"] == 0.5
        assert c["scheduler_ms_per_step"] == 2.0 / 3
        assert c["swap_in_chunks"] == 5 and c["urgent_swap_out_share"] == 0.25


def test_model_runner_reports_its_host_time(tiny_llama) -> None:  # noqa: ANN001
    """The real runner on the CPU: prepare <= issue <= step time, for a prefill and a decode
    step, and the engine's totals carry them by step kind."""
    from pensieve.engine.llm import LLM

    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks=16)
    seen: list[StepRecord] = []
    totals = StepTotals()
    llm.engine.step_observers += [seen.append, totals]
    llm.generate([list(range(1, 30))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [r.has_prefill for r in seen] == [True, False, False]
    for r in seen:
        assert 0.0 < r.host_prepare_s <= r.host_issue_s <= r.step_time_s
    d = totals.as_dict()
    assert 0.0 < d["prefill_step_prepare_s"] <= d["prefill_step_issue_s"]
    assert 0.0 < d["decode_step_prepare_s"] <= d["decode_step_issue_s"]


def _server_log(tmp_path):  # noqa: ANN001, ANN202
    """A server step log (StepLog) of three steps: one with 400 prefill tokens (a graph replay,
    5 chunks of its own swapped in, 3 ahead), two decode-only steps of 10 ms."""
    from pensieve.engine.step_record import StepLog

    def sched(prefill: int, swaps: SwapPlan) -> SchedulerOutput:
        reqs = [ScheduledRequest("d", [0, 1], [QueryRange(40, [1])], True, P, 3)]
        if prefill:
            reqs.append(ScheduledRequest("p", [2] * 20, [QueryRange(100, [7] * prefill)],
                                         True, P, 0))
        return SchedulerOutput(requests=reqs, swaps=swaps)

    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path))
    big = SwapPlan(swap_in=[(i, i) for i in range(5)], swap_in_ahead=[(9, 9)] * 3)
    log(StepRecord.of(sched(400, big), RunnerOutput({}, step_time_s=0.04, host_prepare_s=0.002,
                                                     host_issue_s=0.003, graph_replay=True),
                      0.001, 0.04, 0.001))
    for _ in range(2):
        log(StepRecord.of(sched(0, SwapPlan()), RunnerOutput({}, step_time_s=0.01), 0.0, 0.01,
                          0.0))
    log.close()
    return path


def test_small_steps_after_ahead_copies_are_binned_by_the_chunks_ahead() -> None:
    """step_breakdown.py: a small step with prefill counts in the bin of the chunks its
    previous step copied ahead, with its time over the mean decode step."""
    brk = importlib.import_module("step_breakdown")

    def row(prefill: int, ahead: int, ms: float) -> dict:
        return {"prefill_tokens": prefill, "decode_tokens": 4, "execute_s": ms / 1e3,
                "host_prepare_s": 0.0, "host_issue_s": 0.0, "graph_replay": True,
                "swap_in_step": 0, "swap_in_ahead": ahead}

    rows = [row(0, 0, 20.0), row(0, 100, 20.0), row(10, 0, 26.0), row(0, 0, 20.0),
            row(20, 0, 21.0), row(0, 5, 20.0), row(300, 0, 30.0), row(30, 0, 23.0)]
    s = brk.summarize(rows)
    assert s["decode_step_ms"] == 20.0
    bins = {a["prev_ahead"]: a for a in s["small_after_ahead"]}
    assert bins["64-127"]["steps"] == 1 and bins["64-127"]["extra_ms_mean"] == pytest.approx(6.0)
    assert bins["0"]["steps"] == 2 and bins["0"]["extra_ms_mean"] == pytest.approx(2.0)
    assert bins["1-63"]["steps"] == 0  # the step after 5 ahead has 300 tokens: not small
    assert bins[">= 256"]["extra_ms_median"] is None


def test_small_steps_by_the_kv_their_prefill_attends_over() -> None:
    """step_breakdown.py: small steps binned by ``prefill_kv``, with and without copies ahead
    in the step before; the ahead bins carry the mean of those positions."""
    brk = importlib.import_module("step_breakdown")

    def row(prefill: int, ahead: int, kv: int, ms: float) -> dict:
        return {"prefill_tokens": prefill, "decode_tokens": 4, "execute_s": ms / 1e3,
                "host_prepare_s": 0.0, "host_issue_s": 0.0, "graph_replay": True,
                "swap_in_step": 0, "swap_in_ahead": ahead, "prefill_kv": kv}

    rows = [row(0, 0, 0, 20.0), row(10, 0, 1500, 21.0), row(0, 80, 0, 20.0),
            row(20, 0, 1800, 25.0), row(0, 0, 0, 20.0), row(30, 0, 500, 22.0)]
    s = brk.summarize(rows)
    cells = {(a["prefill_kv"], a["ahead_before"]): a for a in s["small_by_kv"]}
    assert cells[("1000-1999", False)]["steps"] == 1
    assert cells[("1000-1999", False)]["extra_ms_mean"] == pytest.approx(1.0)
    assert cells[("1000-1999", True)]["extra_ms_mean"] == pytest.approx(5.0)
    assert cells[("0-999", False)]["extra_ms_mean"] == pytest.approx(2.0)
    assert cells[(">= 8000", True)]["steps"] == 0
    bins = {a["prev_ahead"]: a for a in s["small_after_ahead"]}
    assert bins["64-127"]["prefill_kv_mean"] == pytest.approx(1800)
    assert bins["0"]["prefill_kv_mean"] == pytest.approx(1000)
    assert "prefill KV" in brk.table(s)


def test_the_rate_of_copies_ahead_implied_by_the_small_step_after_them() -> None:
    """step_breakdown.py: the copies ahead of a step took its time (less host prepare) plus
    what the small step after it waited beyond a small step after none."""
    brk = importlib.import_module("step_breakdown")

    def row(prefill: int, ahead: int, ms: float) -> dict:
        return {"prefill_tokens": prefill, "decode_tokens": 4, "execute_s": ms / 1e3,
                "host_prepare_s": 0.0, "host_issue_s": 0.0, "graph_replay": True,
                "swap_in_step": 0, "swap_in_ahead": ahead}

    rows = [row(0, 0, 20.0), row(10, 0, 21.0), row(0, 64, 20.0), row(10, 0, 31.0)]
    s = brk.summarize(rows, chunk_bytes=1e6)
    assert s["decode_step_ms"] == pytest.approx(20.0)
    r = s["ahead_rate"]
    assert r["pairs"] == 1  # 64 chunks of 1 MB in 20 + (31 - 21) ms
    assert r["gbps_median"] == pytest.approx(64e6 / 0.030 / 1e9)
    assert "implied in-stream rate" in brk.table(s)
    assert brk.summarize(rows)["ahead_rate"] is None  # no chunk size: not computed


def test_server_step_log_gives_the_metrics_counters_and_the_breakdown(tmp_path) -> None:  # noqa: ANN001
    """A server's PENSIEVE_STEP_LOG rows: step_totals.py sums them into the /metrics counters;
    step_breakdown.py splits the steps with prefill by class with the same net cost."""
    path = _server_log(tmp_path)
    totals = importlib.import_module("step_totals")
    [(_, m)] = totals.sources(str(path))
    c = totals.costs(m)
    assert c["prefill_steps"] == 1 and c["decode_steps"] == 2
    assert c["us_per_prefill_token"] == 100.0 and c["us_per_prefill_token_net"] == 75.0
    assert c["prefill_host_prepare_ms"] == 2.0 and c["prefill_graph_share"] == 1.0
    brk = importlib.import_module("step_breakdown")
    s = brk.summarize(brk.load_rows(str(path)))
    assert s["decode_steps"] == 2 and s["decode_step_ms"] == 10.0
    by = {c["class"]: c for c in s["classes"]}
    every = by["all steps with prefill"]
    assert every["steps"] == 1 and every["net_us_per_token"] == 75.0
    assert every["swap_in_step"] == 5 and every["swap_in_ahead"] == 3
    assert by["graph, own swap-ins"]["steps"] == 1 and by["eager"]["steps"] == 0
    assert by["256-511 tokens"]["steps"] == 1 and by["1-63 tokens"]["steps"] == 0
    assert "us/tok net" in brk.table(s)
    # no small step with prefill (the only one has 400 tokens): every bin empty
    assert [a["steps"] for a in s["small_after_ahead"]] == [0] * len(brk.AHEAD_BINS)
    png = tmp_path / "b.png"
    assert brk.main([str(path), "--plot", str(png), "--json", str(tmp_path / "b.json")]) == 0
    assert png.stat().st_size > 0


def test_server_engine_loop_opens_the_step_log_or_warns(tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    """``PENSIEVE_STEP_LOG``: the engine loop adds a StepLog; a path it cannot open leaves the
    server running without one, with a warning."""
    from types import SimpleNamespace

    from pensieve.engine.step_record import StepLog
    from pensieve.server.engine_loop import EngineLoop

    def loop() -> list:  # type: ignore[type-arg]
        eng = SimpleNamespace(step_observers=[])
        EngineLoop(eng, lambda *a: None)
        return eng.step_observers

    monkeypatch.delenv("PENSIEVE_STEP_LOG", raising=False)
    assert [type(o) for o in loop()] == [StepTotals]
    monkeypatch.setenv("PENSIEVE_STEP_LOG", str(tmp_path / "steps.jsonl"))
    observers = loop()
    assert [type(o) for o in observers] == [StepTotals, StepLog]
    observers[1].close()
    monkeypatch.setenv("PENSIEVE_STEP_LOG", str(tmp_path / "steps_{pid}.jsonl"))
    observers = loop()
    observers[1].close()
    assert (tmp_path / f"steps_{os.getpid()}.jsonl").exists()  # one file per process
    monkeypatch.setenv("PENSIEVE_STEP_LOG", str(tmp_path))  # a directory
    with caplog.at_level("WARNING", logger="pensieve.server"):
        assert [type(o) for o in loop()] == [StepTotals]
    assert "PENSIEVE_STEP_LOG" in caplog.text


def test_step_totals_reports_the_disk_tiers_share_of_the_host_time() -> None:
    """A server's step rows carry the time spent waiting for disk reads and carrying out the
    disk plan (parts of ``schedule_s``); step_totals reports them per step, and rows written
    before those fields count 0."""
    mod = importlib.import_module("step_totals")

    def row(prefill: int, wait: float | None, apply: float | None) -> str:
        d = {"prefill_tokens": prefill, "decode_tokens": 4, "execute_s": 0.01,
             "host_prepare_s": 0.0, "host_issue_s": 0.0, "schedule_s": 0.05, "update_s": 0.0,
             "swap_in_chunks": 0, "swap_out_chunks": 0, "urgent_swap_out_chunks": 0}
        if wait is not None:
            d["disk_wait_s"], d["disk_apply_s"] = wait, apply
        return json.dumps(d)

    c = mod.costs(mod.totals_of_steps([row(100, 0.03, 0.01), row(0, 0.0, 0.002),
                                       row(0, None, None), row(0, 0.006, 0.0)]))
    assert c["disk_wait_ms_per_step"] == pytest.approx(9.0)    # 36 ms over 4 steps
    assert c["disk_apply_ms_per_step"] == pytest.approx(3.0)   # 12 ms over 4 steps
    assert mod.costs(mod.totals_of_steps([]))["disk_wait_ms_per_step"] == 0.0

