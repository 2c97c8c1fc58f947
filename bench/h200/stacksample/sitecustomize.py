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
command line (SGLang titles its scheduler ``sglang::scheduler``), the window's length, and per
thread the microseconds spent in each collapsed stack (outermost first; the innermost frame
with its line).
"""

from __future__ import annotations

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
        names = {t.ident: t.name for t in threading.enumerate()}
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
        }
        tmp = os.path.join(_DIR, f".{os.getpid()}-{window}.json")
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, os.path.join(_DIR, f"{os.getpid()}-{window}.json"))


if _DIR and os.path.isdir(_DIR):
    threading.Thread(target=_loop, name="specdepth-stacksample", daemon=True).start()
