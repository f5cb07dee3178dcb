"""The server's state during an HTTP benchmark run, sampled from its Prometheus ``/metrics``.

:class:`MetricsScraper` fetches ``/metrics`` every ``interval_s`` on its own connection (never
held back by the benchmark's request slots) and keeps the latest values, which
:meth:`~pensieve.bench.http_engine.HTTPEngine.probe` returns: Pensieve's
``pensieve_blocks_used`` / ``pensieve_blocks_total`` per tier, ``pensieve_requests_running`` /
``_waiting``, swap bytes and dropped tokens; vLLM's ``vllm:num_requests_running`` /
``_waiting`` and KV cache usage. A server without ``/metrics`` (404) is simply not scraped.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httpx

from pensieve.bench.engine_api import Clock

log = logging.getLogger("pensieve.bench")

# Prometheus series read from /metrics: (name, label value or None) -> probe key
_SCRAPE = {
    ("pensieve_blocks_used", "gpu"): "gpu_blocks_used",
    ("pensieve_blocks_used", "cpu"): "cpu_blocks_used",
    ("pensieve_blocks_total", "gpu"): "gpu_blocks_total",
    ("pensieve_blocks_total", "cpu"): "cpu_blocks_total",
    ("pensieve_requests_running", None): "requests_running",
    ("pensieve_requests_waiting", None): "requests_waiting",
    ("pensieve_swap_bytes_total", "in"): "swap_in_bytes",
    ("pensieve_swap_bytes_total", "out"): "swap_out_bytes",
    ("pensieve_dropped_tokens_total", None): "dropped_tokens",
    ("vllm:num_requests_running", None): "requests_running",
    ("vllm:num_requests_waiting", None): "requests_waiting",
    ("vllm:gpu_cache_usage_perc", None): "gpu_cache_usage",
    ("vllm:kv_cache_usage_perc", None): "gpu_cache_usage",
}
_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')


def parse_metrics(text: str) -> dict[str, float]:
    """The probe values found in a Prometheus text exposition (see the module doc)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        label = None
        if labels:
            lm = re.search(r'(?:tier|direction)="([^"]*)"', labels)
            label = lm.group(1) if lm else None
        key = _SCRAPE.get((name, label)) or _SCRAPE.get((name, None))
        if key is None:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + v if name.startswith("vllm:num") else v
    return out


class MetricsScraper:
    """Scrapes a server's ``/metrics`` every ``interval_s`` (run :meth:`run` as a task on the
    HTTP client's event loop) and keeps the latest values."""

    def __init__(self, base_url: str, headers: dict[str, str], interval_s: float,
                 clock: Clock) -> None:
        self.base_url, self.headers = base_url, headers
        self.interval_s, self.clock = interval_s, clock
        self._probe: dict[str, float] = {}
        self._probe_t: float | None = None

    async def run(self) -> None:
        """Scrape until cancelled, or until the server answers 404 (it has no ``/metrics``)."""
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                     timeout=httpx.Timeout(10.0)) as client:
            while True:
                try:
                    r = await client.get("/metrics")
                    if r.status_code == 404:
                        log.info("the server has no /metrics: not scraping")
                        return
                    if r.status_code == 200:
                        self._probe = parse_metrics(r.text)
                        self._probe_t = self.clock.now()
                except httpx.HTTPError as e:
                    log.debug("metrics scrape failed: %s", e)
                await asyncio.sleep(self.interval_s)

    def probe(self) -> dict[str, float]:
        """The values of the latest scrape (empty before the first), with ``probe_age_s``: how
        old that scrape is."""
        out = dict(self._probe)
        if out and self._probe_t is not None:
            out["probe_age_s"] = round(self.clock.now() - self._probe_t, 3)
        return out


__all__ = ["MetricsScraper", "parse_metrics"]
