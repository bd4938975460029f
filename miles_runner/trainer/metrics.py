"""Accumulating a training step's metrics over micro-batches."""

from __future__ import annotations

from collections import defaultdict


class MetricMeans:
    """Weighted means (e.g. by token count) and plain sums, merged into one dict at the end."""

    def __init__(self) -> None:
        self._weighted: dict[str, float] = defaultdict(float)
        self._weights: dict[str, float] = defaultdict(float)
        self._sums: dict[str, float] = defaultdict(float)

    def add(self, values: dict[str, float], weight: float) -> None:
        for key, value in values.items():
            self._weighted[key] += value * weight
            self._weights[key] += weight

    def add_sum(self, key: str, value: float) -> None:
        self._sums[key] += value

    def result(self) -> dict[str, float]:
        means = {k: v / self._weights[k] for k, v in self._weighted.items() if self._weights[k] > 0}
        return {**means, **self._sums}
