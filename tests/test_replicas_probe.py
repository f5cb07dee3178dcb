"""Affinity holds when Ray Serve's queue-length probes miss their deadline (replicas/router.py).

On a busy host a replica can answer Ray Serve's queue-length probe later than its deadline
(0.1 s) while alive and well. Ray Serve then moved the request to the next rank, and a continued
turn lost its KV. Here every probe's deadline starts at 2 ms and the queue-length cache is off
(every request is routed by probing), so probes miss it all the time; every continued turn must
still be served from cache, on its conversation's replica. (With the router before
``ranks_to_offer`` this test failed: 14 of the 24 continued turns went to the other replica
and had no cached tokens.)
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="the replicas extra is not installed")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("openai")

from test_replicas import _run, serve_args, wait_for_replicas  # noqa: E402

from pensieve.replicas.serve import build_application  # noqa: E402

SLOW_PROBES = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "0.002",
               "RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "0"}


@pytest.fixture(scope="module")
def slow_probe_cluster(tmp_path_factory):
    """Two replicas on a Ray instance of their own, started with :data:`SLOW_PROBES` (its
    processes read them when Ray Serve is imported there)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = str(tmp_path_factory.mktemp("replicas_probe") / "conv.db")
    saved = {k: os.environ.get(k) for k in SLOW_PROBES}
    os.environ.update(SLOW_PROBES)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(serve_args(store), replica_cpus=1),
                  name="pensieve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for_replicas(url, 2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_every_continued_turn_hits_when_probes_are_late(slow_probe_cluster):
    _, served = _run(slow_probe_cluster, range(12), 3)
    assert len(served) == 12 * 3
    misses = [(i, t, replica) for i, t, replica, cached, _ in served if t > 0 and cached == 0]
    assert not misses, f"continued turns served without cached tokens: {misses}"
    by_conv: dict[int, set] = {}
    for i, _, replica, _, _ in served:
        by_conv.setdefault(i, set()).add(replica)
    assert all(len(r) == 1 for r in by_conv.values()), by_conv
    assert len({r for _, _, r, _, _ in served}) == 2  # both replicas served
