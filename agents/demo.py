"""``controller demo``: serve a policy and drive it with simulated SGLang traffic, end to end.

What it shows, on bundled data only:

1. A real ``controller serve`` process (the bundled PPO policy by default) is started on an
   ipc endpoint, recording what it receives.
2. A simulated SGLang replica (the fitted ``h200-llama8b`` deployment by default) runs a load
   that ramps from a trickle to saturation. Each decode step's record goes to the controller
   through the very client the SGLang hook uses, and the depth that comes back is applied one
   step later, as overlap scheduling does live.
3. What the controller decided as load rose, and what that was worth: the same workload and
   seed replayed in-process for the static depths and SGLang's own adaptive rule, side by side.
   The in-process replay of the served policy must pick exactly the served decisions (parity).
4. The recorded trace, summarized — the input ``controller train --traces`` retrains on. Each
   run records into a fresh folder of its own, ``RECORD/<date>-<time>-<pid>/``, so the summary
   is this run's alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from controller.errors import ConfigError
from controller.protocol import DEFAULT_DEPTHS as DEPTHS

if TYPE_CHECKING:  # the handler imports them: `controller --help` stays light
    import numpy as np

    from env.params import SimParams
    from sglang_hook.client import ControllerClient

BUNDLED = Path(__file__).resolve().parent / "bundled"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "demo",
        help="serve a policy and drive it with simulated engine traffic (bundled data only)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--policy",
        default=None,
        help="policy to serve: a PPO zip or builtin:NAME (default: the bundled agents/bundled/DEPLOYMENT/ppo.zip)",
    )
    p.add_argument(
        "--deployment", default="h200-llama8b", help="bundled simulated deployment (default: %(default)s)"
    )
    p.add_argument(
        "--workload",
        default="ramp:1,40,24@output=256",
        help="workload spec (see `controller bench --help`); default ramps 1 → 40 req/s over 24 s, well past the ~14 req/s the simulated H200 sustains",
    )
    p.add_argument(
        "--duration-s", type=float, default=30.0, help="simulated seconds to run (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="simulation seed (default: %(default)s)")
    p.add_argument(
        "--record",
        default="runs/demo",
        help="each run records its trace into a fresh subfolder RECORD/<date>-<time>-<pid>/ "
        "(default RECORD: %(default)s)",
    )
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from controller.protocol import Hello
    from controller.registry import make_factory
    from controller.traces import summarize
    from env.deployments import load_deployment
    from env.runner import simulate
    from sglang_hook.client import ControllerClient

    bundled = BUNDLED / args.deployment / "ppo.zip"
    spec = args.policy or str(bundled)
    factory = make_factory(spec, DEPTHS)  # fail here, with the CLI's one-line error, not in the server
    params = load_deployment(args.deployment)
    record_dir = _run_folder(Path(args.record))

    print(f"== 1. serving {spec} (a real `controller serve` process), recording to {record_dir}/")
    tmp = tempfile.mkdtemp(prefix="specdepth-demo-")
    endpoint = f"ipc://{tmp}/controller.sock"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "serve",
            "--policy",
            spec,
            "--bind",
            endpoint,
            "--record",
            str(record_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    instance = f"demo-{args.deployment}-{os.getpid()}"
    client = ControllerClient(endpoint, Hello(instance, DEPTHS, "sim", args.deployment, 1), stale_ms=60_000)
    try:
        served = _drive(client, server, params, args)
    finally:
        client.close()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()

    trace_t, trace_bs, trace_wait, trace_depth, trace_tok = served
    print(f"\n== 2. what the controller decided as load rose ({args.deployment}, {args.workload})")
    print(f"{'window':>10} {'mean bs':>8} {'waiting':>8} {'tok/s':>8}  depth mix chosen")
    edges = np.linspace(0.0, trace_t[-1], 7)
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (trace_t >= lo) & (trace_t < hi) if hi < edges[-1] else trace_t >= lo
        if not m.any():
            continue
        span = max(trace_t[m][-1] - trace_t[m][0], 1e-9)
        mix = "  ".join(
            f"{d}:{np.mean(trace_depth[m] == d):4.0%}" for d in DEPTHS if np.any(trace_depth[m] == d)
        )
        print(
            f"{lo:4.0f}-{hi:3.0f} s {trace_bs[m].mean():8.1f} {trace_wait[m].mean():8.1f} "
            f"{trace_tok[m].sum() / span:8.0f}  {mix}"
        )

    print("\n== 3. why it matters: the same workload and seed, every policy side by side (simulated)")
    rows = []
    replay = simulate(
        params,
        args.workload,
        factory(DEPTHS),
        depths=DEPTHS,
        seed=args.seed,
        duration_s=args.duration_s,
        action_delay=1,
    )
    rows.append((f"{Path(spec).name if spec.endswith('.zip') else spec} (served)", replay))
    for name in ["static:0", "static:1", "static:3", "static:5", "sglang-adaptive"]:
        res = simulate(
            params,
            args.workload,
            make_factory(f"builtin:{name}", DEPTHS)(DEPTHS),
            depths=DEPTHS,
            seed=args.seed,
            duration_s=args.duration_s,
            action_delay=1,
        )
        rows.append((name, res))
    base = rows[1][1].throughput_tok_s
    print(f"{'policy':<40} {'tok/s':>8} {'vs no-spec':>10} {'TPOT ms':>8} {'p99 ms':>8}")
    for name, res in rows:
        print(
            f"{name[-40:]:<40} {res.throughput_tok_s:8.0f} {res.throughput_tok_s / base:9.3f}x "
            f"{res.tpot_ms_mean:8.2f} {res.tpot_ms_p99:8.2f}"
        )
    same = np.array_equal(replay.trace_depth[: len(trace_depth)], trace_depth)
    print(
        f"parity: the in-process replay picked the served decisions at "
        f"{np.mean(replay.trace_depth[: len(trace_depth)] == trace_depth):.1%} of {len(trace_depth)} steps"
        + ("" if same else "  (MISMATCH: see the parity test)")
    )

    print(f"\n== 4. the recorded trace ({record_dir}/), ready for `controller train --traces {record_dir}`")
    print(summarize(str(record_dir)))
    return 0 if same else 1


def _run_folder(parent: Path) -> Path:
    """A new, empty folder for this run's trace under ``parent`` (created)."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for n in range(1000):
        folder = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(
                f"cannot create the demo's record folder {str(folder)!r}: {exc.strerror or exc}"
            ) from None
        return folder
    raise ConfigError(f"no free run folder under {str(parent)!r}")


def _drive(
    client: ControllerClient, server: subprocess.Popen[str], params: SimParams, args: argparse.Namespace
) -> tuple[np.ndarray, ...]:
    """Run the simulated replica against the served policy; return the per-step trace.

    The simulation loop is :class:`env.runner.DecodeLoop`, as in ``simulate``, with the served
    controller deciding: each record goes to it through the hook's client, and the depth it
    answers runs one step later (``action_delay=1``).
    """
    import numpy as np

    from env.engine import Engine
    from env.runner import DecodeLoop

    engine = Engine(params, args.workload)
    engine.reset(args.seed)
    loop = DecodeLoop(engine, DEPTHS, action_delay=1, observe=False)
    t_s, bs, wait, depth_l, tok = [], [], [], [], []
    limit_us = int(args.duration_s * 1e6)
    deadline = time.monotonic() + 60.0  # the server imports torch to load a zip: give it time
    t0 = time.monotonic()
    action: int | None = None  # None: no record yet
    while not engine.done and engine.now_us < limit_us:
        rec, _ = loop.start() if action is None else loop.advance(action)
        rec.instance = client.instance
        want = client.counters["decisions"] + 1
        client.send_step(rec)
        resent = time.monotonic()
        while client.counters["decisions"] < want:
            if server.poll() is not None:
                err = server.stderr.read() if server.stderr is not None else ""
                raise ConfigError(f"controller serve exited: {err.strip()[-500:]}")
            if time.monotonic() > deadline:
                raise ConfigError("no decision from the controller within 60 s")
            client.poll_decision()
            if client.counters["decisions"] < want:
                time.sleep(0.0002)
                # Until the server is up, steps are dropped (never queued blindly): resend the
                # same record; once one got through, duplicates only earn a stale_seq error.
                if want == 1 and time.monotonic() - resent > 0.05:
                    client.send_step(rec)
                    resent = time.monotonic()
        deadline = time.monotonic() + 10.0
        action = DEPTHS.index(client.depth) if client.depth is not None else 0
        t_s.append(engine.now_us / 1e6)
        bs.append(rec.bs)
        wait.append(rec.waiting)
        depth_l.append(loop.depth)
        tok.append(rec.tokens)
    wall = time.monotonic() - t0
    print(
        f"   {len(t_s)} decode steps streamed to the controller, one decision each, in {wall:.1f} s "
        f"wall ({len(t_s) / max(wall, 1e-9):.0f} steps/s incl. the simulator)"
    )
    return (np.asarray(t_s), np.asarray(bs), np.asarray(wait), np.asarray(depth_l), np.asarray(tok))
