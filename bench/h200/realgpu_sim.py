"""The simulator fitted to a realgpu call's traces, against the throughput the call measured.

Run: ``python bench/h200/realgpu_sim.py --sim FIT/sim.json CALL.csv [CALL.csv ...]``
(``FIT``: what ``controller train --traces`` wrote; the CSVs: ``realgpu.py``'s
``summary.csv``, one per call).

For every closed and long point (policy, C) of the CSVs, the same benchmark in the simulator (the
servers of their own, ``plain`` and SGLang's rule, as :data:`SERVER_SIMS` says): closed loop
at C, max(4, R·C) requests (what ``realgpu.py --requests-per-conc R`` sends; give the call's
R; a long point, C requests of its prompt length), the policy deciding one step late, throughput = output tokens /
wall time of the whole run, mean over ``--seeds`` (the engine's acceptance draws; more for a point
of few requests, :func:`draws_for`) and over the
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

Open points (``realgpu.py --stages open``, workload ``open-shift-{S}s``) replay the call's
trace (``realgpu.open_spec`` from the call's ``--open-s``, ``--open-peak-rps``,
``--input-tokens`` and ``--open-seed``: give its ``--call-args``) as a ``replay:`` file
(:func:`write_arrivals`: each request's arrival, prompt and output length, and its family's
acceptance part), cold (``realgpu.py`` sends no open prompt before it), each policy as a closed
point's: throughput = output tokens / the time from the trace's start to the last completion,
and the mean over requests of the time per output token, whose inverse (the per-request decode
speed) is what the open stage scores; over an open trace the arrivals fix most of the throughput.
``--predict-open POLICIES`` simulates a trace no call has run yet (``--open-s``,
``--open-peak-rps``, ``--input-tokens``, ``--open-seed``; the rest from ``--call-args``, else
``realgpu.py``'s defaults), with or without CSVs to replay.
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
import openloop  # noqa: E402  the open stage's trace,
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
    """(workload, policy, C) → {repetition: tok/s}, closed and long points."""
    out: dict[tuple[str, str, int], dict[int, float]] = defaultdict(dict)
    for row in realgpu_report.read_rows(paths):
        if row["workload"].startswith(("closed", "long")):
            out[(row["workload"], row["policy"], row["concurrency"])][row["rep"]] = row["tok_s"]
    return dict(out)


def measured_open(paths: list[Path]) -> dict[tuple[str, str], dict[int, tuple[float, float]]]:
    """(workload, policy) → {repetition: (tok/s, mean TPOT ms)}, open points only."""
    out: dict[tuple[str, str], dict[int, tuple[float, float]]] = defaultdict(dict)
    for row in realgpu_report.read_rows(paths):
        if row["workload"].startswith("open"):
            out[(row["workload"], row["policy"])][row["rep"]] = (row["tok_s"], row["tpot_ms_mean"])
    return dict(out)


def call_args(path: Path | None) -> argparse.Namespace:
    """The call's ``realgpu.py`` arguments: from its point file, else the script's defaults;
    ``run_order``: the call's closed and long points as they ran, (server, workload, policy, C,
    repetition) (empty without a point file)."""
    args = realgpu.build_parser().parse_args([])
    args.run_order = []
    if path is not None:
        data = json.loads(path.read_text())
        for k, v in data.get("args", {}).items():
            setattr(args, k, v)
        args.run_order = [
            (pt.get("server", ""), pt["workload"], pt["policy"], int(pt["concurrency"]), int(pt["rep"]))
            for pt in data.get("points", [])
            if pt["workload"].startswith(("closed", "long"))
        ]
    return args


def point_load(workload: str, c: int, rep: int, per_conc: int, mix: str) -> loadgen.LoadSpec:
    """The load ``realgpu.py`` sent for a closed or long point in repetition ``rep``
    (``realgpu.stage_loop``: a long point sends C requests, one wave)."""
    stage = workload.split("-")[0]
    prompt, out = workload.split("-")[-2:]
    median, _, sigma = out.partition("~")
    return loadgen.LoadSpec(
        c, max(4, per_conc * c) if stage == "closed" else c, int(prompt), int(median),
        seed=realgpu.point_seed(rep, c, stage), mix=mix, output_sigma=float(sigma or 0.0),
    )  # fmt: skip


def point_hit(workload: str, c: int, per_conc: int, call: argparse.Namespace, prefix_hit: float) -> float:
    """The prefix-cache hit of a closed or long point: ``prefix_hit`` where ``realgpu.py`` sent its
    prompts before timing it, 0 where it ran cold."""
    load = point_load(workload, c, 1, per_conc, call.mix)
    cached = realgpu.prewarmed(load.n_requests, load.input_tokens, call.max_total_tokens, call.prewarm)
    return prefix_hit if cached else 0.0


def carried_hits(call: argparse.Namespace, per_conc: int, prefix_hit: float) -> dict[tuple[str, str, int, int], float]:
    """(workload, policy, C, repetition) → the point's prefix-cache hit, for the points of
    ``call.run_order``: ``prefix_hit`` where ``realgpu.py`` sent its prompts before timing it,
    else the share of its prompt tokens that its server's radix cache still held from the
    call's earlier points. ``loadgen`` draws a point's prompts one after another from one
    stream seeded by (repetition, C), so the same point under the next policy sends the same
    prompts, and the first prompt of a long point is the first prompt of the same C's shorter
    lengths with more tokens after it: on an H100 (call AS) a lone 32k prompt run cold after the
    16k point found 16,384 of its tokens cached. The cache is modelled per server as whole
    requests, each holding its prompt and output tokens past the longest prefix it found
    cached (a radix tree stores a shared prefix once), evicted least recently used beyond
    ``--max-total-tokens``; the warm-up's requests (seeds of their own) are left out, so it
    errs towards hits."""
    from collections import OrderedDict

    cap = int(call.max_total_tokens)
    # per server: (workload, C, repetition, request) → (prompt tokens, KV tokens it holds)
    caches: dict[str, OrderedDict[tuple[str, int, int, int], tuple[np.ndarray, int]]] = defaultdict(OrderedDict)
    prompts_of: dict[tuple[str, int, int], list[np.ndarray]] = {}
    hits: dict[tuple[str, str, int, int], float] = {}
    for server, workload, policy, c, rep in call.run_order:
        load = point_load(workload, c, rep, per_conc, call.mix)
        key = (workload, c, rep)
        if key not in prompts_of:  # every policy of a repetition sends the same prompts
            prompts_of[key] = [np.asarray(p, dtype=np.int64) for p in loadgen.prompts(load)]
        prompts = prompts_of[key]
        cache = caches[server]
        common = []  # each prompt's longest prefix already cached
        for p in prompts:
            best, used = 0, None
            for ident, (q, _) in cache.items():
                n = min(len(p), len(q))
                differ = np.flatnonzero(p[:n] != q[:n])
                same = n if differ.size == 0 else int(differ[0])
                if same > best:
                    best, used = same, ident
            if used is not None:
                cache.move_to_end(used)
            common.append(best)
        if realgpu.prewarmed(load.n_requests, load.input_tokens, cap, call.prewarm):
            hits[(workload, policy, c, rep)] = prefix_hit
        else:
            hits[(workload, policy, c, rep)] = sum(common) / max(1, sum(len(p) for p in prompts))
        # A radix tree holds a shared prefix once: each request adds the tokens past it.
        for i, (p, out, same) in enumerate(zip(prompts, loadgen.output_lengths(load), common)):
            if (*key, i) not in cache:  # (the same request again is already there)
                cache[(*key, i)] = (p, len(p) + out - same)
            cache.move_to_end((*key, i))
        total = sum(size for _, size in cache.values())
        while cache and total > cap:
            total -= cache.popitem(last=False)[1][1]
    return hits


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


def write_arrivals(spec: openloop.OpenSpec, path: Path) -> Path:
    """``spec``'s trace as a ``replay:`` file: each request's arrival, lengths and family's
    acceptance part (``zero_accept``, as :func:`write_requests` writes it)."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["arrival_s", "prompt_tokens", "output_tokens", "zero_accept"])
        for a in openloop.arrivals(spec):
            w.writerow([a.t_s, spec.input_tokens, a.output_tokens, int(in_zero_part(a.family))])
    return path


def open_spec(workload: str, call: argparse.Namespace, rep: int) -> openloop.OpenSpec:
    """The trace ``realgpu.py`` sent for an open point (``open-shift-{S}s``) in repetition ``rep``.

    Raises:
        ValueError: the workload's arrival window is not the call's ``--open-s`` (the call's
            arguments were not given, or not this call's).
    """
    spec = realgpu.open_spec(call, rep)
    if workload != f"open-shift-{spec.duration_s:g}s":
        raise ValueError(
            f"{workload}: the call's arguments say --open-s {spec.duration_s:g}; give that call's "
            "point file with --call-args (its --open-s, --open-peak-rps and --open-seed)"
        )
    return spec


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


def point_label(policy: str, workload: str) -> str:
    """``policy``, tagged with its drawn output lengths (``[N~SIGMA]``) and a long point's
    prompt length (``[long 32768]``)."""
    prompt, out = workload.split("-")[-2:]
    tags = ([out] if "~" in out else []) + ([f"long {prompt}"] if workload.startswith("long") else [])
    return f"{policy} [{', '.join(tags)}]" if tags else policy


def sim_workload(workload: str, c: int, per_conc: int = 2) -> str:
    """The simulator's spec for a closed or long point of ``realgpu.py``: ``STAGE-mix-IN-OUT``
    (OUT ``N`` or ``N~SIGMA``, drawn output lengths) at C, as many requests as
    :func:`point_load`."""
    load = point_load(workload, c, 1, per_conc, "")
    out = workload.split("-")[-1]
    return f"closed:{c}@prompt={load.input_tokens},output={out},n={load.n_requests}"


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


def at_cap(params: Any, call: argparse.Namespace) -> Any:
    """The fit with the call's KV cap: ``--max-total-tokens`` caps each server's target pool
    (the drafter's KV sits in a pool of its own), so the speculating server holds that many
    tokens, as plain does; the fit's budget is the median of the traces it read, whatever
    their calls' caps were."""
    engine = params.engine
    return replace(params, engine=replace(engine, kv_budget_tokens=engine.plain_budget_for(call.max_total_tokens)))


PLAIN_SERVERS = tuple(name for name, sim in SERVER_SIMS.items() if sim is _PLAIN)
"""The servers of their own that run no drafter: ``--plain-sim`` gives them their own latency."""


def policy_sim(
    policy: str, plain_latency: Any = None
) -> tuple[Callable[..., Any] | None, tuple[int, ...], dict[str, Any]]:
    """How the simulator runs ``policy``: its factory (None: one it cannot run, e.g. a zip
    that is not there), depths, and the server's latency overrides (:data:`SERVER_SIMS`).
    ``plain_latency`` (``LatencyParams``, ``--plain-sim``): the plain server's own, for
    :data:`PLAIN_SERVERS`; None prices them as the fit's depth 0 without a drafter."""
    from controller.errors import PolicyLoadError
    from controller.registry import make_factory

    spec, depths, server = SERVER_SIMS.get(policy, (policyswap.resolve(policy).spec, DEPTHS, {}))
    if plain_latency is not None and policy in PLAIN_SERVERS:
        server = {**plain_latency.to_dict(), **server}
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


MIN_REQUEST_DRAWS = 32
"""A closed or long point is replayed over at least this many requests' acceptance draws
(:func:`draws_for`). A point of one request measures that request's acceptance: at C = 1 at
4k-32k tokens, two seeds put the drafted points 7-23% above the H100 calls AQ and AS, sixteen
within -15% to +1%, with the step times priced within 1% there."""


def draws_for(seeds: int, n_requests: int) -> int:
    """The seeds a point of ``n_requests`` requests is simulated with: ``seeds``, or more, so
    that the mean is over at least :data:`MIN_REQUEST_DRAWS` requests' acceptance."""
    return max(seeds, -(-MIN_REQUEST_DRAWS // max(1, n_requests)))


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
    plain_latency: Any = None,
) -> list[tuple[str, int, list[float], float | None]]:
    """Each point's benchmark in the simulator: (policy, C, measured tok/s per repetition,
    simulated tok/s or None for a policy the simulator cannot run, e.g. SGLang's own rule);
    ``plain_latency`` as :func:`policy_sim` takes it."""
    from env.runner import simulate

    call = call or call_args(None)
    params = at_cap(params, call)
    if exact:
        params = at_share(params, call)
    carried = carried_hits(call, per_conc, prefix_hit)
    out: list[tuple[str, int, list[float], float | None]] = []
    with tempfile.TemporaryDirectory(prefix="realgpu-sim-") as tmp:
        for (workload, policy, c), reps in sorted(points.items()):
            factory, depths, server = policy_sim(policy, plain_latency)
            label = point_label(policy, workload)
            if factory is None:
                out.append((label, c, list(reps.values()), None))
                continue
            default_hit = point_hit(workload, c, per_conc, call, prefix_hit)
            hits = [carried.get((workload, policy, c, r), default_hit) for r in sorted(reps)]
            if exact:  # the requests each repetition sent, into the cache it found
                loads = [point_load(workload, c, r, per_conc, call.mix) for r in sorted(reps)]
                files = [write_requests(ld, Path(tmp) / f"{c}-{ld.seed}.csv") for ld in loads]
                runs = [(point_params(params, h, server), f"closed:{c}@requests={f}") for h, f in zip(hits, files)]
            else:
                runs = [(point_params(params, float(np.mean(hits)), server), sim_workload(workload, c, per_conc))]
            n_requests = point_load(workload, c, 1, per_conc, call.mix).n_requests
            sims = [
                simulate(point, wl, factory(depths), depths=depths, seed=seed, action_delay=action_delay).throughput_tok_s
                for point, wl in runs
                for seed in range(draws_for(seeds, n_requests))
            ]
            out.append((label, c, [reps[r] for r in sorted(reps)], float(np.mean(sims))))
    return out


def simulate_open(
    params: Any,
    policy: str,
    traces: list[tuple[openloop.OpenSpec, Path]],
    seeds: int,
    action_delay: int = ACTION_DELAY,
    plain_latency: Any = None,
) -> tuple[float, float] | None:
    """``policy`` over open traces in the simulator (``params`` as :func:`at_share` gave it):
    (tok/s, mean TPOT ms), each the mean over the traces and ``--seeds``; None for a policy it
    cannot run. ``traces``: each trace's spec and its :func:`write_arrivals` file."""
    from env.runner import simulate

    factory, depths, server = policy_sim(policy, plain_latency)
    if factory is None:
        return None
    point = point_params(params, 0.0, server)  # cold: realgpu.py sends no open prompt before the trace
    tok_s, tpot_ms = [], []
    for spec, path in traces:
        # The replay's clock starts at the first arrival, the measured wall time at the trace's start.
        lead_s = openloop.arrivals(spec)[0].t_s
        for seed in range(seeds):
            run = simulate(
                point, f"replay:{path}", factory(depths), depths=depths, seed=seed, action_delay=action_delay
            )
            tok_s.append(run.tokens / (run.duration_s + lead_s))
            tpot_ms.append(run.tpot_ms_mean)
    return float(np.mean(tok_s)), float(np.mean(tpot_ms))


def replay_open(
    params: Any,
    points: dict[tuple[str, str], dict[int, tuple[float, float]]],
    seeds: int,
    *,
    call: argparse.Namespace | None = None,
    action_delay: int = ACTION_DELAY,
    plain_latency: Any = None,
) -> list[tuple[str, str, list[tuple[float, float]], tuple[float, float] | None]]:
    """Each open point's trace in the simulator: (policy, workload, measured (tok/s, mean TPOT
    ms) per repetition, simulated (tok/s, mean TPOT ms) or None for a policy it cannot run).

    Raises:
        ValueError: a workload whose arrival window is not the call's (:func:`open_spec`).
    """
    call = call or call_args(None)
    params = at_share(at_cap(params, call), call)
    out: list[tuple[str, str, list[tuple[float, float]], tuple[float, float] | None]] = []
    with tempfile.TemporaryDirectory(prefix="realgpu-sim-") as tmp:
        files: dict[openloop.OpenSpec, Path] = {}
        for (workload, policy), reps in sorted(points.items()):
            specs = {open_spec(workload, call, r) for r in sorted(reps)}  # one trace for every repetition
            for spec in specs - set(files):
                files[spec] = write_arrivals(spec, Path(tmp) / f"open-{len(files)}.csv")
            traces = [(spec, files[spec]) for spec in sorted(specs, key=repr)]
            sim = simulate_open(params, policy, traces, seeds, action_delay, plain_latency)
            out.append((policy, workload, [reps[r] for r in sorted(reps)], sim))
    return out


def predict_open(
    params: Any,
    policies: list[str],
    spec: openloop.OpenSpec,
    seeds: int,
    *,
    call: argparse.Namespace | None = None,
    action_delay: int = ACTION_DELAY,
    plain_latency: Any = None,
) -> list[tuple[str, tuple[float, float] | None]]:
    """Each policy over the open trace ``spec`` (no call has run it): (policy, simulated
    (tok/s, mean TPOT ms) or None for a policy the simulator cannot run)."""
    call = call or call_args(None)
    params = at_share(at_cap(params, call), call)
    with tempfile.TemporaryDirectory(prefix="realgpu-sim-") as tmp:
        traces = [(spec, write_arrivals(spec, Path(tmp) / "open.csv"))]
        return [(p, simulate_open(params, p, traces, seeds, action_delay, plain_latency)) for p in policies]


def _spread(values: list[float], fmt: str) -> str:
    """The mean (min-max) of a point's repetitions."""
    return f"{np.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def print_open(
    points: list[tuple[str, str, list[tuple[float, float]], tuple[float, float] | None]],
) -> list[tuple[float, float]]:
    """The open points' table; returns each simulated point's (tok/s error, mean TPOT error)."""
    print("| policy | open trace | measured tok/s, mean (min-max) | simulated | error "
          "| measured mean TPOT ms, mean (min-max) | simulated | error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    for policy, workload, reps, sim in points:
        tok, tpot = [r[0] for r in reps], [r[1] for r in reps]
        if sim is None:
            tok_cell, tpot_cell = _spread(tok, ".0f"), _spread(tpot, ".2f")
            print(f"| {policy} | {workload} | {tok_cell} | - | not simulated | {tpot_cell} | - | |")
            continue
        err = (sim[0] / np.mean(tok) - 1.0, sim[1] / np.mean(tpot) - 1.0)
        errors.append(err)
        print(
            f"| {policy} | {workload} | {_spread(tok, '.0f')} | {sim[0]:.0f} | {100 * err[0]:+.1f}% "
            f"| {_spread(tpot, '.2f')} | {sim[1]:.2f} | {100 * err[1]:+.1f}% |"
        )
    return errors


def main(argv: list[str] | None = None) -> int:
    from env.params import SimParams, warm_resumed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", type=Path, required=True, help="the fitted sim.json")
    ap.add_argument("csv", type=Path, nargs="*", help="realgpu summary.csv files (or the call folders)")
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
        help="a call's point file (offswitch.json; repeatable): fit the request path to static:0's measured TTFTs "
        "(with that call's own arguments where the file has them: another call's points may be replayed)",
    )  # fmt: skip
    ap.add_argument(
        "--resume", choices=("as-fitted", "warm"), default="as-fitted",
        help="warm: the hook resumes drafting warm (calls from AA on; env.params.warm_resumed): one more "
        "depth-0 step, and the fit's resume loss taken out; as-fitted: as the fit says",
    )  # fmt: skip
    ap.add_argument(
        "--plain-sim", type=Path, default=None,
        help="the plain server's own fit (controller fit --traces <plain-rec's traces> --passes-from SIM "
        "--off-draft skip): plain and plain-rec replay with its latency; default: the fit's depth 0 "
        "without a drafter (the hook server's overheads and admissions)",
    )  # fmt: skip
    ap.add_argument(
        "--predict-open", type=lambda s: [p for p in s.split(",") if p], default=None, metavar="POLICIES",
        help="simulate the open stage's trace for these policies (comma list), with no measured CSV",
    )  # fmt: skip
    defaults = realgpu.build_parser()
    for flag, kind in (
        ("--open-s", float),
        ("--open-peak-rps", float),
        ("--input-tokens", int),
        ("--open-seed", int),
        ("--max-total-tokens", int),
    ):
        dest = flag[2:].replace("-", "_")
        default = defaults.get_default(dest)
        ap.add_argument(
            flag, type=kind, default=None,
            help=f"with --predict-open: realgpu.py's {flag} (default: --call-args', else {default})",
        )  # fmt: skip
    args = ap.parse_args(argv)
    trace_flags = {
        k: getattr(args, k) for k in ("open_s", "open_peak_rps", "input_tokens", "open_seed", "max_total_tokens")
    }
    if not args.csv and not args.predict_open:
        ap.error("give realgpu summary.csv files to replay, or --predict-open POLICIES")
    if args.predict_open is not None and not args.predict_open:
        ap.error("--predict-open: name at least one policy")
    if args.predict_open is None and any(v is not None for v in trace_flags.values()):
        ap.error("--open-s, --open-peak-rps, --input-tokens, --open-seed and --max-total-tokens are for --predict-open")
    if args.predict_open and len(args.call_args) > 1:
        ap.error("--predict-open takes one call's arguments: give at most one --call-args")
    if args.requests_per_conc is not None and args.requests_per_conc < 1:
        ap.error("--requests-per-conc must be at least 1")
    if len(args.call_args) not in (0, 1, len(args.csv)):
        ap.error(f"--call-args: once, or once per CSV ({len(args.csv)}); got {len(args.call_args)}")
    if args.ttft_points and len(args.call_args) > 1:
        ap.error("--ttft-points fits one call's request path: give one --call-args with it")
    missing = [str(p) for p in (args.sim, args.plain_sim) if p is not None and not p.is_file()]
    missing += [str(p) for p in args.call_args if not p.is_file()]
    missing += [str(p) for p in args.ttft_points if not p.is_file()]
    missing += [str(p) for p in args.csv if not (p.is_file() or (p / "summary.csv").is_file())]
    if missing:
        print(f"realgpu_sim: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    params = SimParams.from_dict(json.loads(args.sim.read_text()))
    if args.resume == "warm":
        params = warm_resumed(params)
    plain_latency = SimParams.from_json(args.plain_sim).latency if args.plain_sim else None
    # (the call's arguments, its CSVs): one group for every CSV, or one per CSV
    if len(args.call_args) > 1:
        groups = [(call_args(ca), [path]) for ca, path in zip(args.call_args, args.csv)]
    else:
        groups = [(call_args(args.call_args[0] if args.call_args else None), list(args.csv))]
    if args.ttft_points:  # with one group only (checked above)
        call = groups[0][0]
        per_conc = args.requests_per_conc or int(call.requests_per_conc)
        if "args" in json.loads(args.ttft_points[0].read_text()):
            # The TTFTs' own call (its KV cap, prewarm rule, requests a point), so that one
            # call's request path can price another's points (a fit, then held-out calls).
            call = call_args(args.ttft_points[0])
            per_conc = int(call.requests_per_conc)
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
    open_errors: list[tuple[float, float]] = []  # (tok/s, mean TPOT) per open point
    for call, paths in groups if args.csv else []:
        if len(groups) > 1:
            print(f"\n{', '.join(p.name for p in paths)}\n")
        closed, opened = measured(paths), measured_open(paths)
        if opened:
            try:
                open_points = replay_open(
                    params, opened, args.seeds, call=call, action_delay=args.action_delay,
                    plain_latency=plain_latency,
                )  # fmt: skip
            except ValueError as e:
                print(f"realgpu_sim: {e}", file=sys.stderr)
                return 2
            if not closed:  # the open points alone
                open_errors += print_open(open_points)
                continue
        print("| policy | C | measured tok/s, mean (min-max) | simulated | error |")
        print("|---|---|---|---|---|")
        points = replay(
            params, closed, args.seeds, args.requests_per_conc or int(call.requests_per_conc),
            exact=args.draws == "exact", call=call, prefix_hit=args.prefix_hit, action_delay=args.action_delay,
            plain_latency=plain_latency,
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
        if opened:
            print()
            open_errors += print_open(open_points)
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
    if open_errors:
        err = np.abs(np.array(open_errors))
        worst = open_errors[int(np.argmax(err[:, 1]))][1]
        print(
            f"\n{len(err)} open points: mean absolute error {100 * err[:, 0].mean():.1f}% on tok/s, "
            f"{100 * err[:, 1].mean():.1f}% on mean TPOT (worst {100 * worst:+.1f}%)"
        )
    if args.predict_open:  # one call's arguments at most (checked above)
        call = groups[0][0]
        for k, v in trace_flags.items():
            if v is not None:
                setattr(call, k, v)
        spec = realgpu.open_spec(call, 1)  # the trace does not depend on the repetition
        arrivals = openloop.arrivals(spec)
        tokens = sum(a.output_tokens for a in arrivals)
        print(
            f"\nopen-shift-{spec.duration_s:g}s predicted: peak {spec.peak_rps:g} requests/s, "
            f"{spec.input_tokens}-token prompts, seed {spec.seed}: {len(arrivals)} requests, "
            f"{tokens} output tokens\n"
        )
        print(
            "| policy | simulated tok/s | simulated mean TPOT ms | decode tok/s per request (1000 / TPOT) |"
        )
        print("|---|---|---|---|")
        predicted = predict_open(
            params, args.predict_open, spec, args.seeds, call=call, action_delay=args.action_delay,
            plain_latency=plain_latency,
        )  # fmt: skip
        for policy, sim in predicted:
            if sim is None:
                print(f"| {policy} | - | - | not simulated |")
            else:
                print(f"| {policy} | {sim[0]:.0f} | {sim[1]:.2f} | {1000 / sim[1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
