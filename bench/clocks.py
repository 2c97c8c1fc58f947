"""What a clock read costs on this host, next to a fixed pure-Python reference.

The hook reads ``time.monotonic_ns()`` for every step record, and its benchmark profiler
brackets each window with ``time.perf_counter_ns()``. Those reads are cheap only when the
kernel's clocksource can be read from user space (vDSO: ``tsc``, ``kvm-clock``); on a host whose
clocksource falls back to a syscall, each read costs a microsecond or more, and an empty
profiler window is no longer empty. This prints the clocksource, the cost of one read of each
clock, and the cost of an empty window as the profiler opens and closes it, so the hook's
numbers can be read against the host they were measured on.

    python bench/clocks.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

CLOCKSOURCE = Path("/sys/devices/system/clocksource/clocksource0")
READS = 1000  # per batch: the loop's own cost is measured and taken off
BATCHES = 200


def clocksource() -> tuple[str, str]:
    """The kernel's current and available clocksources ("?" where not readable)."""
    out = []
    for name in ("current_clocksource", "available_clocksource"):
        try:
            out.append((CLOCKSOURCE / name).read_text().strip())
        except OSError:
            out.append("?")
    return out[0], out[1]


def per_call_ns(fn: Callable[[], object]) -> float:
    """Median over batches of one call's cost, less the cost of calling a no-op the same way."""

    def batch(f: Callable[[], object]) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(READS):
            f()
        return (time.perf_counter_ns() - t0) / READS

    noop = statistics.median(batch(lambda: None) for _ in range(BATCHES))
    return statistics.median(batch(fn) for _ in range(BATCHES)) - noop


def empty_window_ns() -> tuple[float, float]:
    """p50 and p99 of a window with nothing in it, opened and closed as the hook's profiler does."""
    samples = []
    for _ in range(BATCHES * 50):
        cpu = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        wall = time.perf_counter_ns() - t0
        time.thread_time_ns() - cpu
        samples.append(wall)
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def reference_ns() -> float:
    """The profiler's pure-Python reference, ``sum(range(200))``, warm (median, ns)."""
    samples = []
    for _ in range(BATCHES * 10):
        t0 = time.perf_counter_ns()
        sum(range(200))
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples)


def main() -> None:
    current, available = clocksource()
    window_p50, window_p99 = empty_window_ns()
    rows = [
        ("clocksource", f"{current} (available: {available})"),
        ("time.monotonic_ns()", f"{per_call_ns(time.monotonic_ns):.0f} ns"),
        ("time.perf_counter_ns()", f"{per_call_ns(time.perf_counter_ns):.0f} ns"),
        ("time.thread_time_ns()", f"{per_call_ns(time.thread_time_ns):.0f} ns"),
        ("empty profiler window, wall p50 / p99", f"{window_p50:.0f} / {window_p99:.0f} ns"),
        ("pure-Python reference sum(range(200)), warm", f"{reference_ns():.0f} ns"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"| {'what':<{width}} | measured |")
    print(f"|{'-' * (width + 2)}|----------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")


if __name__ == "__main__":
    main()
