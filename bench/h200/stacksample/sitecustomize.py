"""A wall-clock stack sampler for the servers' Python processes (a bench diagnostic, not the hook).

Where does the scheduler's time go, per Python function, on a plain server and on an EAGLE-3
server held at depth 0? The torch profiler's Python tracing slows the scheduler several times
over, and py-spy does not fit in the device call's carry. This samples every thread's stack with
``sys._current_frames()`` from a daemon thread, which costs the sampled process a GIL hand-off
per sample (about 0.2% of its time at 250 Hz). A sample waits for the GIL, so it is weighted by
the time since the one before.

It is a ``sitecustomize``: ``offswitch.py --sample`` puts this folder first on the servers'
``PYTHONPATH``, so every Python process of the server (SGLang spawns its scheduler) runs it at
start-up. It stays idle unless ``SPECDEPTH_STACK_DIR`` is set, and it samples only while the
file ``$SPECDEPTH_STACK_DIR/on`` exists; each window ends in ``<pid>-<n>.json``: the process's
command line (SGLang titles its scheduler ``sglang::scheduler``), the window's length, per
thread the microseconds spent in each collapsed stack (outermost first; the innermost frame
with its line), and, to tell a slow CPU path from a starved one: each busy thread's time on a
CPU and waiting on a run queue (``/proc/self/task/*/schedstat``), the time in the garbage
collector, the CPU affinity and the load average.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("SPECDEPTH_STACK_DIR", "")
_HZ = float(os.environ.get("SPECDEPTH_STACK_HZ", "250"))
_DEPTH = 48


def _where(code: object) -> str:
    path = getattr(code, "co_filename", "?")
    for marker in ("/site/", "/site-packages/", "/dist-packages/", "/repo/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{getattr(code, 'co_name', '?')}"


def _stack(frame: object) -> str:
    names: list[str] = []
    leaf = f":{getattr(frame, 'f_lineno', 0)}"
    while frame is not None and len(names) < _DEPTH:
        names.append(_where(frame.f_code))  # type: ignore[attr-defined]
        frame = frame.f_back  # type: ignore[attr-defined]
    names.reverse()
    return ";".join(names) + leaf


def _schedstat() -> dict[int, tuple[int, int, int]]:
    """Per thread (native id): ns on a CPU, ns waiting on a run queue, time slices."""
    out: dict[int, tuple[int, int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                run, wait, slices = (int(x) for x in fh.read().split()[:3])
        except (OSError, ValueError):
            continue
        out[int(tid)] = (run, wait, slices)
    return out


class _GcClock:
    """Time spent in the garbage collector while a window is open (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.ns = 0
        self.n = [0, 0, 0]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.ns += int((time.perf_counter() - self.t0) * 1e9)
            self.n[min(2, int(info.get("generation", 0)))] += 1


def _loop() -> None:
    on = os.path.join(_DIR, "on")
    me = threading.get_ident()
    window = 0
    while True:
        if not os.path.exists(on):
            time.sleep(0.1)
            continue
        window += 1
        counts: dict[int, dict[str, int]] = {}
        sched0 = _schedstat()
        gclock = _GcClock()
        gc.callbacks.append(gclock)
        t0, n = time.time(), 0
        last = time.perf_counter()
        while os.path.exists(on):
            # A sample waits for the GIL, longest while the sampled thread runs Python, so
            # samples come less often there: each one counts the microseconds since the last.
            frames = sys._current_frames()
            now = time.perf_counter()
            weight = int((now - last) * 1e6)
            last = now
            for tid, frame in frames.items():
                if tid != me:
                    per = counts.setdefault(tid, {})
                    key = _stack(frame)
                    per[key] = per.get(key, 0) + weight
            n += 1
            time.sleep(1.0 / _HZ)
        gc.callbacks.remove(gclock)
        sched1 = _schedstat()
        names = {t.ident: t.name for t in threading.enumerate()}
        native = {t.native_id: t.name for t in threading.enumerate()}
        sched = {  # ms over the window: on a CPU, waiting for one (CPU contention), slices
            f"{native.get(tid, '?')}#{tid}": [round((b[0] - a[0]) / 1e6, 1), round((b[1] - a[1]) / 1e6, 1), b[2] - a[2]]
            for tid, b in sched1.items()
            if (a := sched0.get(tid)) is not None and b[0] - a[0] > 1_000_000
        }
        try:
            with open("/proc/self/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmdline = sys.argv[0] if sys.argv else "?"
        record = {
            "pid": os.getpid(),
            "cmdline": cmdline[:300],
            "seconds": round(time.time() - t0, 3),
            "samples": n,
            "threads": {f"{names.get(tid, '?')}#{tid}": per for tid, per in counts.items()},
            "sched_ms": sched,
            "gc": {"ms": round(gclock.ns / 1e6, 1), "collections": gclock.n},
            "affinity": sorted(os.sched_getaffinity(0)),
            "loadavg": os.getloadavg(),
        }
        tmp = os.path.join(_DIR, f".{os.getpid()}-{window}.json")
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, os.path.join(_DIR, f"{os.getpid()}-{window}.json"))


if _DIR and os.path.isdir(_DIR):
    threading.Thread(target=_loop, name="specdepth-stacksample", daemon=True).start()
