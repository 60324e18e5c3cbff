"""The offline engine's metric sinks (engine.metrics records into them), in memory, and what
`LLM.get_metrics()` returns from them: vLLM's reader types (vllm.v1.metrics.reader), one
`Gauge`, `Counter` or `Histogram` per series, each with its name and labels:

    for m in llm.get_metrics():
        if isinstance(m, Histogram):
            print(m.name, m.count, m.sum, m.buckets)    # buckets: upper bound -> cumulative count
        else:
            print(m.name, m.labels, m.value)

The names are the server's (`kvserve_x` where vLLM says `vllm:x`, engine.metrics), without the
`ray_` prefix and `_total` suffix its Prometheus export adds.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.metrics import METRICS, MODEL_NAME, ZERO_TAGS, MetricSpec


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Counter(Metric):
    value: float  # a count, or seconds (kvserve_engine_step_seconds)


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # each upper bound, "+Inf" last -> observations at or under it


class _Series:
    """One metric's series by their labels (the model's and the tags an update gives)."""

    def __init__(self, spec: MetricSpec, model_name: str) -> None:
        self.spec, self.model_name = spec, model_name
        self.values: dict[tuple[tuple[str, str], ...], object] = {}

    def _key(self, tags: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
        return tuple(sorted({MODEL_NAME: self.model_name, **(tags or {})}.items()))


class _Gauge(_Series):
    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags)] = value

    def read(self) -> list[Metric]:
        return [Gauge(self.spec.name, dict(k), v) for k, v in self.values.items()]


class _Counter(_Series):
    def __init__(self, spec: MetricSpec, model_name: str) -> None:
        super().__init__(spec, model_name)
        for tags in ZERO_TAGS.get(spec.name, [{}]):  # every series from 0, as the server exports them
            self.values[self._key(tags)] = 0

    def inc(self, value: float = 1, tags: dict[str, str] | None = None) -> None:
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0) + value

    def read(self) -> list[Metric]:
        return [Counter(self.spec.name, dict(k), v) for k, v in self.values.items()]


class _Histogram(_Series):
    def __init__(self, spec: MetricSpec, model_name: str) -> None:
        super().__init__(spec, model_name)
        self._entry(self._key(None))  # empty from the start, as vLLM's are

    def _entry(self, key: tuple[tuple[str, str], ...]) -> list:
        """[count per bucket (+Inf last), sum] of one series, made on first use."""
        if key not in self.values:
            self.values[key] = [[0] * (len(self.spec.buckets) + 1), 0.0]
        return self.values[key]

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        entry = self._entry(self._key(tags))
        entry[0][bisect.bisect_left(self.spec.buckets, value)] += 1  # the first bound >= value
        entry[1] += value

    def read(self) -> list[Metric]:
        out = []
        bounds = [_go_float(b) for b in self.spec.buckets] + ["+Inf"]
        for key, (counts, total) in self.values.items():
            cumulative, running = {}, 0
            for bound, n in zip(bounds, counts):
                running += n
                cumulative[bound] = running
            out.append(Histogram(self.spec.name, dict(key), running, total, cumulative))
        return out


def _go_float(x: float) -> str:
    """A bucket bound as Prometheus writes its `le` label (Go's shortest form: 0.005, 1.0, 1e+06)."""
    s = repr(float(x))
    dot = s.find(".")
    if dot > 6 and "e" not in s:  # Go writes an exponent from 1e21 down to 1e6 where Python does not
        return f"{(s[0] + '.' + s[1:dot] + s[dot + 1:]).rstrip('0').rstrip('.')}e+{dot - 1:02d}"
    return s


_KINDS = {"Gauge": _Gauge, "Counter": _Counter, "Histogram": _Histogram}


class MemorySinks(dict):
    """metric name -> its in-memory sink, for every metric the engine records (engine.metrics)."""

    def __init__(self, model_name: str) -> None:
        super().__init__((spec.name, _KINDS[spec.kind](spec, model_name)) for spec in METRICS)

    def read(self) -> list[Metric]:
        """Every series now, in METRICS' order (a gauge once it was set)."""
        return [m for sink in self.values() for m in sink.read()]
