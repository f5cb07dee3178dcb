"""Engine replicas on Ray Serve (``--data-parallel-size``), on the CPU.

Two replicas of the random demo model on a local Ray instance behind one OpenAI endpoint:
16 conversations x 4 turns from an ``openai`` client that re-sends the history. Every turn
after the first is served with cached tokens (the router keeps each conversation on the
replica holding its KV), both replicas serve, ``/metrics`` labels each replica. Then one
replica is killed mid-run, with requests in flight on it: every conversation still completes
under its id, the store holds every turn the client received.
"""

from __future__ import annotations

import argparse
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason="the replicas extra is not installed")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pensieve.core.routing import preference  # noqa: E402
from pensieve.replicas.router import rank_replicas, ranks_to_offer  # noqa: E402
from pensieve.replicas.serve import (  # noqa: E402
    ATTEMPTS_HEADER,
    REPLICA_HEADER,
    build_application,
    routing_key,
)
from pensieve.server.main import add_serve_args  # noqa: E402
from pensieve.server.store_open import open_store  # noqa: E402

TURNS = 4


def serve_args(store: str, n: int = 2) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["demo-random", "--device", "cpu", "--store", store,
                         "--data-parallel-size", str(n), "--num-gpu-blocks", "128",
                         "--num-cpu-blocks", "64", "--max-model-len", "1024",
                         "--max-num-batched-tokens", "512", "--log-level", "warning"])


def test_routing_key_is_stable_across_turns():
    first = [{"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    with_sys = [{"role": "system", "content": "s"}] + first
    k = routing_key("/v1/chat/completions", {}, b'{"messages": %s}' % _j(first))
    assert k == routing_key("/v1/chat/completions", {}, b'{"messages": %s}' % _j(later))
    assert k != routing_key("/v1/chat/completions", {}, b'{"messages": %s}' % _j(with_sys))
    by_id = routing_key("/v1/chat/completions", {}, b'{"conversation_id": "c1", "messages": []}')
    assert by_id == routing_key("/v1/chat/completions", {"x-conversation-id": "c1"}, b"{}")
    assert by_id == routing_key("/v1/conversations/c1", {}, b"")
    assert by_id != k and routing_key("/v1/models", {}, b"") == ""


def test_rank_replicas_bounded_load():
    ids = ["a", "b", "c"]
    order = preference("k", ids)
    assert rank_replicas("k", ids, [0, 0, 0], 1.25, min_load=1) == order
    hot = [0, 0, 0]
    hot[order[0]] = 10  # the key's first choice is over ceil(1.25 * 11 / 3) = 5
    assert rank_replicas("k", ids, hot, 1.25, min_load=16) == order  # under min_load: stays
    ranked = rank_replicas("k", ids, hot, 1.25, min_load=1)
    assert ranked[0] == order[1] and sorted(ranked) == [0, 1, 2]
    assert ranked[1:] == [i for i in order if i != order[1]]


def test_only_the_first_rank_until_patience_runs_out():
    """A replica slow to answer Ray Serve's queue-length probe (a busy host) must not lose a
    turn to the key's next choice: within the patience only the first rank is offered."""
    ranked = [2, 0, 1]
    assert ranks_to_offer(ranked, 0.0, 10.0) == [[2]]
    assert ranks_to_offer(ranked, 9.9, 10.0) == [[2]]
    assert ranks_to_offer(ranked, 10.0, 10.0) == [[2], [0], [1]]


def _j(x):
    import json

    return json.dumps(x).encode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray instance with the two-replica application (port: a free one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = str(tmp_path_factory.mktemp("replicas") / "conv.db")
    # address="local": a Ray instance of its own, never one another test run started
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # 4 client threads: a replica never holds min_load (16) requests, so no turn spills
        # and every turn finds its KV where it was.
        serve.run(build_application(serve_args(store), replica_cpus=1),
                  name="pensieve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for_replicas(url, 2)
        yield url, store
    finally:
        serve.shutdown()
        ray.shutdown()


def _running(url: str) -> dict[str, float]:
    """Requests running on each replica, from the ingress's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^pensieve_requests_running\{replica="([^"]+)"\} (\S+)$', text, re.M)}


def wait_for_replicas(url: str, n: int, timeout_s: float = 60.0) -> None:
    """Until the ingress's router knows ``n`` replicas (its ``/metrics`` lists them)."""
    deadline = time.monotonic() + timeout_s
    while len(_running(url)) < n and time.monotonic() < deadline:
        time.sleep(0.2)


def _conversation(client, i: int, turns: int, served: list, on_turn=None, history=None,
                  headers=None):
    """One client conversation re-sending its history (from ``history``, a list of messages
    ending with an answer, when given) up to ``turns`` turns; returns its messages and the
    conversation id the server reported."""
    if history is None:
        msgs = [{"role": "user", "content": f"conversation {i}: tell me about {i * 7} apples"}]
    else:
        msgs = history + [{"role": "user", "content": f"and turn {len(history) // 2}?"}]
    cid = None
    for t in range(len(msgs) // 2, turns):
        raw = client.chat.completions.with_raw_response.create(
            model="pensieve-demo", messages=msgs, max_tokens=8, temperature=0)
        r = raw.parse()
        cached = r.usage.prompt_tokens_details.cached_tokens
        cid = r.model_extra["conversation_id"]
        served.append((i, t, raw.headers[REPLICA_HEADER], cached, cid))
        if headers is not None:
            headers.append(raw.headers)
        msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                       {"role": "user", "content": f"and turn {t + 1}?"}]
        if on_turn is not None:
            on_turn()
    return msgs[:-1], cid


def _run(url: str, convs: range, turns: int, on_turn=None, headers=None, histories=None,
         served: list | None = None):
    """Run the conversations ``convs`` from 4 client threads; ``served``: one row per turn
    (conversation, turn, replica, cached tokens, conversation id), in completion order."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    served = [] if served is None else served
    hist = histories or [None] * len(convs)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda ih: _conversation(client, ih[0], turns, served, on_turn, ih[1], headers),
            zip(convs, hist)))
    return results, served


def _check_stored(store_path: str, results, turns: int):
    store = open_store(store_path)
    try:
        for msgs, cid in results:
            conv = store.get(cid)
            assert conv is not None
            assert len(conv.turns) == turns
            assert conv.messages == msgs
    finally:
        store.close()


def test_affinity_cached_turns_both_replicas_and_metrics(cluster):
    url, store = cluster
    results, served = _run(url, range(16), TURNS)
    assert len(served) == 16 * TURNS
    misses = [(i, t, replica) for i, t, replica, cached, _ in served if t > 0 and cached == 0]
    assert not misses, f"continued turns served without cached tokens: {misses}"
    by_conv: dict[int, set] = {}
    for i, _, replica, _, _ in served:
        by_conv.setdefault(i, set()).add(replica)
    assert all(len(r) == 1 for r in by_conv.values()), by_conv  # each stayed on one replica
    replicas = {r for _, _, r, _, _ in served}
    assert len(replicas) == 2
    _check_stored(store, results, TURNS)
    text = httpx.get(url + "/metrics", timeout=60).text
    for r in replicas:
        line = f'pensieve_prompt_tokens_total{{replica="{r}",source="gpu_hit"}} '
        m = re.search("^" + re.escape(line) + r"(\S+)$", text, re.M)
        assert m is not None, text[:2000]
        assert float(m.group(1)) > 0


def _kill(victim_id: str) -> None:
    """Kill the engine replica ``victim_id`` (no restart: Ray Serve starts a new one)."""
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if "EngineReplica" in a["name"]]
    victim = next(a for a in actors if a["name"].rsplit("#", 1)[-1] == victim_id)
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)


def test_kill_a_replica_mid_run(cluster):
    """Turns 0-1 of 16 conversations; then turns 2-3, and while they run, a long turn of a
    conversation the victim holds: when the victim is running it, the victim is killed. The
    long turn (and any other request in flight there) is retried by the ingress on the other
    replica; every conversation continues from its history in the shared store (each turn
    re-sent without an id is a new conversation over it), and the store holds every turn as
    the client received it (0 completed turns lost: a
    replica that stored a turn and died before answering is covered by the request key,
    test_replicas_retry.py)."""
    url, store = cluster
    convs = range(100, 116)
    first, served1 = _run(url, convs, 2)
    cids = {i: cid for (_, cid), i in zip(first, convs)}
    victim_id, j = served1[0][2], served1[0][0]  # the victim and a conversation it holds
    rest = [i for i in convs if i != j]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    long_msgs = first[j - 100][0] + [{"role": "user", "content": "now a long answer"}]
    served2: list = []
    with ThreadPoolExecutor(2) as pool:
        long_turn = pool.submit(  # ~3 s of decoding on the victim
            client.chat.completions.with_raw_response.create, model="pensieve-demo",
            messages=long_msgs, max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 60
        while _running(url).get(victim_id, 0) < 1:  # the long turn runs there
            assert time.monotonic() < deadline and not long_turn.done()
            time.sleep(0.05)
        others = pool.submit(_run, url, rest, TURNS, histories=[first[i - 100][0] for i in rest],
                             served=served2)
        time.sleep(0.3)  # the other conversations' turns in flight too
        _kill(victim_id)
        raw = long_turn.result()
        results, _ = others.result()
    r = raw.parse()
    assert raw.headers[REPLICA_HEADER] != victim_id  # answered by another replica ...
    assert int(raw.headers[ATTEMPTS_HEADER]) >= 2  # ... on the ingress's retry
    assert r.model_extra["conversation_id"] != cids[j] and r.usage.completion_tokens == 400
    long_hist = long_msgs + [{"role": "assistant", "content": r.choices[0].message.content}]
    results_j, _ = _run(url, [j], TURNS, histories=[long_hist], served=served2)
    assert len(served2) == 16 * (TURNS - 2) - 1  # every later turn answered
    _check_stored(store, results + results_j, TURNS)  # and every completed turn stored
    for i, _, _, _, cid in served2:  # each turn: a new conversation over the stored history
        assert cid != cids[i]
    moved = {i for i, _, r, _, _ in served1 if r == victim_id}
    assert moved  # conversations the killed replica held went on elsewhere


def test_streaming_through_the_ingress(cluster):
    """A streamed answer comes through the ingress chunk by chunk, equal to the same request
    answered whole (greedy)."""
    url, _ = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "stream me something"}]
    whole = client.chat.completions.create(model="pensieve-demo", messages=msgs, max_tokens=12,
                                           temperature=0).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="pensieve-demo", messages=msgs, max_tokens=12, temperature=0, stream=True)
        if c.choices]
    assert len([p for p in parts if p]) > 1
    assert "".join(parts) == whole
