"""The simulator fitted to a realgpu call's traces, against the throughput the call measured.

Run: ``python bench/h200/realgpu_sim.py --sim FIT/sim.json CALL.csv [CALL.csv ...]``
(``FIT``: what ``controller train --traces`` wrote; the CSVs: ``realgpu.py``'s
``summary.csv``, one per call).

For every closed point (policy, C) of the CSVs, the same benchmark in the simulator (the
servers of their own, ``plain`` and SGLang's rule, as :data:`SERVER_SIMS` says): closed loop
at C, max(4, R·C) requests (what ``realgpu.py --requests-per-conc R`` sends; give the call's
R), the policy deciding one step late, throughput = output tokens /
wall time of the whole run, mean over ``--seeds`` (the engine's acceptance draws) and over the
point's repetitions. With ``--draws exact`` (the default) each repetition replays the requests
the call sent in it (``realgpu.point_seed``): their output lengths, and their families, a
family whose drafter accepts under 10% a position (``docs``) as the fit's zero-acceptance
part, the others as its other part (``requests=`` of :mod:`env.workload`), the fit's
population taken at the mix's share of that part (:func:`zero_share`,
``env.acceptance.with_zero_share``). With ``fresh`` the
simulator draws its own: the point's prompt and output lengths (fixed, or log-normal for a
``N~SIGMA`` workload) and the fit's acceptance mixture; one repetition's length draws alone
move a point's throughput by 6-9% at C = 64 with 8C requests, so ``fresh`` compares
distributions, not runs. Policies of an ``N~SIGMA`` workload are labelled ``[N~SIGMA]``.
``realgpu.py`` sends a point's prompts once before timing it only when they fit in half the KV
cap (``realgpu.prewarmed``): those points replay with ``--prefix-hit`` (default 0.99, what the
H200 traces showed, ``bench/sim_vs_real.py``) in place of the fit's, the others with none.
``--call-args`` reads the call's KV cap, prewarm rule and family mix from its point file
(``offswitch.json`` or a committed copy; else ``realgpu.py``'s defaults); given once per CSV,
each call is replayed with its own and the summary is over them all. The HTTP and tokenizer path
before the scheduler, which no step record sees, is left at the fit's (none) unless
``--ttft-points`` names the calls' point files (``offswitch.json`` or a committed copy): then
it is fitted to the measured time to first token of ``static:0`` at the smallest and largest C
(``env.fit.fit_request_path``, as ``bench/sim_vs_real.py`` does). Prints one row per point and
the mean and worst absolute error, apart for the hook server's policies (which the fit's step
records are of) and for the servers of their own.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from controller.baselines import SGLANG_DEFAULT_ADAPTIVE_CONFIG  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402  (this folder's modules: the requests a point sends,
import policyswap  # noqa: E402  which zip each policy name serves,
import realgpu  # noqa: E402  the call's rules (seeds, prewarm) and the hook server's depths,
import realgpu_report  # noqa: E402  the calls' summary.csv,
import testbed  # noqa: E402  the families' acceptance)

DEPTHS = realgpu.DEPTHS
ZERO_Q = 0.1  # a family accepting less than this per position is the fit's zero-acceptance part
# The policies that are servers of their own (realgpu.SERVER_POLICIES), as the simulator runs
# them: the rule, its depths, and how that server runs depth 0 (``LatencyParams.off_path`` and
# ``off_extend``). The plain server is depth 0 with no drafter at all; SGLang's rule runs
# SGLang's own depth 0 (a width-1 verify), with its default tiers' depths (``--speculative-
# num-steps 7``) or, tuned, the hook server's.
_SGLANG_DEFAULT_DEPTHS = tuple(
    sorted({0, *(d for tier in SGLANG_DEFAULT_ADAPTIVE_CONFIG.values() for d in tier["candidate_steps"])})  # type: ignore[attr-defined]
)
_PLAIN = ("builtin:static:0", DEPTHS, {"off_path": "plain", "off_extend": 0.0})
SERVER_SIMS: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = {
    "plain": _PLAIN,
    "plain-rec": _PLAIN,  # the same server, started through the hook's launcher
    "sglang-adaptive-default": ("builtin:sglang-adaptive", _SGLANG_DEFAULT_DEPTHS, {"off_path": "verify"}),
    "sglang-adaptive-tuned": ("builtin:sglang-adaptive-all", DEPTHS, {"off_path": "verify"}),
}


def in_zero_part(family: str) -> bool:
    """Whether a testbed family's requests are the fit's zero-acceptance part (``docs``)."""
    return testbed.FAMILIES[family].q < ZERO_Q


def measured(paths: list[Path]) -> dict[tuple[str, str, int], dict[int, float]]:
    """(workload, policy, C) → {repetition: tok/s}, closed points only."""
    out: dict[tuple[str, str, int], dict[int, float]] = defaultdict(dict)
    for row in realgpu_report.read_rows(paths):
        if row["workload"].startswith("closed"):
            out[(row["workload"], row["policy"], row["concurrency"])][row["rep"]] = row["tok_s"]
    return dict(out)


def call_args(path: Path | None) -> argparse.Namespace:
    """The call's ``realgpu.py`` arguments: from its point file, else the script's defaults."""
    args = realgpu.build_parser().parse_args([])
    if path is not None:
        for k, v in json.loads(path.read_text()).get("args", {}).items():
            setattr(args, k, v)
    return args


def point_load(workload: str, c: int, rep: int, per_conc: int, mix: str) -> loadgen.LoadSpec:
    """The load ``realgpu.py`` sent for a closed point in repetition ``rep``."""
    prompt, out = workload.split("-")[-2:]
    median, _, sigma = out.partition("~")
    return loadgen.LoadSpec(
        c, max(4, per_conc * c), int(prompt), int(median), seed=realgpu.point_seed(rep, c), mix=mix,
        output_sigma=float(sigma or 0.0),
    )  # fmt: skip


def point_hit(workload: str, c: int, per_conc: int, call: argparse.Namespace, prefix_hit: float) -> float:
    """The prefix-cache hit of a closed point: ``prefix_hit`` where ``realgpu.py`` sent its
    prompts before timing it, 0 where it ran cold."""
    load = point_load(workload, c, 1, per_conc, call.mix)
    cached = realgpu.prewarmed(load.n_requests, load.input_tokens, call.max_total_tokens, call.prewarm)
    return prefix_hit if cached else 0.0


def write_requests(spec: loadgen.LoadSpec, path: Path) -> Path:
    """``spec``'s requests as a ``requests=`` file: lengths, and each family's acceptance part."""
    fams = loadgen.families(spec)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["prompt_tokens", "output_tokens", "zero_accept"])
        for out, fam in zip(loadgen.output_lengths(spec), fams):
            zero = "" if not fam else int(in_zero_part(fam))
            w.writerow([spec.input_tokens, out, zero])
    return path


def measured_ttft(files: list[Path], policy: str = "static:0") -> tuple[str, dict[int, float]]:
    """The closed workload of the points files and, per C, the mean over its repetitions of
    ``policy``'s mean time to first token (ms)."""
    by_c: dict[int, list[float]] = defaultdict(list)
    workloads = set()
    for f in files:
        for pt in json.loads(f.read_text()).get("points", []):
            if pt["workload"].startswith("closed") and pt["policy"] == policy and pt.get("ttft_ms_mean") is not None:
                by_c[int(pt["concurrency"])].append(float(pt["ttft_ms_mean"]))
                workloads.add(pt["workload"])
    if len(workloads) != 1:
        raise ValueError(f"points of {policy} in {len(workloads)} closed workloads (need one): {sorted(workloads)}")
    return workloads.pop(), {c: float(np.mean(v)) for c, v in sorted(by_c.items())}


def zero_share(mix: str) -> float:
    """The share of a call's requests in the fit's zero-acceptance part: ``loadgen`` draws each
    request's family uniformly from the mix, and a family accepting under :data:`ZERO_Q` a
    position (``docs``) is that part."""
    names = [f for f in mix.split(",") if f]
    return sum(in_zero_part(f) for f in names) / len(names) if names else 0.0


def sim_workload(workload: str, c: int, per_conc: int = 2) -> str:
    """The simulator's spec for a closed point of ``realgpu.py``: ``closed-mix-IN-OUT`` (OUT
    ``N`` or ``N~SIGMA``, drawn output lengths) at C, max(4, ``per_conc``·C) requests."""
    prompt, out = workload.split("-")[-2:]
    return f"closed:{c}@prompt={prompt},output={out},n={max(4, per_conc * c)}"


def at_share(params: Any, call: argparse.Namespace) -> Any:
    """The fit with its population at the share of the call's mix in the zero-acceptance part,
    for a replay that sets each request's part (``env.acceptance.with_zero_share``)."""
    from env.acceptance import with_zero_share

    if zero_share(call.mix) > 0.0:
        # Each replayed request is in the zero part or not as its family says, so the fit's
        # population is taken at that share (env.acceptance.with_zero_share): the fit alone
        # put 0.29 of the H100 testbed's requests there, where a third are documents, and gave
        # the rest too low an acceptance (drafting policies 5-10% slow at C = 1-4).
        params = replace(params, acceptance=with_zero_share(params.acceptance, zero_share(call.mix)))
    return params


def policy_sim(policy: str) -> tuple[Callable[..., Any] | None, tuple[int, ...], dict[str, Any]]:
    """How the simulator runs ``policy``: its factory (None: one it cannot run, e.g. a zip
    that is not there), depths, and the server's latency overrides (:data:`SERVER_SIMS`)."""
    from controller.errors import PolicyLoadError
    from controller.registry import make_factory

    spec, depths, server = SERVER_SIMS.get(policy, (policyswap.resolve(policy).spec, DEPTHS, {}))
    try:
        return make_factory(spec, depths), depths, server
    except PolicyLoadError:
        return None, depths, server


def point_params(params: Any, hit: float, server: dict[str, Any]) -> Any:
    """``params`` for one point: the radix cache's ``hit`` and the server's latency overrides."""
    return replace(
        params, engine=replace(params.engine, prefix_cache_hit=hit), latency=replace(params.latency, **server)
    )


ACTION_DELAY = 3
"""Steps between a record and the step that runs the decision made from it, on the H100
testbed's hook server: the depth it ran followed 98-100% of the bundled and the retrained
policy's decision changes three steps later, 3-4% two steps later (``decision_delay.py`` on
calls S and X's traces). The simulator's default is 1."""


def replay(
    params: Any,
    points: dict[tuple[str, str, int], dict[int, float]],
    seeds: int,
    per_conc: int = 2,
    *,
    exact: bool = True,
    call: argparse.Namespace | None = None,
    prefix_hit: float = 0.99,
    action_delay: int = ACTION_DELAY,
) -> list[tuple[str, int, list[float], float | None]]:
    """Each point's benchmark in the simulator: (policy, C, measured tok/s per repetition,
    simulated tok/s or None for a policy the simulator cannot run, e.g. SGLang's own rule)."""
    from env.runner import simulate

    call = call or call_args(None)
    if exact:
        params = at_share(params, call)
    out: list[tuple[str, int, list[float], float | None]] = []
    with tempfile.TemporaryDirectory(prefix="realgpu-sim-") as tmp:
        for (workload, policy, c), reps in sorted(points.items()):
            factory, depths, server = policy_sim(policy)
            label = f"{policy} [{workload.split('-')[-1]}]" if "~" in workload else policy
            if factory is None:
                out.append((label, c, list(reps.values()), None))
                continue
            point = point_params(params, point_hit(workload, c, per_conc, call, prefix_hit), server)
            if exact:  # the requests each repetition sent
                loads = [point_load(workload, c, r, per_conc, call.mix) for r in sorted(reps)]
                files = [write_requests(ld, Path(tmp) / f"{c}-{ld.seed}.csv") for ld in loads]
                specs = [f"closed:{c}@requests={f}" for f in files]
            else:
                specs = [sim_workload(workload, c, per_conc)]
            sims = [
                simulate(point, wl, factory(depths), depths=depths, seed=seed, action_delay=action_delay).throughput_tok_s
                for wl in specs
                for seed in range(seeds)
            ]
            out.append((label, c, [reps[r] for r in sorted(reps)], float(np.mean(sims))))
    return out


def main(argv: list[str] | None = None) -> int:
    from env.params import SimParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", type=Path, required=True, help="the fitted sim.json")
    ap.add_argument("csv", type=Path, nargs="+", help="realgpu summary.csv files (or the call folders)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument(
        "--prefix-hit", type=float, default=0.99,
        help="the radix cache's hit on a point whose prompts were sent before it (others: 0)",
    )  # fmt: skip
    ap.add_argument(
        "--action-delay", type=int, default=ACTION_DELAY,
        help=f"steps between a record and the step its decision runs at (default {ACTION_DELAY}, as measured)",
    )  # fmt: skip
    ap.add_argument(
        "--draws", choices=("exact", "fresh"), default="exact",
        help="exact: replay the requests each repetition sent; fresh: the simulator draws its own",
    )  # fmt: skip
    ap.add_argument(
        "--call-args", type=Path, action="append", default=[],
        help="a call's point file (offswitch.json or a committed copy): its KV cap, prewarm rule and mix; "
        "once for every CSV, or once per CSV in their order (each call replayed with its own)",
    )  # fmt: skip
    ap.add_argument(
        "--requests-per-conc", type=int, default=None,
        help="the calls' realgpu.py --requests-per-conc (a point sends max(4, this x C) requests; "
        "default: --call-args', else realgpu.py's default, 2)",
    )  # fmt: skip
    ap.add_argument(
        "--ttft-points", type=Path, action="append", default=[],
        help="a call's point file (offswitch.json; repeatable): fit the request path to static:0's measured TTFTs",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.requests_per_conc is not None and args.requests_per_conc < 1:
        ap.error("--requests-per-conc must be at least 1")
    if len(args.call_args) not in (0, 1, len(args.csv)):
        ap.error(f"--call-args: once, or once per CSV ({len(args.csv)}); got {len(args.call_args)}")
    if args.ttft_points and len(args.call_args) > 1:
        ap.error("--ttft-points fits one call's request path: give one --call-args with it")
    missing = [str(args.sim)] if not args.sim.is_file() else []
    missing += [str(p) for p in args.call_args if not p.is_file()]
    missing += [str(p) for p in args.ttft_points if not p.is_file()]
    missing += [str(p) for p in args.csv if not (p.is_file() or (p / "summary.csv").is_file())]
    if missing:
        print(f"realgpu_sim: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    params = SimParams.from_dict(json.loads(args.sim.read_text()))
    # (the call's arguments, its CSVs): one group for every CSV, or one per CSV
    if len(args.call_args) > 1:
        groups = [(call_args(ca), [path]) for ca, path in zip(args.call_args, args.csv)]
    else:
        groups = [(call_args(args.call_args[0] if args.call_args else None), list(args.csv))]
    if args.ttft_points:  # with one group only (checked above)
        call = groups[0][0]
        per_conc = args.requests_per_conc or int(call.requests_per_conc)
        from env.fit import fit_request_path

        try:
            workload, ttft = measured_ttft(args.ttft_points)
        except ValueError as e:
            print(f"realgpu_sim: {e}", file=sys.stderr)
            return 2
        if not ttft:
            print("realgpu_sim: no static:0 time to first token in the points files", file=sys.stderr)
            return 2
        params = fit_request_path(
            params, ttft, lambda c: sim_workload(workload, c, per_conc),
            lambda c: point_hit(workload, c, per_conc, call, args.prefix_hit),
        )  # fmt: skip
        e = params.engine
        print(
            f"request path fitted to static:0's TTFT at C = {min(ttft)} and {max(ttft)} "
            f"({ttft[min(ttft)]:.1f} / {ttft[max(ttft)]:.1f} ms): {e.request_latency_us / 1000:.1f} ms "
            f"+ {e.request_serial_us / 1000:.2f} ms per request\n"
        )
    errors: dict[bool, list[float]] = {False: [], True: []}  # by: is the point a server of its own
    for call, paths in groups:
        if len(groups) > 1:
            print(f"\n{', '.join(p.name for p in paths)}\n")
        print("| policy | C | measured tok/s, mean (min-max) | simulated | error |")
        print("|---|---|---|---|---|")
        points = replay(
            params, measured(paths), args.seeds, args.requests_per_conc or int(call.requests_per_conc),
            exact=args.draws == "exact", call=call, prefix_hit=args.prefix_hit, action_delay=args.action_delay,
        )  # fmt: skip
        for policy, c, reps, sim in points:
            real = float(np.mean(reps))
            if sim is None:
                print(f"| {policy} | {c} | {real:.0f} | - | not simulated |")
                continue
            errors[policy.split(" [")[0] in SERVER_SIMS].append(sim / real - 1.0)
            print(
                f"| {policy} | {c} | {real:.0f} ({min(reps):.0f}-{max(reps):.0f}) | {sim:.0f} | {100 * (sim / real - 1):+.1f}% |"
            )
    # The fit is of the hook server's step records: its policies are what it predicts; the
    # servers of their own (no step record of theirs in the fit) are a separate question.
    for own, what in ((False, "the hook server's policies"), (True, "the servers of their own (plain, SGLang's rule)")):
        if errors[own]:
            err = np.abs(np.array(errors[own]))
            worst = errors[own][int(np.argmax(err))]
            print(f"\n{len(err)} points of {what}: mean absolute error {100 * err.mean():.1f}%, worst {100 * worst:+.1f}%")
    if errors[False] and errors[True]:
        err = np.abs(np.array(errors[False] + errors[True]))
        print(f"\nall {len(err)} points: mean absolute error {100 * err.mean():.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
