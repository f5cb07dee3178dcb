"""Prometheus metrics: engine state read from the engine thread's snapshot, plus latencies."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pensieve.server.async_engine import EngineClient
from pensieve.server.vllm_compat import VllmAliases
from pensieve.server.vllm_fields import RecordedFields

_SOURCES = {"gpu_hit": "gpu_hit_tokens", "cpu_hit": "cpu_hit_tokens",
            "disk_hit": "disk_hit_tokens", "shared_hit": "shared_hit_tokens",
            "recomputed": "recomputed_tokens",
            "new": "new_prompt_tokens"}


def _by_label(name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    """A counter of one label, one sample per ``values`` item (label value -> count)."""
    c = CounterMetricFamily(name, doc, labels=[label])
    for value, count in values.items():
        c.add_metric([value], count)
    return c


def _by_kind(st: Mapping[str, float], name: str, doc: str, prefill: str, decode: str) -> Metric:
    """A counter labelled ``kind``: prefill steps' ``st[prefill]`` and decode steps'
    ``st[decode]``."""
    return _by_label(name, doc, "kind", {"prefill": st.get(prefill, 0),
                                         "decode": st.get(decode, 0)})


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot
        st = snap.stats or {}
        g = GaugeMetricFamily("pensieve_requests_running", "Requests holding KV and computing")
        g.add_metric([], snap.running)
        yield g
        g = GaugeMetricFamily("pensieve_requests_waiting", "Requests queued for admission")
        g.add_metric([], snap.waiting)
        yield g
        yield _by_label("pensieve_prompt_tokens", "Context tokens of admitted turns, by where "
                        "their KV came from", "source",
                        {label: st.get(key, 0) for label, key in _SOURCES.items()})
        yield _by_label("pensieve_swap_bytes", "Bytes copied between the tiers", "direction",
                        {"in": st.get("swap_in_bytes", 0), "out": st.get("swap_out_bytes", 0)})
        c = CounterMetricFamily("pensieve_dropped_tokens", "KV tokens dropped from both tiers")
        c.add_metric([], st.get("dropped_tokens", 0))
        yield c
        c = CounterMetricFamily("pensieve_suspended_requests", "Requests suspended mid-decode")
        c.add_metric([], st.get("suspended_requests", 0))
        yield c
        used = GaugeMetricFamily("pensieve_blocks_used", "KV blocks in use", labels=["tier"])
        total = GaugeMetricFamily("pensieve_blocks_total", "KV blocks", labels=["tier"])
        usage = GaugeMetricFamily("pensieve_kv_cache_usage_ratio", "Fraction of the tier's KV "
                                  "blocks in use (0 to 1)", labels=["tier"])
        held = GaugeMetricFamily("pensieve_kv_bytes_held", "Bytes of KV held, by tier (the "
                                 "disk tier: its chunk files' payloads)", labels=["tier"])
        for tier in ("gpu", "cpu", "disk"):
            t = st.get(f"{tier}_blocks_total", 0)
            u = t - st.get(f"{tier}_blocks_free", 0)
            used.add_metric([tier], u)
            total.add_metric([tier], t)
            usage.add_metric([tier], u / t if t else 0.0)
            held.add_metric([tier], u * st.get("kv_block_bytes", 0))
        yield used
        yield total
        yield usage
        yield held
        blocks = st.get("shared_blocks", 0)
        g = GaugeMetricFamily("pensieve_prefix_sharing_ratio", "Chunks holding a registered GPU "
                              "block per such block (registered: of conversations whose first "
                              "chunk another turn has had too; 0: none)")
        g.add_metric([], st.get("shared_block_refs", 0) / blocks if blocks else 0.0)
        yield g
        yield _by_label("pensieve_disk_bytes", "Bytes written to and read from the disk tier's "
                        "files", "direction", {"write": st.get("disk_write_bytes", 0),
                                               "read": st.get("disk_read_bytes", 0)})
        yield CounterMetricFamily("pensieve_disk_read_busy_seconds", "Time the disk tier's "
                                  "readers were reading (bytes read over it: the rate they "
                                  "reach together, which the read-or-recompute choice uses)",
                                  value=st.get("disk_read_busy_us", 0) / 1e6)
        yield CounterMetricFamily("pensieve_disk_read_wait_seconds", "Time queued turns "
                                  "waited for their disk reads, summed over the turns",
                                  value=st.get("disk_read_wait_us", 0) / 1e6)
        yield CounterMetricFamily("pensieve_disk_read_waits", "Queued turns that waited for "
                                  "disk reads", value=st.get("disk_read_waits", 0))
        yield CounterMetricFamily("pensieve_disk_reads_skipped", "Chunk files not read back "
                                  "because recomputing them was judged sooner",
                                  value=st.get("disk_reads_skipped", 0))
        yield _by_label("pensieve_disk_write_buffers_made", "Write buffers made on the step "
                        "(the pool was empty) and ahead of it by the refill thread", "where",
                        {"step": st.get("disk_buffers_made_step", 0),
                         "ahead": st.get("disk_buffers_made_ahead", 0)})
        yield _by_label("pensieve_disk_chunks_copied_out", "Chunks copied out of the KV tiers "
                        "for disk writes: on the step path (spilled) or beside a step's compute "
                        "(written ahead of their spill)", "when",
                        {"spill": st.get("disk_spill_copies", 0),
                         "ahead": st.get("disk_ahead_copies", 0)})
        yield from _remote_metrics(st)
        g = GaugeMetricFamily("pensieve_defer_admission_steps", "Setting: steps a turn short of "
                              "GPU blocks may wait for background swap-outs (--defer-admission)")
        g.add_metric([], st.get("defer_admission", 0))
        yield g
        yield from _step_metrics(snap.steps or {})


def _remote_metrics(st: Mapping[str, float]) -> Iterator[Metric]:
    """The shared KV tier's counters (``--kv-remote``; zeros without one): its hits (context
    tokens and bytes restored from it, also counted as ``disk_hit`` above), and values and
    bytes read and written (``rate()`` of these is the read and write rate)."""
    yield CounterMetricFamily("pensieve_remote_hit_tokens", "Context tokens of admitted "
                              "turns whose KV came from the shared KV tier",
                              value=st.get("remote_hit_tokens", 0))
    yield CounterMetricFamily("pensieve_remote_hit_bytes", "Bytes of KV restored from the "
                              "shared KV tier", value=st.get("remote_hit_bytes", 0))
    yield _by_label("pensieve_remote_bytes", "Bytes read from and written to the shared KV "
                    "tier", "direction", {"read": st.get("remote_read_bytes", 0),
                                          "write": st.get("remote_write_bytes", 0)})
    yield _by_label("pensieve_remote_chunks", "Chunk values read from and written to the "
                    "shared KV tier", "direction", {"read": st.get("remote_reads", 0),
                                                    "write": st.get("remote_writes", 0)})
    yield _by_label("pensieve_remote_errors", "Shared KV tier failures: values that failed "
                    "their check or calls the store failed (read), writes that failed "
                    "(write); each a chunk recomputed or not shared", "direction",
                    {"read": st.get("remote_read_errors", 0),
                     "write": st.get("remote_write_errors", 0)})
    g = GaugeMetricFamily("pensieve_remote_up", "1 while the shared KV tier is in use, 0 "
                          "while it is left alone after an error (or there is none)")
    g.add_metric([], st.get("remote_up", 0))
    yield g


def _step_metrics(st: dict[str, float]) -> Iterator[Metric]:
    """The engine's own step accounting (``StepTotals``): what a benchmark differences over its
    window to get per-token step costs and host time per step."""
    yield _by_label("pensieve_steps", "Engine steps, by whether they computed prefill tokens",
                    "kind", {"prefill": st.get("prefill_steps", 0),
                             "decode": st.get("steps", 0) - st.get("prefill_steps", 0)})
    yield _by_label("pensieve_graph_steps", "Engine steps replayed from CUDA graphs (the rest "
                    "ran eagerly), by step kind", "kind",
                    {"prefill": st.get("prefill_graph_steps", 0),
                     "decode": st.get("graph_steps", 0) - st.get("prefill_graph_steps", 0)})
    yield CounterMetricFamily("pensieve_decode_split_span_steps", "Engine steps whose decode "
                              "attention split KV by span (ragged contexts)",
                              value=st.get("split_span_steps", 0))
    yield _by_kind(st, "pensieve_step_execute_seconds", "Executor time of engine steps (swaps, "
                   "forward, sampling), by step kind", "prefill_step_execute_s",
                   "decode_step_execute_s")
    for phase, what in (("prepare", "before its forward was launched (swaps issued, inputs "
                                    "built)"),
                        ("issue", "until its whole forward was issued, before the wait for "
                                  "the sampled tokens")):
        yield _by_kind(st, f"pensieve_step_host_{phase}_seconds",
                       f"The runner's host time in engine steps, {what}; by step kind",
                       f"prefill_step_{phase}_s", f"decode_step_{phase}_s")
    yield _by_kind(st, "pensieve_computed_tokens", "Tokens computed, prefill (prompts and "
                   "recomputed history) or decode", "prefill_tokens", "decode_tokens")
    yield _by_label("pensieve_scheduler_seconds", "Host time of the scheduler, by phase", "phase",
                    {"schedule": st.get("schedule_s", 0.0), "update": st.get("update_s", 0.0)})
    yield _by_label("pensieve_disk_plan_seconds", "Time steps spent carrying out their disk "
                    "plan before the forward (sync: waiting for copies into the CPU tier; out: "
                    "spilled chunks copied into write buffers; in: restored chunks copied into "
                    "CPU blocks)", "part",
                    {k: st.get(f"disk_{k}_s", 0.0) for k in ("sync", "out", "in")})
    yield _by_label("pensieve_swap_chunks", "Chunks planned between the tiers", "kind",
                    {"in": st.get("swap_in_chunks", 0), "out": st.get("swap_out_chunks", 0),
                     "out_urgent": st.get("urgent_swap_out_chunks", 0)})


class Metrics:
    """One registry per server."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        engine_collector = _EngineCollector(engine)
        self.registry.register(engine_collector)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("pensieve_time_to_first_token_seconds", "Time to first token",
                              buckets=buckets, registry=self.registry)
        self.latency = Histogram("pensieve_e2e_request_latency_seconds",
                                 "Request latency, arrival to last token", buckets=buckets,
                                 registry=self.registry)
        token_buckets = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                         0.3, 0.5, 0.75, 1, 2.5, 5, 10)
        self.tpot = Histogram("pensieve_time_per_output_token_seconds", "Per request: time "
                              "from the first to the last token over the tokens after the "
                              "first", buckets=token_buckets, registry=self.registry)
        self.itl = Histogram("pensieve_inter_token_latency_seconds", "Time between two "
                             "consecutive tokens of a request, as the server received them",
                             buckets=token_buckets, registry=self.registry)
        self.generation_tokens = Counter("pensieve_generation_tokens", "Tokens generated "
                                         "(completed and stop-string turns)",
                                         registry=self.registry)
        self.queued = Gauge("pensieve_requests_queued", "Requests accepted that have not "
                            "produced their first token", registry=self.registry)
        self.rejected = Counter("pensieve_requests_rejected", "Requests refused with a 429 "
                                "(--max-queued-requests)", registry=self.registry)
        self.recorded = RecordedFields(self.registry)
        self.registry.register(VllmAliases([engine_collector, self.ttft, self.latency,
                                            self.tpot, self.itl, self.generation_tokens]))
