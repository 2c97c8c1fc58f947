"""The real-server proof on the realistic acceptance testbed (``testbed.py``), one device call.

Runs on the device machine like ``offswitch.py`` (whose servers and result book it uses): set-up,
the testbed's models (a permutation target, the ``tb`` drafter), several servers at once on the
one GPU (KV capped), a warm-up, then stages. A call runs the stages and policies it is given;
``bench/h200/REALGPU.md`` splits the whole proof into calls (``--first-rep`` numbers each
call's repetitions apart, so the calls' ``summary.csv`` files concatenate).

Policies are named as ``summary.csv`` writes them. Three are servers of their own
(``offswitch.KINDS``): ``plain`` (no ``--speculative-*`` flag), ``sglang-adaptive-default`` and
``sglang-adaptive-tuned`` (SGLang's own adaptive rule, with its default tiers and with the
tiers our launcher generates: every depth of ``--depths`` at every batch size); ``plain-rec``
is the plain server started through the hook's launcher with a recording controller, so its
steps and admissions are in step records beside the hook server's. Every other
name runs on the hook server (``off``: EAGLE-3 through ``sglang_hook.launch_server``, fallback
depth 0) under ``controller serve --policy SPEC --record`` (``policyswap.py``: ``static:K``
and builtin names as ``builtin:NAME``, ``ppo`` / ``ppo-retrained`` as their zips,
``NAME=SPEC`` for anything else); each swap stops the last controller, starts the next on the
hook's endpoint and waits until the hook's hello reached it. The servers that start are those
the stages' policies need.

Stages (``--stages``, in this order):

  accept   the drafter's acceptance per family and position (static depth 5, C=16), next to
           the figure each family is calibrated to.
  closed   closed loop at each C (``--conc``) on the family mix, 256-token prompts, 128 greedy
           output tokens, max(4, 2C) requests; per repetition every policy of ``--policies``
           in a rotating order, all C for one policy before the next (one controller start
           per policy and repetition).
  long     the same with ``--long-input``-token prompts (8192; a comma list runs each length
           in turn, for each policy) at ``--long-conc`` (16, 64), C requests per point,
           ``--long-policies``. At C=64 the KV cap (``--max-total-
           tokens`` per server, 4 servers on one GPU) holds about 16 such requests: the rest
           queue, as they would on a server of that size.
  open     the shifting open-loop trace (``openloop.py``: Poisson, trickle -> overload ->
           trickle, chat -> code -> docs) of ``--open-s`` seconds, once per policy of
           ``--open-policies`` and repetition; ``concurrency`` is 0 in ``summary.csv``.
  resume   acceptance around a resume (scripted controller): depth 3 for 100 steps, 0 for
           200, then 3, against the same requests held at depth 3; on each server of
           ``--resume-servers`` (hook servers: ``off``, and ``off-keep`` / ``off-skip`` to compare
           what the drafter does while off), ``--resume-conc`` requests of 1024 tokens.

Method: before the stages every depth of ``--depths`` runs at every C (and a long prompt once)
on the hook server, and every C on the others; before each timed point its prompts are sent
once with one output token (``--prewarm point``), so every policy finds them in SGLang's prefix
cache (points whose prompts do not fit in half the KV cap are sent cold to every policy).
A point is not started after ``--deadline-s``; an open-loop point not unless its trace fits.

Writes under ``--out`` after every point: ``summary.csv`` (``workload,concurrency,policy,rep,
tok_s,tpot_ms_mean,tpot_ms_p99,failed``), ``offswitch.json`` (every point with per-request
output hashes, greedy identity against ``plain``, acceptance, resume, each controller swap),
``res.tar.gz`` (logs), and after each controller stops ``traces.tar``: its traces, flat, as
``traces/<policy>-<instance>-<start>.msgpack.gz`` (``controller train --traces``).

Usage (device, repo root): python3 bench/h200/realgpu.py --out "$OUT" --stages closed --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import offswitch  # noqa: E402
import openloop  # noqa: E402
import policyswap  # noqa: E402
import run  # noqa: E402
import testbed  # noqa: E402
from loadgen import OUTPUT_BOUNDS, LoadSpec, run_load  # noqa: E402

STAGES = ("accept", "closed", "long", "open", "resume")
HOOK = "off"  # the hook server every controller policy runs on
# The policies that are servers of their own (offswitch.KINDS label by summary.csv name): plain,
# SGLang's rules, and the other off-switch variants held at depth 0 by the hook's fallback.
SERVER_POLICIES = {k.policy: label for label, k in offswitch.KINDS.items() if label != HOOK}
DEPTHS = (0, 1, 2, 3, 5)  # the bundled PPO zip's depths: a zip refuses any other tuple
BUILTINS = ("goodput", "vllm-dsd", "trtllm-schedule", "bandit", "sglang-adaptive", "sglang-adaptive-all")
STATICS = ("static:0", "static:1", "static:3", "static:5")
SGLANG_RULES = ("sglang-adaptive-default", "sglang-adaptive-tuned")


def default_policies(stage: str, repo: Path = policyswap.REPO) -> list[str]:
    """The policies a stage runs by default: the issue's baselines, then the controller's PPO
    policies (``ppo-retrained`` once its zip is committed; with it comes the simulator fitted to
    the testbed's traces, and ``goodput-fit``, goodput on that fit, joins the closed stage)."""
    ppo = ["ppo"] + (["ppo-retrained"] if (repo / policyswap.NAMED_ZIPS["ppo-retrained"]).exists() else [])
    if stage == "closed":
        fit = ["goodput-fit"] if (repo / policyswap.NAMED_SIMS["goodput-fit"]).exists() else []
        return ["plain", *SGLANG_RULES, *STATICS, *BUILTINS, *fit, *ppo]
    if stage == "long":
        return ["plain", *SGLANG_RULES, *STATICS, *ppo]
    return ["plain", *SGLANG_RULES, "static:1", "static:3", *ppo]  # open: 3-5 min each (REALGPU.md)


def point_seed(rep: int, c: int, stage: str = "closed") -> int:
    """The seed of a point's requests (prompts, families, output lengths): the same for every
    policy within a repetition, new in each; ``realgpu_sim.py`` replays the same requests."""
    return 1000 * rep + c + (0 if stage == "closed" else 500)


def prewarmed(n_requests: int, input_tokens: int, max_total_tokens: int, prewarm: str = "point") -> bool:
    """Whether a point's prompts are sent once before it is timed, so that SGLang's radix cache
    holds them: with ``--prewarm point``, when they fit in half the KV cap. A point that does
    not fit runs cold (8C requests of 256 tokens at C = 64 are 131,072 tokens)."""
    return prewarm == "point" and n_requests * input_tokens <= max_total_tokens // 2


def rotate(items: list[Any], rep: int) -> list[Any]:
    """``items`` starting a third further on at each repetition: over three repetitions every
    policy runs once early, once midway and once late, so slow drift hits each alike."""
    if not items:
        return []
    k = ((rep - 1) * max(1, round(len(items) / 3))) % len(items)
    return items[k:] + items[:k]


def servers_needed(policies: list[str]) -> list[str]:
    """Server labels (``offswitch.KINDS``) the policies run on, hook server included if needed."""
    labels = [SERVER_POLICIES[p] for p in policies if p in SERVER_POLICIES]
    if any(p not in SERVER_POLICIES for p in policies):
        labels.append(HOOK)
    return [lbl for lbl in offswitch.KINDS if lbl in labels]  # a stable order: plain first


def live_policy(kind: offswitch.Kind, label: str, policy: str, on: str = "") -> str | None:
    """What the controller on server ``label`` serves while ``policy`` is timed there, or None
    where no controller runs: the hook server (or hook server ``on``, in the resume stage) serves
    the policy itself; ``plain-rec`` a recording ``static:0``, so that the plain server's steps
    and admissions are in step records beside the hook server's (it does not speculate, so
    there is nothing to decide); the off-switch variants run without one, held at depth 0 by
    the hook's fallback."""
    if label == HOOK or on:
        return policy
    if kind.recorded:
        return "static:0"
    return None


class Bench:
    """The servers, the hook server's controller swap and the result book of one call."""

    def __init__(self, args: argparse.Namespace, book: offswitch.Book, live: list[offswitch.Server]) -> None:
        self.args = args
        self.book = book
        self.by_label = {s.spec.label: s for s in live}
        self.deadline = run.T0 + args.deadline_s
        self.pack = offswitch.call_traces(args.out)
        # A controller swap per hook server; only the resume stage drives those other than HOOK.
        self.swaps: dict[str, policyswap.ControllerSwap] = {
            label: server.controller_swap(self.pack) for label, server in self.by_label.items() if server.kind.hook
        }

    def server_for(self, policy: str) -> offswitch.Server | None:
        return self.by_label.get(SERVER_POLICIES.get(policy, HOOK))

    def use(self, policy: str, on: str = "") -> offswitch.Server | None:
        """The server that runs ``policy`` (or hook server ``on``), with ``policy`` live on it;
        None if it cannot run."""
        server = self.by_label.get(on) if on else self.server_for(policy)
        if server is None:
            self.book.res.event("no_server", policy=policy, on=on)
            return None
        label = server.spec.label
        live = live_policy(server.kind, label, policy, on)
        if label not in self.swaps or live is None:
            return server
        swap = self.swaps[label].use(policyswap.resolve(live))
        if swap.why == "already running":
            return server
        self.book.res.data.setdefault("swaps", []).append(
            {"t_s": round(time.time() - run.T0, 1), "server": label, **vars(swap)}
        )
        run.log(f"controller {policy} on {label}: {swap.why} (start {swap.start_s} s, hello {swap.hello_s} s)")
        return server if swap.live else None

    def time_left(self, need_s: float = 0.0) -> bool:
        return time.time() + need_s < self.deadline

    def measure(self, server: offswitch.Server, policy: str, spec: LoadSpec, rep: int, workload: str) -> None:
        if prewarmed(spec.n_requests, spec.input_tokens, self.args.max_total_tokens, self.args.prewarm):
            run_load(server.url, LoadSpec(spec.concurrency, spec.n_requests, spec.input_tokens, 1, spec.seed,
                                          spec.mix), timeout_s=300)  # fmt: skip
        m = run_load(server.url, spec, timeout_s=max(60.0, self.deadline - time.time() + 120))
        self.book.add(server, rep, m, policy=policy, workload=workload)

    def stop(self) -> None:
        for label, swap in self.swaps.items():
            stopped = swap.stop()  # packs its traces (on_stop)
            if stopped:
                self.book.res.data.setdefault("swaps", []).append({"server": label, "stopped": stopped})


def warm(bench: Bench, args: argparse.Namespace, stages: list[str]) -> None:
    """Every depth at every C on the hook server, every C elsewhere, long prompts once per server;
    with ``--warm-drawn`` also a point of drawn lengths at each C once per server.

    The hook's first swap also compiles the controller's numba kernels on a fresh machine
    (cached on disk for the later swaps)."""
    conc = sorted(set(args.conc) | (set(args.long_conc) if "long" in stages else set()))
    for label, server in bench.by_label.items():
        for depth in DEPTHS if label == HOOK else (None,):
            if depth is not None and bench.use(f"static:{depth}") is None:
                continue
            for c in conc:
                run_load(server.url, LoadSpec(c, c, args.input_tokens, 16, seed=7 + c, mix=args.mix))
                if args.warm_drawn and depth in (None, DEPTHS[0]):
                    run_load(server.url, offswitch.drawn_warmup(c, args.input_tokens, args.output_tokens,
                                                                args.output_sigma, mix=args.mix))  # fmt: skip
        if "long" in stages:
            for n_in in args.long_input:
                run_load(server.url, LoadSpec(2, 2, n_in, 16, seed=8, mix=args.mix), timeout_s=300)
    bench.book.res.event("warm")


def per_position(hist: list[int]) -> list[float]:
    """Conditional acceptance of draft positions 1..k from a histogram of accepted drafts per verify."""
    total = sum(hist)
    out = []
    for i in range(1, len(hist)):
        reach_prev = sum(hist[i - 1 :])
        reach = sum(hist[i:])
        out.append(round(reach / reach_prev, 4) if reach_prev else float("nan"))
    return out if total else []


def stage_accept(bench: Bench, args: argparse.Namespace) -> None:
    server = bench.use("static:5")
    if server is None:
        return
    out = {}
    for fam in testbed.FAMILIES.values():
        spec = LoadSpec(16, 32, args.input_tokens, args.output_tokens, seed=77, mix=fam.name)
        m = run_load(server.url, spec, timeout_s=120)
        bench.book.add(server, 0, m, policy="static:5", workload=f"accept-{fam.name}")
        pos = per_position(m["accepted_drafts_histogram"])
        out[fam.name] = {"q_built": fam.q, "per_position": pos, "accept_len_k5": round(m["accept_len_mean"], 3),
                         "target": fam.target, "hist": m["accepted_drafts_histogram"], "failed": m["failed"]}  # fmt: skip
        run.log(f"accept {fam.name}: per position {pos}, accepted length at 5: {m['accept_len_mean']:.3f}")
    bench.book.res.data["acceptance"] = out
    bench.book.flush()


def stage_loop(bench: Bench, args: argparse.Namespace, stage: str) -> None:
    """``closed`` or ``long``: per repetition, each policy in a rotating order, all its C."""
    out = f"{args.output_tokens}~{args.output_sigma:g}" if args.output_sigma > 0 else f"{args.output_tokens}"
    if stage == "closed":
        policies, conc, inputs = args.policies, args.conc, [args.input_tokens]
    else:
        policies, conc, inputs = args.long_policies, args.long_conc, args.long_input
    need_s = 0.0 if stage == "closed" else 60.0  # a long point at C=64 lasts up to about a minute
    for rep in range(args.first_rep, args.first_rep + args.reps):
        for policy in rotate(list(policies), rep):
            if not bench.time_left(need_s):
                bench.book.res.event("skipped", stage=stage, policy=policy, rep=rep)
                continue
            server = bench.use(policy)
            if server is None:
                bench.book.res.event("not_run", stage=stage, policy=policy, rep=rep)
                continue
            for n_in in inputs:
                workload = f"{stage}-mix-{n_in}-{out}"
                for c in conc:
                    if not bench.time_left(need_s):
                        bench.book.res.event("skipped", stage=stage, policy=policy, rep=rep, c=c, input=n_in)
                        continue
                    n = max(4, args.requests_per_conc * c) if stage == "closed" else c
                    spec = LoadSpec(c, n, n_in, args.output_tokens, seed=point_seed(rep, c, stage), mix=args.mix,
                                    output_sigma=args.output_sigma)  # fmt: skip
                    bench.measure(server, policy, spec, rep, workload)


def open_spec(args: argparse.Namespace, rep: int) -> openloop.OpenSpec:
    """The open-loop trace: the same for every policy; ``--open-seed`` picks it (not the rep, so
    every repetition of every call replays one trace)."""
    return openloop.OpenSpec(duration_s=args.open_s, peak_rps=args.open_peak_rps,
                             input_tokens=args.input_tokens, seed=args.open_seed)  # fmt: skip


def stage_open(bench: Bench, args: argparse.Namespace) -> None:
    workload = f"open-shift-{args.open_s:g}s"
    for rep in range(args.first_rep, args.first_rep + args.reps):
        spec = open_spec(args, rep)
        bench.book.res.data.setdefault("open_trace", {"spec": vars(spec), "bins": openloop.describe(spec)})
        for policy in rotate(list(args.open_policies), rep):
            # The trace plus its drain (the overload's backlog) and a controller start must fit.
            if not bench.time_left(args.open_s * 1.25 + 30):
                bench.book.res.event("skipped", stage="open", policy=policy, rep=rep)
                continue
            server = bench.use(policy)
            if server is None:
                bench.book.res.event("not_run", stage="open", policy=policy, rep=rep)
                continue
            m = openloop.run_open(server.url, spec, timeout_s=args.open_s * 3 + 120)
            bench.book.add(server, rep, m, policy=policy, workload=workload)


def stage_resume(bench: Bench, args: argparse.Namespace) -> None:
    c = args.resume_conc
    spec = LoadSpec(c, c, args.input_tokens, 1024, seed=4321, mix="chat,code")
    for label in args.resume_servers:
        for schedule in ("phases:3x100,0x200,3", "static:3"):
            if not bench.time_left():
                bench.book.res.event("skipped_resume", server=label, schedule=schedule)
                continue
            server = bench.use(f"scripted:{schedule}", on=label)
            if server is None:
                continue
            m = run_load(server.url, spec, timeout_s=max(30.0, bench.deadline - time.time() + 60))
            name = f"resume-{schedule}" if label == HOOK else f"resume-{label}-{schedule}"
            bench.book.add(server, 0, m, policy=name, workload="resume")
        if label != HOOK:  # back to its fallback depth 0, as the closed stage's server policies expect
            bench.swaps[label].stop()
    bench.book.res.data["resume"] = analyze_resume(run.RES)
    bench.book.flush()


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


def _list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], epilog="Call plan and retraining: bench/h200/REALGPU.md"
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument(
        "--deadline-s", type=float, default=540.0, help="start no new point after this (s from start)"
    )
    parser.add_argument("--stages", default="accept,closed", help=f"comma list of {','.join(STAGES)}")
    parser.add_argument(
        "--servers", default="", help="override: comma list of offswitch.KINDS labels to start"
    )
    parser.add_argument(
        "--policies", type=_list, default=None, help="closed stage (default: every baseline + ppo)"
    )
    parser.add_argument("--long-policies", type=_list, default=None, help="long stage")
    parser.add_argument("--open-policies", type=_list, default=None, help="open stage")
    parser.add_argument("--reps", type=int, default=1, help="repetitions per stage in this call")
    parser.add_argument(
        "--first-rep", type=int, default=1, help="number of the first repetition (unique across calls)"
    )
    parser.add_argument("--backend", default="triton", choices=("triton", "flashinfer"))
    parser.add_argument("--conc", type=_ints, default=[1, 4, 16, 64, 128])
    parser.add_argument(
        "--requests-per-conc", type=int, default=2, help="closed: requests per point = this x C (min 4)"
    )
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="closed and long: output tokens per request (the median with --output-sigma)")  # fmt: skip
    parser.add_argument("--output-sigma", type=float, default=0.0,
                        help="closed and long: > 0 draws each request's output length log-normally "
                        "(the workload name gets ~SIGMA); 0 fixes it, and requests finish in waves")  # fmt: skip
    parser.add_argument("--long-input", type=_ints, default=[8192],
                        help="long stage: prompt tokens (a comma list: each length in turn)")  # fmt: skip
    parser.add_argument("--long-conc", type=_ints, default=[16, 64])
    parser.add_argument(
        "--open-s", type=float, default=180.0, help="open stage: arrival window per policy (s)"
    )
    parser.add_argument("--open-peak-rps", type=float, default=80.0, help="open stage: peak arrival rate")
    parser.add_argument("--open-seed", type=int, default=0)
    parser.add_argument("--mix", default="chat,code,docs", help="testbed families drawn per request")
    parser.add_argument("--prewarm", default="point", choices=("point", "none"),
                        help="send each point's prompts once before timing it (prefix cache)")  # fmt: skip
    parser.add_argument("--context", type=int, default=None,
                        help="servers' --context-length (default: the longest --long-input plus the longest output)")  # fmt: skip
    parser.add_argument("--mem-fraction", type=float, default=0.8)
    parser.add_argument("--max-total-tokens", type=int, default=139264,
                        help="KV cap per server: 16 long requests (8192 + 128) fit; 4 servers fit an H200")  # fmt: skip
    parser.add_argument("--resume-servers", type=_list, default=[HOOK],
                        help="resume stage: the hook servers to run it on (off, off-keep, off-skip)")  # fmt: skip
    parser.add_argument("--resume-conc", type=int, default=64, help="resume stage: concurrent requests")
    # SGLang's default is to capture prefill graphs, and the servers users compare run with them;
    # before 2026-12-06 this flag was stuck on (calls 1-5 and J-K ran without prefill graphs)
    parser.add_argument("--no-prefill-graph", action="store_true",
                        help="--disable-prefill-cuda-graph on every server (about 100 s less start-up; "
                        "admissions then run eagerly)")  # fmt: skip
    parser.add_argument("--no-warm", action="store_true", help="skip the warm-up (a quick check only)")
    parser.add_argument("--warm-drawn", action=argparse.BooleanOptionalAction, default=True,
                        help="the warm-up also runs an untimed point of drawn lengths at each C, once per "
                        "server (offswitch.drawn_warmup; default on)")  # fmt: skip
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    stages = _list(args.stages)
    bad = [s for s in stages if s not in STAGES]
    if bad:
        parser.error(f"unknown stages {bad}; choose from {','.join(STAGES)}")
    # A drawn output length can reach the bound's top, so the context must hold it after the prompt.
    longest_out = OUTPUT_BOUNDS[1] if args.output_sigma > 0 else args.output_tokens
    args.context = args.context or max(args.long_input) + max(512, longest_out)
    if max(args.long_input) + longest_out > args.context:
        parser.error(f"--context {args.context} is below the longest --long-input plus {longest_out} output tokens")
    args.policies = args.policies or default_policies("closed")
    args.long_policies = args.long_policies or default_policies("long")
    args.open_policies = args.open_policies or default_policies("open")
    args.draft = "draft_tb"
    args.depths = DEPTHS
    args.target_out_std = 0.002
    wanted = {"closed": args.policies, "long": args.long_policies, "open": args.open_policies}
    needed: list[str] = []
    for stage in stages:
        needed += wanted.get(stage, ["static:5"] if stage in ("accept", "resume") else [])
    args.server_labels = _list(args.servers) or servers_needed(needed)
    if "resume" in stages:
        args.server_labels += [s for s in args.resume_servers if s not in args.server_labels]
    unknown = [s for s in args.server_labels if s not in offswitch.KINDS]
    if unknown:
        parser.error(f"unknown servers {unknown}; choose from {sorted(offswitch.KINDS)}")
    not_hooks = [s for s in args.resume_servers if s in offswitch.KINDS and not offswitch.KINDS[s].hook]
    if not_hooks:
        parser.error(f"--resume-servers {not_hooks}: not hook servers (no controller can drive them)")
    args.stage_list = stages
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stages = args.stage_list
    args.out.mkdir(parents=True, exist_ok=True)
    res = run.Results(args.out)
    res.data["device"] = run.device_info()
    res.data["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    book = offswitch.Book(args.out, res, qualify=False)
    servers: list[offswitch.Server] = []
    bench: Bench | None = None
    deadline = run.T0 + args.deadline_s
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
        for i, label in enumerate(args.server_labels):
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
        bench = Bench(args, book, [s for s in servers if ready[s.spec.label] == "ready"])
        if not args.no_warm:
            warm(bench, args, stages)
        if "accept" in stages:
            stage_accept(bench, args)
        if "closed" in stages:
            stage_loop(bench, args, "closed")
        if "long" in stages:
            stage_loop(bench, args, "long")
        if "open" in stages:
            stage_open(bench, args)
        if "resume" in stages:
            stage_resume(bench, args)
    finally:
        if bench is not None:
            bench.stop()
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
        swaps = [s for s in res.data.get("swaps", []) if "policy" in s and not s.get("live")]
        print(f"\n== controller swaps that did not go live: {swaps}")
        for prefix in ("closed", "long", "open"):
            rows = [r for r in book.rows if r["workload"].startswith(prefix)]
            if rows:
                print(
                    f"\n== {prefix}: throughput (tok/s), ratios to plain per repetition\n"
                    + offswitch.table(rows)
                )
            if prefix == "closed" and rows:
                points = [p for p in book.points if p["workload"].startswith(prefix)]
                print("\n== closed, while all C clients were busy: ratios to plain\n"
                      + offswitch.table(points, key="steady_tok_s"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
