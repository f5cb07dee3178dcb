"""``/metrics`` of the replicas as one Prometheus page: every sample of every replica, with a
``replica`` label naming the replica it came from (sum over it to aggregate)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    def __init__(self, pages: dict[str, str]) -> None:
        self.pages = pages

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.pages.items()):
            for fam in text_string_to_metric_families(text):
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                         fam.unit)
                merged.samples += [s._replace(labels={**s.labels, "replica": replica})
                                   for s in fam.samples]
        yield from families.values()


def merge_pages(pages: dict[str, str]) -> bytes:
    """One exposition of ``pages`` (replica id -> its ``/metrics`` text), labelled by replica."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(pages))  # type: ignore[arg-type]
    return generate_latest(registry)
