"""The real-server proof on the realistic acceptance testbed (``testbed.py``), one device call.

Runs on the device machine like ``offswitch.py`` (whose servers and result book it uses): set-up,
the testbed's models (a permutation target, the ``tb`` drafter), several servers at once on the
one GPU (KV capped), then stages, each resumable by naming only the stages not done:

  accept   the drafter's measured acceptance per family and position (static depth 5, C=16),
           next to the figure each family is calibrated to.
  closed   closed loop at each C on the family mix, ``--reps`` repetitions interleaved: every
           repetition times every (server, policy) at each C in a rotating order. Policies on
           the hook server (``--policies``): ``static:K`` through the scripted controller, any
           other name through ``controller serve --policy NAME --record`` (traces for
           ``controller train --traces``).
  resume   acceptance around a resume on each hook server: depth 3 for 100 steps, 0 for 200,
           then 3, against the same requests held at depth 3 (per-step telemetry in
           ``scripted_*.jsonl``; ``analyze_resume`` reads it).

Servers (``--servers``, kinds of ``offswitch.KINDS``): ``plain`` (no ``--speculative-*``
flag), ``off`` (EAGLE-3 through the hook, depth 0 a plain decode, the drafter's extend kept),
``off-skip`` (the extend skipped at depth 0), ``sglang-default`` and ``sglang-tuned`` (SGLang's
own adaptive rule with its default tiers and with every depth at every batch size).

Writes under ``--out``: ``summary.csv`` (``workload,concurrency,policy,rep,tok_s,tpot_ms_mean,
tpot_ms_p99,failed``), ``offswitch.json`` (every point, greedy identity against ``plain``,
acceptance, resume), the controller's traces and ``res.tar.gz`` (logs), after every point.

Usage (device, repo root): python3 bench/h200/realgpu.py --out "$OUT" --stages accept,closed,resume
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import offswitch  # noqa: E402
import run  # noqa: E402
import testbed  # noqa: E402
from loadgen import LoadSpec, run_load  # noqa: E402


class Scripted:
    """The scripted controller on a hook server's endpoint, steered through a control file."""

    def __init__(self, server: offswitch.Server) -> None:
        self.server = server
        self.control = run.RES / f"control_{server.spec.label}.txt"
        self.record = run.RES / f"scripted_{server.spec.label}.jsonl"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, schedule: str = "static:0") -> bool:
        self.control.write_text(schedule)
        log = run.RES / f"scripted_{self.server.spec.label}.log"
        self.fh = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "scripted_controller.py"), "--bind", self.server.endpoint,
             "--schedule", f"file:{self.control}", "--record", str(self.record)],
            env=run._env(), stdout=self.fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in range(30):  # until the hook has said hello to this controller
            run_load(self.server.url, LoadSpec(1, 1, 64, 8, seed=999))
            if "hello from" in log.read_text(errors="replace"):
                return True
        return False

    def set(self, schedule: str) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(schedule)
        os.replace(tmp, self.control)
        time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


def per_position(hist: list[int]) -> list[float]:
    """Conditional acceptance of draft positions 1..k from a histogram of accepted drafts per verify."""
    total = sum(hist)
    out = []
    for i in range(1, len(hist)):
        reach_prev = sum(hist[i - 1 :])
        reach = sum(hist[i:])
        out.append(round(reach / reach_prev, 4) if reach_prev else float("nan"))
    return out if total else []


def stage_accept(
    book: offswitch.Book, server: offswitch.Server, ctl: Scripted, args: argparse.Namespace
) -> None:
    ctl.set("static:5")
    out = {}
    for fam in testbed.FAMILIES.values():
        spec = LoadSpec(16, 32, args.input_tokens, args.output_tokens, seed=77, mix=fam.name)
        m = run_load(server.url, spec, timeout_s=120)
        book.add(server, 0, m, policy="static:5", workload=f"accept-{fam.name}")
        pos = per_position(m["accepted_drafts_histogram"])
        out[fam.name] = {"q_built": fam.q, "per_position": pos, "accept_len_k5": round(m["accept_len_mean"], 3),
                         "target": fam.target, "hist": m["accepted_drafts_histogram"], "failed": m["failed"]}  # fmt: skip
        run.log(f"accept {fam.name}: per position {pos}, accepted length at 5: {m['accept_len_mean']:.3f}")
    book.res.data["acceptance"] = out
    book.flush()


def stage_resume(book: offswitch.Book, servers: list[offswitch.Server], ctls: dict[str, Scripted],
                 args: argparse.Namespace, deadline: float) -> None:  # fmt: skip
    spec = LoadSpec(64, 64, args.input_tokens, 1024, seed=4321, mix="chat,code")
    for server in servers:
        for schedule in ("phases:3x100,0x200,3", "static:3"):
            if time.time() > deadline:
                book.res.event("skipped_resume", server=server.spec.label, schedule=schedule)
                continue
            ctls[server.spec.label].set(schedule)
            m = run_load(server.url, spec, timeout_s=max(30.0, deadline - time.time() + 60))
            book.add(server, 0, m, policy=f"resume-{schedule}", workload="resume")
    book.res.data["resume"] = analyze_resume(run.RES)
    book.flush()


def analyze_resume(res: Path) -> dict[str, Any]:
    """Mean accepted drafts per request-step in windows after the resume, and over the held run."""
    out: dict[str, Any] = {}
    for f in sorted(res.glob("scripted_*.jsonl")):
        recs = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
        label = f.stem[len("scripted_") :]
        held = [r for r in recs if r.get("tag") == "static:3" and r["depth"] == 3 and r["accept"]]
        sw = [r for r in recs if r.get("tag", "").startswith("phases:3x100") and r["accept"]]
        if not held or not sw:
            continue
        off_end = max(
            (r["i"] for r in recs if r.get("tag", "").startswith("phases") and r["depth"] == 0), default=None
        )
        after = [r for r in sw if off_end is not None and r["i"] > off_end and r["depth"] == 3]
        before = [r for r in sw if off_end is not None and r["i"] < off_end and r["depth"] == 3]

        def mean(rs: list[dict[str, Any]]) -> float | None:
            vals = [a for r in rs for a in r["accept"]]
            return round(statistics.fmean(vals), 4) if vals else None

        first = after[0]["i"] if after else 0
        windows = {
            "first step": (0, 1),
            "steps 1-4": (1, 5),
            "steps 5-19": (5, 20),
            "steps 100-149": (100, 150),
        }
        out[label] = {
            "held_mean": mean(held[20:]),
            "before_off_mean": mean(before[20:]),
            **{w: mean([r for r in after if lo <= r["i"] - first < hi]) for w, (lo, hi) in windows.items()},
            "held_windows_from_step_300": {
                w: mean([r for r in held if lo <= r["i"] - 300 < hi]) for w, (lo, hi) in windows.items()
            },
        }
    return out


def closed_points(servers: list[offswitch.Server], policies: list[str]) -> list[tuple[offswitch.Server, str]]:
    points: list[tuple[offswitch.Server, str]] = []
    for s in servers:
        if s.kind.sglang_rule or not s.kind.speculative:
            points.append((s, s.kind.policy))
        elif s.spec.label == "off":
            points += [(s, p) for p in policies]
        else:  # off-skip: depth 0 only
            points.append((s, "static:0-skip"))
    return points


def stage_closed(book: offswitch.Book, servers: list[offswitch.Server], ctls: dict[str, Scripted],
                 args: argparse.Namespace, deadline: float) -> None:  # fmt: skip
    points = closed_points(servers, args.policies)
    book.res.event("closed_points", points=[f"{s.spec.label}:{p}" for s, p in points])
    for rep in range(1, args.reps + 1):
        for c in args.conc:
            k = (rep * 3 + c) % len(points)
            for server, policy in points[k:] + points[:k]:
                if time.time() > deadline:
                    book.res.event("skipped", server=server.spec.label, policy=policy, rep=rep, c=c)
                    continue
                ctl = ctls.get(server.spec.label)
                if ctl is not None:
                    ctl.set(policy.replace("-skip", ""))
                n = max(4, args.requests_per_conc * c)
                spec = LoadSpec(
                    c, n, args.input_tokens, args.output_tokens, seed=1000 * rep + c, mix=args.mix
                )
                m = run_load(server.url, spec, timeout_s=max(30.0, deadline - time.time() + 60))
                book.add(server, rep, m, policy=policy, workload="closed-mix")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--deadline-s", type=float, default=530.0, help="start no new point after this")
    parser.add_argument("--servers", default="plain,off,off-skip,sglang-default")
    parser.add_argument("--stages", default="accept,closed,resume")
    parser.add_argument(
        "--policies", default="static:0,static:1,static:3,static:5", type=lambda s: s.split(",")
    )
    parser.add_argument("--backend", default="triton", choices=("triton", "flashinfer"))
    parser.add_argument("--conc", default="1,4,16,64,128", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--requests-per-conc", type=int, default=2, help="requests per point = this x C (min 4)"
    )
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--mix", default="chat,code,docs", help="testbed families drawn per request")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--mem-fraction", type=float, default=0.8)
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--no-prefill-graph", action="store_true", default=True)
    args = parser.parse_args()
    args.draft = "draft_tb"
    args.depths = (0, 1, 3, 5)
    args.target_out_std = 0.002
    stages = args.stages.split(",")
    unknown = [s for s in args.servers.split(",") if s not in offswitch.KINDS]
    if unknown:
        parser.error(f"unknown servers {unknown}; choose from {sorted(offswitch.KINDS)}")

    args.out.mkdir(parents=True, exist_ok=True)
    deadline = run.T0 + args.deadline_s
    res = run.Results(args.out)
    res.data["device"] = run.device_info()
    res.data["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    book = offswitch.Book(args.out, res)
    servers: list[offswitch.Server] = []
    ctls: dict[str, Scripted] = {}
    try:
        compiler = run.setup(res)
        compiler.wait()
        importer = threading.Thread(target=run.check_imports, args=(res,))
        importer.start()
        built = run.build_models(res, "8b", "tb", testbed=True)
        importer.join()
        res.flush()
        if not (built and res.data.get("imports_ok")):
            return 1
        for i, label in enumerate(args.servers.split(",")):
            server = offswitch.Server(label, offswitch.KINDS[label], 31000 + i, args)
            server.start(run._env())
            servers.append(server)
            time.sleep(3.0)  # staggered: each measures free memory after the last one's weights
        ready = {}
        for server in servers:
            ok, why = server.wait_ready(max(10.0, min(420.0, deadline - time.time())))
            ready[server.spec.label] = why
            run.log(f"server {server.spec.label}: {why}")
        res.event("ready", servers=ready)
        live = [s for s in servers if ready[s.spec.label] == "ready"]
        for server in live:
            if server.kind.speculative and not server.kind.sglang_rule:
                ctl = Scripted(server)
                res.event("scripted", server=server.spec.label, hello=ctl.start())
                ctls[server.spec.label] = ctl
        for (
            server
        ) in live:  # warm every batch shape once (depth 0 and 5 on the hook), outside the timed points
            for schedule in ("static:0", "static:5") if server.spec.label in ctls else ("",):
                if schedule:
                    ctls[server.spec.label].set(schedule)
                for c in args.conc:
                    run_load(server.url, LoadSpec(c, c, args.input_tokens, 16, seed=7 + c, mix=args.mix))
        res.event("warm")
        hook = next((s for s in live if s.spec.label == "off"), None)
        if "accept" in stages and hook is not None:
            stage_accept(book, hook, ctls["off"], args)
        if "resume" in stages:
            stage_resume(book, [s for s in live if s.spec.label in ctls], ctls, args, deadline)
        if "closed" in stages:
            stage_closed(book, live, ctls, args, deadline)
    finally:
        for ctl in ctls.values():
            ctl.stop()
        for server in servers:
            server.stop()
            res.data.setdefault("servers", {})[server.spec.label] = {
                "argv": " ".join(server.argv()),
                **offswitch.facts(server),
            }
        res.event("done")
        book.flush()
        print("\n== acceptance per family:", json.dumps(res.data.get("acceptance"), indent=None)[:1500])
        print("\n== resume:", json.dumps(res.data.get("resume"))[:1500])
        bad = {k: v for k, v in res.data.get("identity", {}).items() if v[0] != v[1]}
        print(f"\n== identity against plain: {len(res.data.get('identity', {}))} points, differing: {bad}")
        closed = [r for r in book.rows if r["workload"].startswith("closed")]
        print("\n== throughput (tok/s), ratios to plain per repetition\n" + offswitch.table(closed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
