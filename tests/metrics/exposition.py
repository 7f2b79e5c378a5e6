"""Reading a gateway's /metrics the way Prometheus does: families, types and series."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Series = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Exposition:
    """One scrape of /metrics."""

    text: str
    types: dict[str, str]
    values: dict[Series, float]

    @property
    def series(self) -> frozenset[Series]:
        return frozenset(self.values)

    def total(self, sample_name: str, **labels: str) -> float:
        """Sum of the samples named `sample_name` whose labels include `labels`."""
        wanted = set(labels.items())
        return sum(v for (name, lbls), v in self.values.items() if name == sample_name and wanted <= set(lbls))

    def label_values(self, sample_name: str, label: str) -> set[str]:
        return {dict(lbls)[label] for (name, lbls) in self.values if name == sample_name and label in dict(lbls)}


def parse(text: str) -> Exposition:
    types: dict[str, str] = {}
    values: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        # the parser names a counter family without `_total`; DESIGN names it with it
        name = family.name + "_total" if family.type == "counter" else family.name
        types[name] = family.type
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Exposition(text, types, values)


def scrape(base_url: str) -> Exposition:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        assert resp.status == 200
        return parse(resp.read().decode())
