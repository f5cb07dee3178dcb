"""The Ray Serve application: an ingress deployment and N engine replicas.

::

    client --HTTP--> Ray Serve proxy --> Ingress (reads the body, routing key)
                                           |  handle.handle_http.remote(..., routing_key=key)
                                           v  AffinityRequestRouter picks the replica
                           EngineReplica 0 .. N-1 (the server app each, one shared store)

Ray Serve's proxy hands a deployment the ASGI scope but not the body, so the key (which
depends on the messages) is computed by a small ingress deployment, as Ray Serve LLM's own
OpenAI ingress does before its prefix-aware router. The ingress is no HTTP server of ours: it
forwards the request to the chosen replica as a Ray call and streams the answer back.

A replica that dies takes its in-flight requests with it; the ingress retries a request on the
key's next replica (Ray Serve drops the dead one from the router) until it has the whole
answer (an event stream: its first chunk), and the new replica finds the conversation's
history in the shared store and recomputes its KV. A turn is stored before its answer is sent,
so a replica may die between the two: the ingress gives every request a key, the same on its
retries (``x-pensieve-request-key``), the turn is stored with it, and a retry finding its key on
the conversation's last turn redoes that turn in place (:mod:`pensieve.server.turns`): the
stored turn is the answer the client gets, and no completed turn is lost. The answer's
``x-pensieve-attempts`` header counts the replicas tried.
"""

# No ``from __future__ import annotations``: FastAPI must see the handlers' real types
# (``Request``) through Ray Serve's class-based ingress.

import argparse
import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from pensieve.core.routing import DEFAULT_SPILL_TOKENS, conversation_key
from pensieve.options import default_of, engine_options
from pensieve.replicas.asgi import REQUEST_KEY_HEADER, call_asgi, with_request_key
from pensieve.replicas.replica_metrics import merge_pages
from pensieve.replicas.router import WAITING_TOKENS
from pensieve.server import engine_ops
from pensieve.server.errors import error_response

log = logging.getLogger("pensieve.replicas")

ROUTER = "pensieve.replicas.router:AffinityRequestRouter"
REPLICA_HEADER = "x-pensieve-replica"
NODE_HEADER = "x-pensieve-node"
ATTEMPTS_HEADER = "x-pensieve-attempts"
_RETRIES = 5
ROUTING_STATS_PERIOD_S = 1.0
"""How often Ray Serve's controller asks each replica for its waiting tokens (with a shared KV
tier: the router's load; its own default is 10 s)."""
DRAIN_POLL_S = 0.5
"""How often a stopping replica (engine or ingress) looks whether its requests are done (Ray
Serve's ``graceful_shutdown_wait_loop_s``; its default of 2 s made every stop of an idle
application take ~4.5 s, the two deployments one after the other)."""


def routing_key(path: str, headers: dict[str, str], body: bytes) -> str:
    """The request's conversation key: ``conversation_id`` (body or ``X-Conversation-Id``)
    when given, else a hash of the messages up to the first user message (system prompt and
    first question: the same for every turn of a conversation whose client re-sends the
    history), for completions of the prompt; other paths: by their conversation id or none."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    cid = data.get("conversation_id") or headers.get("x-conversation-id")
    if path.startswith("/v1/conversations/"):
        cid = path.split("/")[3]
    if isinstance(cid, str) and cid:
        return conversation_key([], cid)
    msgs = data.get("messages")
    if isinstance(msgs, list):
        return conversation_key(msgs)  # its opening messages: the same on every turn
    if "prompt" in data:
        return conversation_key([json.dumps(data["prompt"])[:4096]])
    return ""


class EngineReplica:
    """One engine and its server app (:func:`pensieve.server.main.build_server`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from pensieve.server.main import build_server

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if engine_options(args).get("device") == "cpu":
            import torch

            torch.set_num_threads(max(1, int(getattr(args, "replica_cpus", 1))))
        app, self._close = build_server(args)
        self._engine = app.state.pensieve.engine
        self.app = with_request_key(app)
        self.replica = serve.get_replica_context().replica_id.unique_id
        import ray

        self.node = ray.get_runtime_context().get_node_id()

    async def handle_http(self, method: str, path: str, query: bytes,
                          headers: list[tuple[bytes, bytes]], body: bytes,
                          routing_key: str = "", replica_rank: int | None = None
                          ) -> AsyncIterator[Any]:
        """The app's answer to one request: ``("start", status, headers)``, then bytes."""
        extra = [(REPLICA_HEADER.encode(), self.replica.encode()),
                 (NODE_HEADER.encode(), self.node.encode())]
        async for item in call_asgi(self.app, method, path, query, headers, body, extra):
            yield item

    async def record_routing_stats(self) -> dict[str, int]:
        """Ray Serve's routing stats of this replica (the router's
        ``RunningReplica.routing_stats``): its engine's waiting prompt tokens, counted when
        asked (between two steps: :func:`pensieve.server.engine_ops.waiting_tokens`), not
        after every step. An engine that is gone raises: the controller keeps the last
        stats until the replica is replaced."""
        return {WAITING_TOKENS: await self._engine.call(engine_ops.waiting_tokens)}

    def __del__(self) -> None:
        close = getattr(self, "_close", None)
        if close is not None:
            close()


def _plain(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in headers]


def _streamed(start: tuple[Any, ...]) -> bool:
    """Whether an answer (its ``("start", status, headers)``) is an event stream."""
    return any(k == "content-type" and v.startswith("text/event-stream")
               for k, v in _plain(start[2]))


async def _body(gen: Any, head: list[Any], done: bool) -> AsyncIterator[bytes]:
    """An answer's body: the chunks read ahead in ``head`` (after its start), then the rest."""
    for chunk in head[1:]:
        yield chunk
    if not done:
        async for chunk in gen:
            yield chunk


async def read_answer(call: Callable[[], Any], retries: int = _RETRIES, backoff_s: float = 0.5
                      ) -> tuple[Any, list[Any], bool, int]:
    """A replica's answer to a request, ``call()`` sending it: (its stream, the items read,
    whether they are all of it, the replicas tried). Until the whole answer is read (an event
    stream: its first chunk), a replica that dies is replaced by the next ``call()``."""
    for attempt in range(retries):
        gen = call()
        head: list[Any] = []
        try:
            while True:
                head.append(await gen.__anext__())
                if isinstance(head[-1], bytes) and _streamed(head[0]):
                    return gen, head, False, attempt + 1
        except StopAsyncIteration:
            return gen, head, True, attempt + 1
        except (RayActorError, ActorUnavailableError) as e:
            log.warning("replica failed before answering (%s); retry %d", e, attempt + 1)
            await asyncio.sleep(backoff_s * (attempt + 1))
    raise RuntimeError("no replica answered")


def _ingress_app() -> FastAPI:
    return FastAPI(title="Pensieve replicas", openapi_url=None, docs_url=None, redoc_url=None)


_app = _ingress_app()


@serve.ingress(_app)
class Ingress:
    """Forwards every request to the engine replica its conversation key routes to."""

    def __init__(self, engine: Any, num_replicas: int) -> None:
        self.engine = engine
        self.num_replicas = num_replicas

    async def _answer(self, key: str, rank: int | None, method: str, path: str,
                      query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
                      ) -> tuple[Any, list[Any], bool, int]:
        """:func:`read_answer` of the request from the replica its key (or rank) picks."""
        kwargs: dict[str, Any] = {"routing_key": key}
        if rank is not None:
            kwargs = {"replica_rank": rank}
        return await read_answer(lambda: self.engine.options(stream=True).handle_http.remote(
            method, path, query, headers, body, **kwargs))

    @_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Every replica's ``/metrics``, each sample labelled with its ``replica``."""
        pages: dict[str, str] = {}
        for rank in range(self.num_replicas):
            gen, head, done, _ = await self._answer("", rank, "GET", "/metrics", b"",
                                                    list(request.headers.raw), b"")
            start = head[0]
            text = b"".join([chunk async for chunk in _body(gen, head, done)])
            if start[1] != 200:
                return Response(text, status_code=start[1], headers=dict(_plain(start[2])))
            pages[dict(_plain(start[2]))[REPLICA_HEADER]] = text.decode()
        return Response(merge_pages(pages), media_type="text/plain; version=0.0.4")

    @_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        url_path = "/" + path
        key = routing_key(url_path, {k.lower(): v for k, v in request.headers.items()}, body)
        # the request's key: the same on every retry (a client's own header is replaced)
        raw = [(k, v) for k, v in request.headers.raw if k.lower() != REQUEST_KEY_HEADER]
        raw.append((REQUEST_KEY_HEADER, uuid.uuid4().hex.encode()))
        try:
            gen, head, done, attempts = await self._answer(
                key, None, request.method, url_path, request.scope.get("query_string", b""),
                raw, body)
        except RuntimeError as e:
            return error_response(503, f"no replica could serve the request: {e}",
                                  "server_error", "no_replica")
        start = head[0]
        headers = [(k, v) for k, v in _plain(start[2]) if k != "content-length"]
        headers.append((ATTEMPTS_HEADER, str(attempts)))
        resp = StreamingResponse(_body(gen, head, done), status_code=start[1])
        resp.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        return resp


def router_kwargs(args: argparse.Namespace, load_factor: float = 1.25, min_load: int = 16
                  ) -> dict[str, Any]:
    """The router's ``request_router_kwargs``: with a shared KV tier (``--kv-remote``) the
    spill bound ``--route-spill-tokens`` (None: ``off``), else bounded load alone."""
    spill = None
    if engine_options(args).get("kv_remote"):
        spill = getattr(args, "route_spill_tokens", DEFAULT_SPILL_TOKENS)
    return {"load_factor": load_factor, "min_load": min_load, "spill_tokens": spill}


def build_application(args: argparse.Namespace, load_factor: float = 1.25,
                      min_load: int = 16, replica_cpus: float = 1.0,
                      max_replicas_per_node: int | None = None,
                      ingress_actor_options: dict[str, Any] | None = None,
                      routing_stats_period_s: float = ROUTING_STATS_PERIOD_S) -> Any:
    """The Ray Serve application of ``args.data_parallel_size`` replicas: one GPU each on
    CUDA, else ``replica_cpus`` CPUs each (at most ``max_replicas_per_node`` on a node);
    the replicas report their waiting tokens every ``routing_stats_period_s``."""
    import torch

    n = max(1, int(args.data_parallel_size))
    opts = engine_options(args)
    device = opts.get("device", default_of("device"))
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    tp = opts.get("tensor_parallel_size", default_of("tensor_parallel_size"))
    resources: dict[str, Any] = ({"num_gpus": max(1, tp)} if cuda
                                 else {"num_cpus": replica_cpus})
    args = argparse.Namespace(**{**vars(args), "replica_cpus": replica_cpus})
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=n, ray_actor_options=resources, max_ongoing_requests=10_000,
        max_replicas_per_node=max_replicas_per_node,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER,
            request_router_kwargs=router_kwargs(args, load_factor, min_load),
            request_routing_stats_period_s=routing_stats_period_s,
            request_routing_stats_timeout_s=max(10.0, 5 * routing_stats_period_s)),
    ).bind(args)
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1, ray_actor_options=ingress_actor_options or {"num_cpus": 0},
        max_ongoing_requests=10_000, graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
    return ingress.bind(engine, n)


def serve_replicas(args: argparse.Namespace) -> int:
    """``pensieve serve --data-parallel-size N``: start (or join, with ``RAY_ADDRESS``) Ray,
    run the application on ``--host``/``--port`` until interrupted."""
    import ray

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(args), name="pensieve", route_prefix="/")
    log.info("%d replicas serving on http://%s:%d", args.data_parallel_size, args.host,
             args.port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
