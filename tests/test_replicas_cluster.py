"""Replicas on a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``) sharing a
PostgreSQL store: one replica per node, conversations served with their KV on both nodes;
then the second node is removed and the conversations it held continue on the first, their
history read from PostgreSQL (the KV recomputed), every turn stored."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the replicas extra is not installed")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("psycopg")
openai = pytest.importorskip("openai")

from pg_server import postgres_url  # noqa: E402
from test_replicas import _run, serve_args, wait_for_replicas  # noqa: E402

from pensieve.replicas.serve import NODE_HEADER, build_application  # noqa: E402
from pensieve.server.store_open import open_store  # noqa: E402


@pytest.mark.slow  # a two-node Ray cluster and a PostgreSQL server
def test_two_nodes_postgres_store():
    import socket

    from ray.cluster_utils import Cluster

    with postgres_url() as url:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"head": 1}, "include_dashboard": False})
        worker = cluster.add_node(num_cpus=1, resources={"worker": 1})
        try:
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            # a free port picked once PostgreSQL and the cluster hold theirs (picked before
            # them, one of theirs once took it: "Failed to bind")
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            serve.start(proxy_location="HeadOnly",
                        http_options={"host": "127.0.0.1", "port": port})
            app = build_application(serve_args(url), replica_cpus=1, max_replicas_per_node=1,
                                    ingress_actor_options={"num_cpus": 0,
                                                           "resources": {"head": 0.01}})
            serve.run(app, name="pensieve", route_prefix="/")
            base = f"http://127.0.0.1:{port}"
            wait_for_replicas(base, 2)
            headers: list = []
            # 8 conversations, 2 turns; then 2 more turns each after the second node is gone.
            # Affinity puts all 8 on one node once in 128 (rendezvous over random replica
            # ids): more conversations start, 4 at a time, until both nodes have served.
            results, served = _run(base, range(8), 2, headers=headers)
            while len({h[NODE_HEADER] for h in headers}) < 2 and len(results) < 32:
                more, more_served = _run(base, range(len(results), len(results) + 4), 2,
                                         headers=headers)
                results, served = results + more, served + more_served
            for i, t, _, cached, _ in served:
                assert t == 0 or cached > 0, (i, t)
            assert len({h[NODE_HEADER] for h in headers}) == 2  # both nodes served
            cluster.remove_node(worker)
            n = len(results)
            results2, served2 = _run(base, range(n), 4, histories=[m for m, _ in results])
            assert len(served2) == n * 2
            store = open_store(url)
            try:
                for (msgs, cid), (_, cid0) in zip(results2, results):
                    assert cid != cid0  # a new conversation over the history in PostgreSQL
                    conv = store.get(cid)
                    assert conv is not None and len(conv.turns) == 4 and conv.messages == msgs
            finally:
                store.close()
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()
