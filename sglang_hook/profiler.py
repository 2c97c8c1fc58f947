"""The hook's benchmark profiler: the hook's own time per decode step, on the entry rank.

Off unless ``$SPECDEPTH_PROFILE_OUT`` names a file (``bench/bench_hook.py`` and the GPU runs of
``bench/h200/run.py`` set it); then :class:`~sglang_hook.plugin.HookRuntime` owns one
:class:`HookProfiler`, and the hooks open a window (:meth:`HookProfiler.start`) around their
own work and close it (:meth:`HookProfiler.stop`) naming its call site. Per decode record it
appends the windows' sums (wall, thread CPU, by site, the longest, garbage collection inside
them) to a buffer, written as one JSON line per :data:`PROFILE_FLUSH_EVERY` records
(:data:`PROFILE_KEYS`). Without the variable nothing here runs and nothing is timed.

The CPU clock is a syscall, the wall clock is not (vDSO): each wall window opens after and
closes before the CPU clock's reads, so the wall numbers carry no syscall of the profiler.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

ENV_PROFILE_OUT = "SPECDEPTH_PROFILE_OUT"  # benchmark: per-step hook cost written here (entry rank)
# Benchmark: "alternate" reads the thread-CPU clock (a syscall) around the profiler's windows
# only in every other block of PROFILE_FLUSH_EVERY records, so the effect of the profiler's own
# syscalls on the wall time it measures shows side by side in one run; default "on".
ENV_PROFILE_CPU_CLOCK = "SPECDEPTH_PROFILE_CPU_CLOCK"
PROFILE_FLUSH_EVERY = 32
# What the benchmark profiler records per decode step (bench/bench_hook.py reads the same keys).
PROFILE_KEYS = (
    "hook_ns",
    "hook_cpu_ns",
    "record_cpu_ns",
    "polls",
    "ref_cpu_ns",
    "step_us",
    "bs",
    # hook_ns split by call site (wall): the step record (of which: the client's submit, a
    # socket visit or, with the client thread, a hand-over), the visits at the top of
    # scheduler iterations, the actuator wrapper.
    "rec_ns",
    "send_ns",
    "poll_ns",
    "wrap_ns",
    # Off the scheduler thread: the client thread's CPU time since the previous record, and
    # how long the newest record waited before its send (from its ts_ns).
    "sender_cpu_ns",
    "lag_ns",
    # Of hook_ns: Python's cyclic garbage collector running inside the hook's windows. A
    # collection runs where the allocation count crosses its threshold (3.12: at the next
    # function call or loop jump after that), so the hook's first call after SGLang's own
    # allocations can host a collection whose work is SGLang's young objects.
    "gc_ns",
    # The longest single window of the record and its site, an index into PROFILE_SITES (0 the
    # record, 2 an iteration top, 3 the wrapper): tells a tail made of one slow window
    # (something else ran on the core) from one made of many cold ones.
    "max_window_ns",
    "max_window_site",
    # 1 where the thread-CPU clock was read around this record's windows (the *_cpu_ns keys
    # and the reference are 0 where it was not: see ENV_PROFILE_CPU_CLOCK).
    "cpu_clock",
    # Per scheduler iteration instead of per decode record (lists of their own length): the
    # hook's wall time from one iteration top to the next, for iterations that processed a
    # batch result (decode or prefill), and whether that result was a decode.
    "iter_ns",
    "iter_decode",
)


PROFILE_SITES = ("rec", "send", "poll", "wrap")  # the profiler's call sites, as max_window_site numbers


class HookProfiler:
    """Per decode record, the hook's windows on the scheduler thread (see the module docstring).

    Args:
        path: the JSON-lines file records are appended to.
        cpu_clock_alternate: read the thread-CPU clock only in every other block of
            :data:`PROFILE_FLUSH_EVERY` records (``$SPECDEPTH_PROFILE_CPU_CLOCK=alternate``).
        counters: the hook's counters at flush time, written with each line.
    """

    def __init__(
        self,
        path: str,
        *,
        cpu_clock_alternate: bool = False,
        counters: Callable[[], Mapping[str, Any]] = dict,
    ) -> None:
        self.path = path
        self._counters = counters
        self.pending_wall_ns = 0
        self.pending_cpu_ns = 0
        self.pending_polls = 0
        self.pending_site_ns = dict.fromkeys(PROFILE_SITES, 0)
        self.pending_gc_ns = 0
        self.pending_max_ns = 0
        self.pending_max_site = ""
        self.pending_iter_ns = 0  # this scheduler iteration's hook time so far
        self.iter_result = 0  # 0: no batch result yet this iteration, 1: a prefill's, 2: a decode's
        self._gc_ns = 0  # wall ns inside collections, all of them, since start
        self._gc_t0 = 0
        self._sender_cpu_seen = 0
        self._profile: dict[str, list[int]] = {key: [] for key in PROFILE_KEYS}
        self._cpu_clock = True
        self._cpu_alternate = cpu_clock_alternate
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls, counters: Callable[[], Mapping[str, Any]] = dict) -> HookProfiler | None:
        """The profiler ``$SPECDEPTH_PROFILE_OUT`` asks for, or None (the default: no profiling)."""
        path = os.environ.get(ENV_PROFILE_OUT, "")
        if not path:
            return None
        alternate = os.environ.get(ENV_PROFILE_CPU_CLOCK, "on") == "alternate"
        return cls(path, cpu_clock_alternate=alternate, counters=counters)

    def close(self) -> None:
        """Stop timing garbage collections (the profiler's ``gc`` callback). Idempotent."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def start(self) -> tuple[int, int, int]:
        """Open a window: the token :meth:`stop` takes."""
        cpu = time.thread_time_ns() if self._cpu_clock else 0
        return time.perf_counter_ns(), cpu, self._gc_ns

    def stop(self, t0: tuple[int, int, int], site: str = "wrap") -> int:
        """Close a window opened by :meth:`start`; returns its thread-CPU ns."""
        wall = time.perf_counter_ns() - t0[0]
        cpu = time.thread_time_ns() - t0[1] if self._cpu_clock else 0
        self.pending_wall_ns += wall
        self.pending_iter_ns += wall
        self.pending_cpu_ns += cpu
        self.pending_site_ns[site] += wall
        self.pending_gc_ns += self._gc_ns - t0[2]
        if wall > self.pending_max_ns:
            self.pending_max_ns, self.pending_max_site = wall, site
        return cpu

    def close_iteration(self) -> None:
        """At an iteration top, before its window: the previous iteration's hook time, if it ran a batch."""
        if self.iter_result:
            self._profile["iter_ns"].append(self.pending_iter_ns)
            self._profile["iter_decode"].append(self.iter_result - 1)
        self.pending_iter_ns = self.iter_result = 0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # gc.callbacks: called on the collecting thread, at the start and the end of each collection.
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        else:
            self._gc_ns += time.perf_counter_ns() - self._gc_t0

    def end_decode(self, t0: tuple[int, int, int], step_us: int, bs: int, client: Any, close: bool) -> None:
        """Close the window of a decode's record (opened at ``t0``) and end the record's sums.

        ``close``: also close the iteration (one rank: no iteration top to close it at).
        """
        self._profile["record_cpu_ns"].append(self.stop(t0, "rec"))
        self.iter_result = 2
        if bs:
            self._profile_step(step_us, bs, client)
        if close:
            self.close_iteration()

    def end_prefill(self, t0: tuple[int, int, int], close: bool) -> None:
        """Close the window of a prefill's batch result (opened at ``t0``)."""
        self.stop(t0, "rec")
        self.iter_result = self.iter_result or 1
        if close:
            self.close_iteration()

    def _profile_step(self, step_us: int, bs: int, client: Any) -> None:
        prof = self._profile
        prof["hook_ns"].append(self.pending_wall_ns)
        prof["hook_cpu_ns"].append(self.pending_cpu_ns)
        prof["polls"].append(self.pending_polls)
        # A fixed pure-Python reference right after the hook: shows how much this host inflates
        # any Python code at this point of the step (cold caches after the forward, SMT, load).
        if self._cpu_clock:
            t0 = time.thread_time_ns()
            sum(range(200))
            prof["ref_cpu_ns"].append(time.thread_time_ns() - t0)
        else:
            prof["ref_cpu_ns"].append(0)
        prof["cpu_clock"].append(int(self._cpu_clock))
        for site, ns in self.pending_site_ns.items():
            prof[site + "_ns"].append(ns)
        prof["step_us"].append(step_us)
        prof["bs"].append(bs)
        busy = client.busy_cpu_ns if client is not None else 0
        prof["sender_cpu_ns"].append(busy - self._sender_cpu_seen)
        self._sender_cpu_seen = busy
        prof["lag_ns"].append(client.last_lag_ns if client is not None else 0)
        prof["gc_ns"].append(self.pending_gc_ns)
        prof["max_window_ns"].append(self.pending_max_ns)
        prof["max_window_site"].append(
            PROFILE_SITES.index(self.pending_max_site) if self.pending_max_ns else -1
        )
        self.clear_pending()
        if len(prof["hook_ns"]) % PROFILE_FLUSH_EVERY == 0:
            self.flush()
            if self._cpu_alternate:  # between windows: none is open now
                self._cpu_clock = not self._cpu_clock

    def clear_pending(self) -> None:
        """Start the next record's sums (after a record, or when the scheduler goes idle)."""
        self.pending_wall_ns = self.pending_cpu_ns = self.pending_polls = self.pending_gc_ns = 0
        self.pending_max_ns = 0
        for site in self.pending_site_ns:
            self.pending_site_ns[site] = 0

    def flush(self) -> None:
        """Append the buffered per-record costs as one JSON line to :attr:`path`."""
        if not self._profile["hook_ns"]:
            return
        line = json.dumps({**self._profile, "counters": dict(self._counters())})
        with open(self.path, "a") as f:
            f.write(line + "\n")
        for values in self._profile.values():
            values.clear()
