"""The disk tier below the CPU tier: greedy tokens never change whether history KV comes back
from disk, is recomputed because a file is missing, corrupt, truncated or of another
fingerprint, or survives a restart; the disk index keeps its invariants under random
workloads through all three tiers."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
from test_stateful_invariant import (
    CHUNK,
    VOCAB,
    Reference,
    Workload,
    every_path_workload,
    expected,
    run,
)

from pensieve import LLM, SamplingParams

TIERS = {"num_gpu_blocks": 30, "num_cpu_blocks": 8}


def make_llm(path: str, disk: str | None, **kw: object) -> LLM:
    extra: dict[str, object] = {}
    if disk is not None:  # a fast disk: every copy on disk is read back, none recomputed
        extra = {"disk_kv_gb": 0.01, "disk_kv_path": disk, "disk_read_gbps": 1e9}
    llm = LLM(model=path, dtype="float32", device="cpu", chunk_size=CHUNK,
              **{"max_num_batched_tokens": 64, **TIERS, **extra, **kw})  # type: ignore[arg-type]
    llm.engine.audit = True
    return llm


def test_history_from_disk_matches(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """The every-path workload with a disk tier: chunks leave the CPU tier for disk and come
    back from it, and every turn's tokens are HF's greedy tokens from the full history."""
    path, model = tiny_llama
    workload = every_path_workload()
    want = expected(Reference(model), workload)
    llm = make_llm(path, str(tmp_path))
    steps: list = []
    llm.engine.step_observers.append(steps.append)
    assert run(llm, workload) == want
    st = llm.cache_stats()
    assert st["disk_written_tokens"] > 0 and st["disk_hit_tokens"] > 0, st
    # each step record times the disk tier's part of the host time before execution
    assert steps and all(0.0 <= r.disk_wait_s + r.disk_apply_s <= r.schedule_s for r in steps)
    assert any(r.disk_apply_s > 0.0 for r in steps)
    assert st["disk_blocks_total"] - st["disk_blocks_free"] == llm.engine.cache.disk.size > 0
    llm.engine.cache.disk.check()
    llm.engine.shutdown()


def test_fp8_history_from_disk_matches_a_roomy_cache(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """With an FP8 KV cache the disk tier writes and restores the FP8 bytes: the every-path
    workload gives the tokens of a GPU tier large enough to keep everything, as the two tiers
    do without a disk (test_stateful_invariant.test_fp8_kv_every_policy_agrees)."""
    path, _ = tiny_llama
    workload = every_path_workload()
    roomy = make_llm(path, None, num_gpu_blocks=400, kv_cache_dtype="fp8_e4m3")
    want = run(roomy, workload)
    roomy.engine.shutdown()
    llm = make_llm(path, str(tmp_path), kv_cache_dtype="fp8_e4m3")
    assert llm.engine.kv_caches[0].dtype.itemsize == 1
    assert run(llm, workload) == want
    st = llm.cache_stats()
    assert st["disk_written_tokens"] > 0 and st["disk_hit_tokens"] > 0, st
    llm.engine.cache.disk.check()
    llm.engine.shutdown()


def _restart_workload() -> tuple[Workload, Workload]:
    rng = random.Random(7)
    first = [[(c, [rng.randrange(VOCAB) for _ in range(rng.randint(30, 50))], 12)
              for c in range(4)]]
    second = [[(c, [rng.randrange(VOCAB) for _ in range(rng.randint(4, 10))], 8)
               for c in range(4)]]
    return first, second


def _resume(path: str, disk: str | None, histories: dict[int, list[int]],
            second: Workload) -> tuple[dict[int, list[list[int]]], dict[str, int]]:
    """A fresh engine given the histories (as the conversation store does after a restart),
    then the second round."""
    llm = make_llm(path, disk, num_cpu_blocks=40)  # room for a step's reads from disk
    for c, hist in histories.items():
        llm.engine.restore_conversation(f"c{c}", hist)
    outs = run(llm, second)
    stats = llm.cache_stats()
    llm.engine.shutdown()
    return outs, stats


def _first_round(path: str, disk: str, first: Workload) -> dict[int, list[int]]:
    llm = make_llm(path, disk)
    run(llm, first)
    histories = {c: llm.engine.conversation_history(f"c{c}") for c, _, _ in first[0]}
    llm.engine.shutdown()  # writes every idle chunk not on disk yet
    return histories


def test_restart_resumes_from_disk(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """After a restart, >= 90% of the continued conversations' context comes from disk and the
    tokens equal a fresh recompute's (and HF's)."""
    path, model = tiny_llama
    first, second = _restart_workload()
    histories = _first_round(path, str(tmp_path), first)
    got, stats = _resume(path, str(tmp_path), histories, second)
    want, cold = _resume(path, None, histories, second)
    assert got == want
    ref = Reference(model)
    for c, ids, m in second[0]:
        assert got[c] == [ref(histories[c] + ids, m)]
    context = sum(len(h) for h in histories.values())
    assert stats["disk_hit_tokens"] >= 0.9 * context, (stats, context)
    assert cold["disk_hit_tokens"] == 0 and cold["recomputed_tokens"] >= context - 4


def _damage(path: str, how: str) -> None:
    data = open(path, "rb").read()
    if how == "flip":  # one byte of the payload
        data = data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:]
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "fingerprint":  # another chunk size in the header, length kept
        data = data.replace(b"chunk=8;", b"chunk=9;", 1)
    open(path, "wb").write(data)


@pytest.mark.parametrize("how", ["flip", "truncate", "fingerprint", "missing", "swapped"])
def test_bad_files_are_recomputed(tiny_llama, tmp_path, how: str) -> None:  # noqa: ANN001
    """Damaged, missing or misplaced files never give wrong KV: their chunks are recomputed,
    the others still come from disk, and the tokens equal a fresh recompute's."""
    path, _ = tiny_llama
    first, second = _restart_workload()
    histories = _first_round(path, str(tmp_path), first)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".kv"))
    assert len(files) >= 8
    victims = files[1:8:3]
    for name in victims:
        full = os.path.join(tmp_path, name)
        if how == "missing":
            os.remove(full)
        elif how == "swapped":  # another chunk's file under this name
            other = files[0] if name != files[0] else files[2]
            open(full, "wb").write(open(os.path.join(tmp_path, other), "rb").read())
        else:
            _damage(full, how)
    got, stats = _resume(path, str(tmp_path), histories, second)
    want, _ = _resume(path, None, histories, second)
    assert got == want
    context = sum(len(h) for h in histories.values())
    assert 0 < stats["disk_hit_tokens"] <= context - len(victims) * CHUNK, stats
    assert stats["recomputed_tokens"] >= len(victims) * CHUNK


def test_unwritable_path_serves_without_the_disk_tier(tiny_llama, tmp_path,  # noqa: ANN001
                                                      caplog) -> None:  # noqa: ANN001
    """A disk tier that cannot be written at start (full, read-only, not a directory) is a
    logged warning: the engine serves without it, HF's greedy tokens."""
    path, model = tiny_llama
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level("WARNING", logger="pensieve"):
        llm = make_llm(path, str(blocker / "sub"))
    assert llm.engine.disk_tier is None
    assert any("disk tier off" in r.message and "not writable" in r.message
               for r in caplog.records)
    workload = [[(0, [5, 6, 7, 8, 9, 10], 5)]]
    assert run(llm, workload) == expected(Reference(model), workload)
    llm.engine.shutdown()


def test_short_writes_leave_no_file(tmp_path) -> None:  # noqa: ANN001
    """A write the file system cuts short (here: a file-size limit, as a full disk does) raises
    and leaves neither the file nor its temporary (the audit found short writes renamed into
    place and 15 empty temporaries left by a shutdown on a full disk)."""
    script = textwrap.dedent(f"""
        import resource, signal
        from pensieve.engine import disk_files
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            disk_files.write_atomic({str(tmp_path / "a.kv")!r}, b"head",
                                    memoryview(bytes(100_000)))
        except OSError as e:
            print("raised", e.errno)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert "raised" in out.stdout, out
    assert os.listdir(tmp_path) == []


def test_leftover_temporaries_are_removed_at_start(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    path, _ = tiny_llama
    (tmp_path / "abc.kv.tmp").write_bytes(b"")
    (tmp_path / "def.kv.tmp").write_bytes(b"half a file")
    llm = make_llm(path, str(tmp_path))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    llm.engine.shutdown()


def test_changed_weights_read_no_old_kv(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """New weights written in place under the same model path, then a restart with the same
    disk path: no chunk of the old weights' KV is read (the fingerprint holds a digest of the
    weights), and the tokens are the new model's greedy tokens."""
    import safetensors.torch
    import transformers

    src, _ = tiny_llama
    model_dir = tmp_path / "model"
    shutil.copytree(src, model_dir)
    disk = str(tmp_path / "kv")
    first, second = _restart_workload()
    histories = _first_round(str(model_dir), disk, first)
    weights = model_dir / "model.safetensors"
    tensors = safetensors.torch.load_file(weights)
    name = next(n for n in sorted(tensors) if "layers.0.self_attn.k_proj" in n)
    tensors[name] = tensors[name] * 1.5  # the KV of layer 0 changes
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    got, stats = _resume(str(model_dir), disk, histories, second)
    assert stats["disk_hit_tokens"] == 0, stats
    new = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    ref = Reference(new)
    for c, ids, m in second[0]:
        assert got[c] == [ref(histories[c] + ids, m)]


def test_failed_writes_fall_back_to_dropping(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """The directory disappears while serving: writes fail, are logged, and the chunks are
    recomputed; the tokens stay HF's."""
    path, model = tiny_llama
    disk = tmp_path / "d"
    llm = make_llm(path, str(disk))
    os.rmdir(disk)
    workload = every_path_workload()
    assert run(llm, workload) == expected(Reference(model), workload)
    st = llm.cache_stats()
    assert st["disk_write_errors"] > 0 and st["disk_hit_tokens"] == 0, st
    llm.engine.shutdown()


def test_disk_tier_is_off_by_default(tiny_llama) -> None:  # noqa: ANN001
    path, _ = tiny_llama
    llm = make_llm(path, None)
    assert llm.engine.cache.disk is None and "disk_hit_tokens" in llm.cache_stats()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].output_token_ids) == 2


def test_metrics_show_disk_hits_and_bytes_per_tier(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """/metrics' collector over a real engine's stats: tokens by source include disk_hit, and
    bytes held per tier include the disk."""
    from types import SimpleNamespace

    from pensieve.engine.step_record import StepTotals
    from pensieve.server.engine_loop import Snapshot
    from pensieve.server.engine_metrics import _EngineCollector

    path, _ = tiny_llama
    llm = make_llm(path, str(tmp_path))
    totals = StepTotals()  # as the server's engine loop sums its steps
    llm.engine.step_observers.append(totals)
    run(llm, every_path_workload())
    st = llm.cache_stats()
    snap = Snapshot(0, 0, st, totals.as_dict())
    metrics = {m.name: m for m in _EngineCollector(SimpleNamespace(snapshot=snap)).collect()}
    source = {s.labels["source"]: s.value for s in metrics["pensieve_prompt_tokens"].samples}
    assert source["disk_hit"] == st["disk_hit_tokens"] > 0
    held = {s.labels["tier"]: s.value for s in metrics["pensieve_kv_bytes_held"].samples}
    assert held["disk"] == llm.engine.cache.disk.size * st["kv_block_bytes"] > 0
    assert held["cpu"] == (st["cpu_blocks_total"] - st["cpu_blocks_free"]) * st["kv_block_bytes"]
    # the steps' disk plans: spills copied out and restores copied in took time, summed over
    # the step records; every write buffer was made on the step or ahead of it
    plan = {s.labels["part"]: s.value for s in metrics["pensieve_disk_plan_seconds"].samples}
    disk = llm.engine.cache.disk
    assert set(plan) == {"sync", "out", "in"} and plan["out"] > 0 and plan["in"] > 0
    made = {s.labels["where"]: s.value
            for s in metrics["pensieve_disk_write_buffers_made"].samples}
    assert made["step"] + made["ahead"] > 0
    # chunks copied out for disk writes: spilled on the step, and written ahead beside it
    copied = {s.labels["when"]: s.value
              for s in metrics["pensieve_disk_chunks_copied_out"].samples}
    assert copied == {"spill": st["disk_spill_copies"], "ahead": st["disk_ahead_copies"]}
    assert copied["spill"] > 0 and copied["ahead"] > 0
    assert st["disk_written_tokens"] > 0 and disk is not None
    llm.engine.shutdown()


def test_steps_do_not_wait_for_writes(tiny_llama, tmp_path) -> None:  # noqa: ANN001
    """The writer thread is held up for the whole workload: steps go on, and chunks whose
    write is still queued come back from the queued bytes, with HF's tokens."""
    import threading

    from pensieve.engine.disk_tier import DiskTier

    path, model = tiny_llama
    gate = threading.Event()
    real = DiskTier._write

    def held(self: DiskTier, entry, payload) -> None:  # noqa: ANN001
        gate.wait(timeout=120)
        real(self, entry, payload)

    DiskTier._write = held  # type: ignore[method-assign]
    try:
        llm = make_llm(path, str(tmp_path))
        workload = every_path_workload()
        assert run(llm, workload) == expected(Reference(model), workload)
        st = llm.cache_stats()
        assert st["disk_hit_tokens"] > 0 and st["disk_write_bytes"] == 0, st
        assert not any(f.endswith(".kv") for f in os.listdir(tmp_path))
    finally:
        gate.set()
        DiskTier._write = real  # type: ignore[method-assign]
    llm.engine.shutdown()  # waits for the writer
    assert llm.engine.disk_tier.stats()["disk_write_bytes"] > 0
    assert any(f.endswith(".kv") for f in os.listdir(tmp_path))


@pytest.mark.parametrize("times", [1, 4, 16])
def test_restored_history_longer_than_the_step_budget(tiny_llama, tmp_path,  # noqa: ANN001
                                                      times: int) -> None:
    """A history of 1x, 4x and 16x the step's token budget read back from disk after a
    restart: the turn is never scheduled with nothing to compute (it failed so, leaving its
    chunks marked on the GPU unfilled), no request fails, and the tokens are HF's greedy
    tokens from the full history, with the history's KV from disk."""
    path, model = tiny_llama
    budget = 16
    rng = random.Random(times)
    first = [[(0, [rng.randrange(VOCAB) for _ in range(times * budget - 4)], 4)]]
    second = [[(0, [rng.randrange(VOCAB) for _ in range(5)], 6)]]
    kw = {"max_num_batched_tokens": budget, "num_gpu_blocks": 64, "num_cpu_blocks": 48}
    llm = make_llm(path, str(tmp_path), **kw)
    run(llm, first)
    history = llm.engine.conversation_history("c0")
    llm.engine.shutdown()
    llm = make_llm(path, str(tmp_path), **kw)
    llm.engine.restore_conversation("c0", history)
    got = run(llm, second)
    stats = llm.cache_stats()
    llm.engine.cache.check_integrity()
    llm.engine.shutdown()
    assert stats["failed_requests"] == 0, stats
    assert got[0] == [Reference(model)(history + second[0][0][1], 6)]
    assert stats["disk_hit_tokens"] >= len(history) - CHUNK, (stats, len(history))
