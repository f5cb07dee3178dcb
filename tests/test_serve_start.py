"""What ``pensieve serve`` does before the model loads: a port in use is found first (exit 2,
one line, nothing loaded), and the thread settings in effect in the engine process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pensieve.threads import (
    MIN_CPUS_TO_RESERVE,
    THREAD_ENV,
    set_thread_env,
    split_cpus,
    usable_cpus,
)


def test_a_port_in_use_stops_serve_before_the_model_loads(tmp_path):
    cache = tmp_path / "cache"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "pensieve.cli", "serve", "demo", "--device", "cpu",
             "--port", str(port), "--store", str(tmp_path / "conv.db")],
            env={**os.environ, "PENSIEVE_CACHE_DIR": str(cache)}, capture_output=True,
            text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines
    assert not cache.exists(), "the model was built before the port was checked"
    assert not (tmp_path / "conv.db").exists(), "the store was opened before the port check"


def test_thread_env_is_set_unless_given():
    env: dict[str, str] = {}
    assert set_thread_env(env) == {"OMP_WAIT_POLICY": "PASSIVE"} == THREAD_ENV
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert set_thread_env(env) == {"OMP_WAIT_POLICY": "ACTIVE"}  # the user's choice stays


def test_cpus_split_between_server_and_engine():
    assert split_cpus([0, 1]) == ([0, 1], [0, 1])  # too few to give one up
    assert split_cpus([0, 1, 2, 3]) == ([0], [1, 2, 3])
    assert split_cpus(list(range(8, 16))) == ([8], list(range(9, 16)))
    assert MIN_CPUS_TO_RESERVE == 4


def test_engine_process_runs_with_passive_waits_and_its_cpus(monkeypatch):
    """The engine process as ``pensieve serve`` starts it, on the CPU: OpenMP threads sleep
    when they wait (a busy machine no longer makes them spin), torch runs one thread per CPU
    the engine may use, and those CPUs leave one to the server from 4 CPUs on."""
    from pensieve.engine.llm import build_engine_config
    from pensieve.server.engine_process import ProcessEngine
    from pensieve.threads import thread_settings

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = build_engine_config(model="demo-random", device="cpu", num_gpu_blocks=16,
                              num_cpu_blocks=8, max_model_len=128)
    eng = ProcessEngine(cfg, "warning")
    try:
        info = eng.info["threads"]
        _, engine_cpus = split_cpus(usable_cpus())
        assert eng.info["device"] == "cpu"
        assert info["OMP_WAIT_POLICY"] == "PASSIVE"
        assert info["cpus"] == engine_cpus
        assert info["torch_threads"] == len(engine_cpus)
        import asyncio

        assert asyncio.run(eng.call(thread_settings)) == info  # asked again, the same
    finally:
        eng.shutdown()


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="needs 2 CPUs for OMP_NUM_THREADS=1 to differ")
def test_engine_process_keeps_a_given_thread_count(monkeypatch):
    from pensieve.engine.llm import build_engine_config
    from pensieve.server.engine_process import ProcessEngine

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cfg = build_engine_config(model="demo-random", device="cpu", num_gpu_blocks=16,
                              num_cpu_blocks=8, max_model_len=128)
    eng = ProcessEngine(cfg, "warning")
    try:
        assert eng.info["threads"]["torch_threads"] == 1
        assert eng.info["threads"]["OMP_WAIT_POLICY"] == "ACTIVE"
    finally:
        eng.shutdown()
