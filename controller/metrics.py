"""Service metrics: plain counters on the hot path, a Prometheus text endpoint beside it.

The service only bumps Python ints and list slots (:class:`ServiceStats`), a few tens of ns
each; prometheus-client is imported only when ``--metrics-port`` is given, and its collector
reads those counters at scrape time from the HTTP thread, through a private
``CollectorRegistry`` (never the process-global one, so several servers or tests in one
process do not collide).

Exposed (all prefixed ``specdepth_``):

==========================================  ======================================================
metric                                      meaning
==========================================  ======================================================
``frames_received_total``                   frames read from the socket, valid or not
``steps_received_total``                    valid ``step`` records (each got a decision)
``hellos_received_total``                   valid ``hello`` messages
``decisions_total{depth}``                  decisions sent, by depth
``errors_total{code}``                      ``error`` replies sent, by protocol error code
``replies_dropped_total``                   replies ZeroMQ could not queue (peer gone or full)
``decision_latency_seconds``                histogram: message received → decision sent
``instances_connected``                     instances with a live session (hello seen, not evicted)
``instances_evicted_total``                 sessions dropped to keep memory bounded
``spin_seconds_total``                      time hybrid polling spent on a coming step: polling
                                            without sleeping, and warming the path
==========================================  ======================================================
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from controller.protocol import ERROR_CODES

# Decision-latency bucket upper bounds, ns. Dense around the 20/50 µs targets.
LATENCY_BUCKETS_NS: tuple[int, ...] = (
    5_000,
    10_000,
    15_000,
    20_000,
    30_000,
    50_000,
    75_000,
    100_000,
    250_000,
    1_000_000,
    10_000_000,
)


class ServiceStats:
    """The service's counters. Single writer (the serving thread); readers copy."""

    def __init__(self) -> None:
        self.frames = 0
        self.steps = 0
        self.hellos = 0
        self.replies_dropped = 0
        self.evicted = 0
        self.instances = 0
        self.decisions: dict[int, int] = {}
        self.errors: dict[str, int] = dict.fromkeys(ERROR_CODES, 0)
        self.latency_counts = [0] * (len(LATENCY_BUCKETS_NS) + 1)  # last slot: +Inf
        self.latency_sum_ns = 0
        self.spin_ns = 0  # hybrid polling: time spent polling without sleeping
        self.policy = ""  # the served policy's name and objective, for the info metric
        self.objective = "throughput"

    def observe_latency(self, ns: int) -> None:
        """Count one decision latency (ns) in its histogram bucket."""
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_NS, ns)] += 1
        self.latency_sum_ns += ns

    def count_error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def count_decision(self, depth: int) -> None:
        self.decisions[depth] = self.decisions.get(depth, 0) + 1

    def latency_quantile_ns(self, q: float) -> float:
        """Bucket upper bound at quantile ``q`` (coarse; for logs, not for benchmarks)."""
        total = sum(self.latency_counts)
        if not total:
            return float("nan")
        need, run = q * total, 0
        for i, c in enumerate(self.latency_counts):
            run += c
            if run >= need:
                return float(LATENCY_BUCKETS_NS[i]) if i < len(LATENCY_BUCKETS_NS) else float("inf")
        return float("inf")


class _Collector:
    """Turns a :class:`ServiceStats` into Prometheus metric families at scrape time."""

    def __init__(self, stats: ServiceStats) -> None:
        self.stats = stats

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families are produced at collect time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        s = self.stats
        p = "specdepth_"
        yield CounterMetricFamily(
            p + "frames_received", "Frames read from the socket, valid or not", s.frames
        )
        yield CounterMetricFamily(p + "steps_received", "Valid step records received", s.steps)
        yield CounterMetricFamily(p + "hellos_received", "Valid hello messages received", s.hellos)
        yield CounterMetricFamily(
            p + "replies_dropped", "Replies ZeroMQ could not queue (peer gone or full)", s.replies_dropped
        )
        yield CounterMetricFamily(
            p + "instances_evicted", "Instance sessions dropped to keep memory bounded", s.evicted
        )
        decisions = CounterMetricFamily(p + "decisions", "Decisions sent, by depth", labels=["depth"])
        for depth, n in sorted(dict(s.decisions).items()):  # dict() copies atomically under the GIL
            decisions.add_metric([str(depth)], n)
        yield decisions
        errors = CounterMetricFamily(
            p + "errors", "Error replies sent, by protocol error code", labels=["code"]
        )
        for code, n in sorted(dict(s.errors).items()):
            errors.add_metric([code], n)
        yield errors
        counts = list(s.latency_counts)
        buckets, run = [], 0
        for bound, c in zip(LATENCY_BUCKETS_NS, counts):
            run += c
            buckets.append((f"{bound / 1e9:g}", run))
        buckets.append(("+Inf", run + counts[-1]))
        yield HistogramMetricFamily(
            p + "decision_latency_seconds",
            "Message received to decision sent, inside the controller",
            buckets=buckets,
            sum_value=s.latency_sum_ns / 1e9,
        )
        info = GaugeMetricFamily(
            p + "policy_info", "The served policy and the objective it was trained for", labels=["policy", "objective"]
        )
        info.add_metric([s.policy, s.objective], 1.0)
        yield info
        yield GaugeMetricFamily(p + "instances_connected", "Instances with a live session", s.instances)
        yield CounterMetricFamily(
            p + "spin_seconds",
            "Time hybrid polling spent on coming steps: polling without sleeping, warming the path",
            s.spin_ns / 1e9,
        )


def make_registry(stats: ServiceStats) -> Any:
    """A private prometheus ``CollectorRegistry`` exposing ``stats``."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(stats))  # type: ignore[arg-type]
    return registry


def render(stats: ServiceStats) -> str:
    """The Prometheus text exposition of ``stats`` (what the endpoint serves)."""
    from prometheus_client import generate_latest

    return generate_latest(make_registry(stats)).decode()


def start_metrics_server(stats: ServiceStats, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``stats`` as Prometheus text on ``http://addr:port/metrics`` from a daemon thread.

    Returns the HTTP server (call ``.shutdown()`` to stop it). Raises ``OSError`` if the port
    cannot be bound.
    """
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=addr, registry=make_registry(stats))
    return server
