"""The metrics board: one small deployment (one replica, no CPU reserved) that every engine replica pushes its
Prometheus metric families to (each series labelled with its `replica`), so that `GET /metrics` of the Ray app is
one scrape covering every replica. A replica that stopped pushing for `stale_after` seconds (it died or was
replaced) drops out, as a Prometheus target that is gone does; a replica that shuts down says so at once.

Families are merged by name (the first report's help text and type, every replica's samples), so the text is
valid exposition format: each family once, with all its series.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric


class MetricsBoard:
    def __init__(self, stale_after: float = 10.0):
        self.stale_after = stale_after
        self.reports: dict[str, tuple[float, list]] = {}  # replica → (when, its metric families)

    def report(self, replica: str, families: list) -> None:
        self.reports[replica] = (time.monotonic(), families)

    def forget(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def render(self) -> tuple[bytes, str]:
        """Every live replica's families as one exposition text, and its content type."""
        self._drop_stale()
        registry = CollectorRegistry()
        registry.register(_Merged([families for _, families in self.reports.values()]))
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for replica in [r for r, (when, _) in self.reports.items() if now - when > self.stale_after]:
            del self.reports[replica]


class _Merged:
    def __init__(self, reports: list[list]):
        self.reports = reports

    def describe(self):
        return []

    def collect(self):
        merged: dict[str, Metric] = {}
        for families in self.reports:
            for family in families:
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name].samples.extend(family.samples)
        return list(merged.values())
