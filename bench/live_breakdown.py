"""Where a running controller spends its time per step: each part of serve's path, timed live.

    python bench/live_breakdown.py                  # serve bench/results/h200/ppo2/ppo.zip
    python bench/live_breakdown.py --policy P.zip --steps 3000

``bench_service.py`` times message -> decision as a whole (serve's ``--latency-log``) and each
part in a hot in-process loop. The two disagree on lent GPU hosts: the live path has taken up
to 1.7x the sum of its hot parts there. This runs serve's own :class:`controller.service.Server`
in a subprocess with a clock read around each part of its real path (wrappers around the
functions ``Server._on_step`` calls, ~0.1 µs each; no copy of the path), on the CPUs
``bench_service.py`` gives the server, driven by one instance:

- lock-step: the next step as soon as the decision is back, in blocks of 500 with a 40 ms
  pause between blocks (``bench_service.py``'s traffic);
- 7 ms: one step every 7 ms, the cadence of a decode step on the GPU, where the serving
  thread sleeps between steps as it does in production.

Each in the default configuration (hybrid polling: the serving thread sleeps, but polls
without sleeping around each step's due time, and first runs the path once on the last
record to warm it; ``controller/polling.py``), hybrid polling without that warming,
``--poll block`` (it sleeps until a message comes), ``--poll block --busy-poll-us 20000``
(it polls while steps flow), and the default with the Featurizer and the MLP called
separately (the path before the fused kernel), side by side in one run. Columns, µs at p50
(total also p99):

- wake: the hook's send -> the serving thread back from ``recv`` with it (not in the total);
- decode / validate: ``unpack`` / ``read_step``;
- decide: the Featurizer and the policy (one fused call, or two);
- reply: the two ``send`` calls of the decision (its bytes are built between decide and reply);
- total: serve's own measure, message received -> decision sent (``--latency-log``),
  which includes the wrappers' clock reads;
- round trip: the hook's send -> the decision back, p50;
- CPU: the server process's CPU time over the row's wall time (all its threads).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_service as B  # noqa: E402

DEFAULT_POLICY = ROOT / "bench" / "results" / "h200" / "ppo2" / "ppo.zip"
PARTS = ("wake", "decode", "validate", "decide", "reply")


def child(cfg: dict[str, Any]) -> None:
    """The server process: serve's Server with a clock read around each part of its path."""
    from controller import service as S
    from controller.features import Featurizer
    from controller.ppo_policy import PPOPolicy

    if cfg["cpus"]:
        B.pin(set(cfg["cpus"]))
    config = S.ServeConfig(
        policy=cfg["policy"],
        bind=cfg["endpoint"],
        poll=cfg["poll"],
        prewarm=cfg.get("prewarm", True),
        busy_poll_us=cfg["busy"],
        latency_log=cfg["latency_log"],
    )
    factory = S.load_policy(config.policy)
    if cfg["two_calls"]:
        factory.prepare_serving = lambda: None  # type: ignore[attr-defined]
    srv = S.Server(config, factory=factory)
    mono = time.monotonic_ns
    rows: list[list[int]] = []
    cur = [0] * (len(PARTS) + 1)  # the parts, then the receive start

    def timed(fn: Any, slot: int, add: bool = False) -> Any:
        def wrapper(*args: Any) -> Any:
            t0 = mono()
            out = fn(*args)
            dt = mono() - t0
            cur[slot] = cur[slot] + dt if add else dt
            return out

        return wrapper

    unpack, read_step, zsend = S.unpack, S.read_step, S._zsend
    S.unpack = timed(unpack, 1)
    S._zsend = timed(zsend, 4, add=True)

    def parse_and_wake(wire: dict[str, Any], frame: bytes) -> Any:
        t0 = mono()
        out = read_step(wire, frame)
        cur[2] = mono() - t0
        cur[0] = cur[5] - out[0].ts_ns  # the driver puts its send time in ts_ns
        return out

    S.read_step = parse_and_wake
    # decide: update_with (the fused call), or update and then act (two calls, added up).
    Featurizer.update_with = timed(Featurizer.update_with, 3)  # type: ignore[method-assign]
    Featurizer.update = timed(Featurizer.update, 3)  # type: ignore[method-assign]
    PPOPolicy.act = timed(PPOPolicy.act, 3, add=True)  # type: ignore[method-assign]
    receive = srv._receive

    def receive_timed(ident: bytes) -> None:
        cur[5] = mono()
        cur[4] = 0
        receive(ident)
        if cur[0] > 0:
            rows.append(cur[:5])
        cur[0] = 0

    srv._receive = receive_timed  # type: ignore[method-assign]
    signal.signal(signal.SIGTERM, lambda *_: srv.stop())
    srv.serve_forever()
    Path(cfg["rows"]).write_text(json.dumps(rows))


def drive(endpoint: str, n: int, spacing_s: float, instances: int = 1) -> list[int]:
    """``instances`` instances, ``n`` steps each, lock-step (``spacing_s`` 0) or one every
    ``spacing_s`` (several: each in a thread of its own, started at a random phase). Returns
    the round trips (ns) but each instance's first tenth (warm-up)."""
    if instances > 1:
        rts: list[list[int]] = [[] for _ in range(instances)]
        phases = np.random.default_rng(instances).uniform(0, spacing_s, instances)

        def one(k: int) -> None:
            time.sleep(phases[k])
            rts[k] = drive_one(endpoint, f"live{k}", n, spacing_s)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(instances)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [x for rt in rts for x in rt[n // 10 :]]
    return drive_one(endpoint, "live", n, spacing_s)[n // 10 :]


def drive_one(endpoint: str, instance: str, n: int, spacing_s: float) -> list[int]:
    from controller.protocol import Hello, pack

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(pack(Hello(instance, B.DEPTHS).to_wire()))
    sock.recv()
    rt = []
    for i, step in enumerate(B.step_stream(instance, n, seed=1)):
        if spacing_s:
            time.sleep(spacing_s)
        elif i and i % 500 == 0:
            time.sleep(0.04)
        wire = step.to_wire()
        t0 = time.monotonic_ns()
        wire["ts_ns"] = t0
        sock.send(pack(wire))
        sock.recv()
        rt.append(time.monotonic_ns() - t0)
    sock.close(0)
    return rt


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", type=Path, default=DEFAULT_POLICY, help="a PPO zip to serve")
    ap.add_argument("--steps", type=int, default=6000, help="lock-step steps per row (7 ms rows: a tenth)")
    ap.add_argument(
        "--instances",
        type=int,
        default=8,
        help="instances at 7 ms each, out of phase, for the last rows (1: none)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    from controller.ppo_policy import read_ppo_zip

    B.DEPTHS = read_ppo_zip(args.policy)[0].depths
    cores = B.cores_available()
    quiet, _, driver = B.placement(cores)  # bench_service's: the server's CPUs, the load elsewhere
    B.pin(driver)
    print(
        f"# {len(cores)} cores, server on CPUs {sorted(quiet)}, load on {sorted(driver)}; "
        f"load avg {os.getloadavg()[0]:.2f}; policy {args.policy}",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="live_breakdown_"))
    variants = [  # (label, --poll, --busy-poll-us, two calls, more config)
        ("default (hybrid polling)", "hybrid", 0, False, {}),
        ("hybrid polling without warming", "hybrid", 0, False, {"prewarm": False}),
        ("--poll block", "block", 0, False, {}),
        ("--poll block --busy-poll-us 20000", "block", 20000, False, {}),
        ("default, two calls (no fused)", "hybrid", 0, True, {}),
    ]
    head = f"{'cadence':10s} {'server':34s} " + " ".join(f"{p:>8s}" for p in PARTS)
    print(f"\n{head} {'total p50':>10s} {'total p99':>10s} {'round trip':>10s} {'CPU':>6s}")
    print("-" * (len(head) + 40))
    if len(quiet) < 2:  # a polling thread on the I/O thread's only core starves it (bench_service)
        variants = [v for v in variants if not v[2]]
    n_7ms = max(args.steps // 10, 100)
    cadences = [("lock-step", args.steps, 0.0, 1), ("7 ms", n_7ms, 0.007, 1)]
    if args.instances > 1:
        cadences.append((f"7 ms x{args.instances}", n_7ms, 0.007, args.instances))
    for c, (cadence, n, spacing, instances) in enumerate(cadences):
        for i, (label, poll, busy, two, more) in enumerate(variants):
            endpoint = f"ipc://{tmp}/{c}-{i}.sock"
            cfg = {
                "policy": str(args.policy),
                "endpoint": endpoint,
                "poll": poll,
                "busy": busy,
                "two_calls": two,
                "cpus": sorted(quiet) if len(cores) > 1 else None,
                "latency_log": str(tmp / "lat.bin"),
                "rows": str(tmp / "rows.json"),
                **more,
            }
            env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(cfg)], env=env)
            try:
                B.wait_welcome(endpoint, proc)
                cpu0, t0 = cpu_s(proc.pid), time.monotonic()
                rt = drive(endpoint, n, spacing, instances)
                cpu = (cpu_s(proc.pid) - cpu0) / (time.monotonic() - t0)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            rows = np.array(json.loads((tmp / "rows.json").read_text()), dtype=np.int64)
            rows = rows[len(rows) // 10 :] / 1000
            lat = np.fromfile(tmp / "lat.bin", dtype=np.int64)[-len(rows) :] / 1000
            parts = " ".join(f"{np.percentile(rows[:, k], 50):8.1f}" for k in range(len(PARTS)))
            print(
                f"{cadence:10s} {label:34s} {parts} {np.percentile(lat, 50):10.1f} {np.percentile(lat, 99):10.1f}"
                f" {np.percentile(np.array(rt) / 1000, 50):10.1f} {cpu:6.0%}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
