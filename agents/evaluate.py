"""``controller eval``: every policy on identical seeds and workloads in the fitted simulator.

Workloads (the default suite; ``--concurrency`` and ``--scale`` change its size):

- ``closed``: closed-loop concurrency sweep, ``closed:C`` for C in 1…250 — the seed
  deployment's benchmark. Score: throughput (tokens/s).
- ``poisson``: open-loop Poisson arrivals at 30/60/85% of the deployment's capacity
  (capacity: :func:`capacity_req_s`, depth 0 with every slot busy, in steady state). Score: per-request decode
  speed, 1000 / mean TPOT (tokens/s per request) — throughput there is set by the arrivals.
- ``nonstationary``: load ramp, bursts, and acceptance phase shifts between chat-like and
  code-like traffic (closed-loop and open-loop bases). Score: as the base (closed loop:
  throughput; open loop: 1000 / mean TPOT).

Objective (``--objective``, by default the first PPO zip's, else throughput): under
``slo:TPOT_MS`` every workload's score is goodput under the TPOT target instead
(:func:`slo_goodput_tok_s`: tokens/s of the completed requests whose TPOT is at most the
target).

Every (workload, policy) runs on the same seeds 0…n−1, so policies see the same arrivals,
lengths and acceptance draws (common random numbers).

``results.json`` schema (version 1)::

    {
      "schema": 1,
      "config": {...resolved EvalConfig...},
      "sim": "<name>", "objective": "throughput" | "slo:TPOT_MS", "depths": [0, 1, 2, 3, 5], "seeds": [0, 1, 2, 3, 4],
      "workloads": {
        "<spec>": {
          "family": "closed" | "poisson" | "nonstationary",
          "x": <C, or load fraction, or null>,
          "score_metric": "throughput_tok_s" | "per_request_tok_s" | "slo_goodput_tok_s",
          "policies": {
            "<policy>": {
              "<metric>": {"mean": float, "ci95": [lo, hi], "values": [one per seed]},
              ...   # throughput_tok_s, tpot_ms_mean, tpot_ms_p99, per_request_tok_s,
                    # mean_depth, score (+ slo_goodput_tok_s under an SLO objective)
            }
          }
        }
      },
      "targets": [{"name": str, "value": float, "threshold": float, "passed": bool, "detail": str}]
    }

CIs are Student-t 95% intervals of the mean over seeds.
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from agents.report import ci95
from controller.baselines import BASELINES
from controller.errors import ConfigError
from controller.objective import parse_objective
from controller.policy import Policy
from controller.protocol import DEFAULT_DEPTHS
from controller.registry import make_factory

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 250)
POISSON_LOADS = (0.3, 0.6, 0.85)


@dataclass(frozen=True)
class EvalConfig:
    """What ``controller eval`` runs.

    Attributes:
        sim: a fitted sim.json (or None with ``deployment``).
        deployment: a bundled deployment name (or None with ``sim``).
        policies: PPO zips or ``builtin:NAME`` specs to evaluate besides the baselines.
        baselines: ``"all"``, ``"none"`` or a comma list of builtin names (``oracle`` included).
        out: output folder.
        seeds: seeds per (workload, policy).
        scale: multiplies every run's simulated length.
        concurrency: the closed-loop sweep.
        jobs: worker processes.
        depths: allowed depths (default: the PPO zip's, else 0,1,2,3,5).
        closed_s / open_s / nonstationary_s: simulated seconds per run, before ``scale``.
        trace_policies: policies whose depth-vs-batch-size trace is plotted.
        warm_resume: simulate the hook's warm resume in every deployment
            (``env.params.warm_resumed``): one more depth-0 step before drafting resumes, and a
            fit's cold resume loss taken out. The bundled deployments leave it off.
    """

    sim: Path | None = None
    deployment: str | None = None
    policies: tuple[str, ...] = ()
    baselines: str = "all"
    out: Path = Path("eval")
    seeds: int = 5
    scale: float = 1.0
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    jobs: int = 1
    depths: tuple[int, ...] | None = None
    closed_s: float = 20.0
    open_s: float = 30.0
    nonstationary_s: float = 60.0
    trace_policies: tuple[str, ...] = ("ppo", "sglang-adaptive", "goodput-fit", "oracle")
    suite: str | None = None
    perturb: float = 0.0
    only: tuple[str, ...] = ()
    objective: str | None = None
    warm_resume: bool = False

    def __post_init__(self) -> None:
        # Checked here, before any simulation: a bad value must not surface hours (or a progress
        # bar) later as a failing run.
        if not self.concurrency or any(type(c) is not int or c < 1 for c in self.concurrency):
            raise ConfigError(f"--concurrency: every C must be an integer >= 1, got {list(self.concurrency)}")
        if self.seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {self.seeds}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ConfigError(f"--scale must be a positive number, got {self.scale}")
        if self.jobs < 1:
            raise ConfigError(f"--jobs must be >= 1, got {self.jobs}")
        if self.depths is not None and (not self.depths or self.depths[0] < 0):
            raise ConfigError(f"--depths must be non-negative, got {list(self.depths)}")
        if self.objective is not None:
            parse_objective(self.objective)
        if not (self.perturb >= 0 and math.isfinite(self.perturb)):
            raise ConfigError(f"--perturb must be >= 0, got {self.perturb}")
        if self.suite is not None:
            from agents.suite import get_suite

            get_suite(self.suite)
        elif self.sim is None and self.deployment is None:
            raise ConfigError("give --sim, --deployment or --suite")

    @classmethod
    def from_args(cls, args: Any, depths: tuple[int, ...] | None) -> EvalConfig:
        conc: tuple[int, ...] = DEFAULT_CONCURRENCY
        if args.concurrency:
            try:
                conc = tuple(int(c) for c in args.concurrency.split(","))
            except ValueError:
                raise ConfigError(
                    f"--concurrency must be a comma list of integers: {args.concurrency!r}"
                ) from None
        return cls(
            sim=args.sim,
            deployment=args.deployment,
            policies=tuple(args.policy),
            baselines=args.baselines,
            out=args.out,
            seeds=args.seeds if args.seeds is not None else 5,
            scale=args.scale if args.scale is not None else 1.0,
            concurrency=conc,
            jobs=args.jobs,
            depths=depths,
            suite=getattr(args, "suite", None),
            perturb=getattr(args, "perturb", None) or 0.0,
            only=tuple(x for x in (getattr(args, "only", None) or "").split(",") if x),
            objective=getattr(args, "objective", None),
            warm_resume=bool(getattr(args, "warm_resume", False)),
        )


@dataclass(frozen=True)
class Workload:
    """One evaluated workload.

    ``key`` names it in results.json (the spec itself, or a suite scenario's name);
    ``perturb`` > 0 runs every seed on a world drawn around the fit from the stream
    ``SeedSequence([salt, seed])`` (see :mod:`agents.suite`).
    """

    spec: str
    family: str
    x: float | None
    duration_s: float
    label: str = ""
    key: str = ""
    shifting: bool = False
    overload: bool = False
    perturb: float = 0.0
    salt: int = 0
    deployment: str = ""

    @property
    def name(self) -> str:
        return self.key or self.spec


# Privileged policies: in every report as labelled references, never as competitors.
REFERENCES: tuple[str, ...] = ("oracle", "goodput-exact")
# The realistic competitors controller eval adds to the builtins: goodput with the fitted model.
EVAL_ONLY: tuple[str, ...] = ("goodput-fit",)


@dataclass
class _Job:
    sim_json: str  # the fit: what a policy with a model is given
    workload: Workload
    policy: str  # display name
    spec: str  # how to build it (see _build_policy)
    depths: tuple[int, ...]
    seed: int
    keep_trace: bool = False
    objective: str = "throughput"
    result: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- simulator glue


def load_sim(sim: Path | None, deployment: str | None):
    """The SimParams of a sim.json or a bundled deployment."""
    from env.params import SimParams

    if sim is not None:
        return SimParams.from_json(sim)
    if deployment is None:
        raise ConfigError("give --sim or --deployment")
    from env.deployments import load_deployment

    return load_deployment(deployment)


def _as_run(params: Any, cfg: EvalConfig) -> Any:
    """``params`` as ``cfg`` runs them (``--warm-resume``)."""
    from env.params import warm_resumed

    return warm_resumed(params) if cfg.warm_resume else params


def model_goodput(name: str, depths: tuple[int, ...], latency: Any) -> Policy:
    """Goodput whose step cost per depth is a latency model's ``step_time_us`` (``latency``: a
    :class:`~env.latency.LatencyParams`): ``goodput-fit`` with a fit's model, ``goodput-exact``
    with the world's; ``bench/h200/serve_goodput_fit.py`` serves the former live."""
    from controller.baselines import GoodputPolicy
    from env.latency import step_time_us

    return GoodputPolicy(name, depths, latency_fn=lambda d, bs, ctx: step_time_us(latency, bs, d, ctx))


def _build_policy(spec: str, depths: tuple[int, ...], params: Any, world: Any = None) -> Policy:
    """A policy from an eval spec, for a run on ``world`` (default: ``params``) whose fit is
    ``params``: ``oracle`` (reads the engine), ``goodput-exact`` (the world's own latency model:
    privileged), ``goodput-fit`` (the fit's latency model: what a deployment can have), any
    ``builtin:NAME``/bare builtin name (``goodput`` is the served one: measured latencies, no
    model), or a PPO zip path."""
    world = params if world is None else world
    if spec == "oracle":
        from agents.oracle import OraclePolicy

        return OraclePolicy(depths)
    if spec in ("goodput-exact", "goodput-fit"):
        return model_goodput(spec, depths, (world if spec == "goodput-exact" else params).latency)
    if spec.endswith(".zip"):
        return make_factory(spec, depths)(depths)
    name = spec[len("builtin:") :] if spec.startswith("builtin:") else spec
    return make_factory(f"builtin:{name}", depths)(depths)


_PARAMS_CACHE: dict[str, Any] = {}


def _params_from_json(text: str) -> Any:
    params = _PARAMS_CACHE.get(text)
    if params is None:
        from env.params import SimParams

        params = SimParams.from_dict(json.loads(text))
        _PARAMS_CACHE.clear()
        _PARAMS_CACHE[text] = params
    return params


def world_params(params: Any, w: Workload, seed: int) -> Any:
    """The deployment a run of ``w`` with ``seed`` simulates: the fit itself, or (``perturb`` >
    0) a draw around it from the scenario's own stream."""
    if w.perturb <= 0:
        return params
    rng = np.random.default_rng(np.random.SeedSequence([w.salt, seed]))
    return params.perturb(rng, w.perturb)


def run_job(job: _Job) -> _Job:
    """Run one (workload, policy, seed) in the simulator; fills ``job.result``."""
    from env.runner import simulate

    params = _params_from_json(job.sim_json)
    world = world_params(params, job.workload, job.seed)
    policy = _build_policy(job.spec, job.depths, params, world)
    res = simulate(
        world,
        job.workload.spec,
        policy,
        depths=job.depths,
        seed=job.seed,
        duration_s=job.workload.duration_s,
    )
    out: dict[str, Any] = {
        "throughput_tok_s": float(res.throughput_tok_s),
        "tpot_ms_mean": float(res.tpot_ms_mean),
        "tpot_ms_p99": float(res.tpot_ms_p99),
    }
    out["per_request_tok_s"] = 1000.0 / out["tpot_ms_mean"] if out["tpot_ms_mean"] > 0 else 0.0
    if job.objective != "throughput":
        out[SLO_METRIC] = slo_goodput_tok_s(res.completed, res.duration_s, parse_objective(job.objective))
    depths_run, bs, t_s = _trace_arrays(res)
    out["mean_depth"] = float(np.mean(depths_run)) if len(depths_run) else 0.0
    if job.keep_trace and len(depths_run):
        stride = max(1, len(depths_run) // 1500)
        out["trace"] = {
            "t_s": [round(float(x), 4) for x in t_s[::stride]],
            "bs": [int(x) for x in bs[::stride]],
            "depth": [int(x) for x in depths_run[::stride]],
        }
    job.result = out
    return job


SLO_METRIC = "slo_goodput_tok_s"


def slo_goodput_tok_s(completed: Any, duration_s: float, objective: Any) -> float:
    """Goodput under the objective's TPOT target: output tokens of the completed requests whose
    TPOT is at most the target (a one-token request always is), per simulated second.

    Requests still running when the run stops count nothing, for every policy alike."""
    if duration_s <= 0:
        return 0.0
    return float(sum(r.output_tokens for r in completed if objective.meets(r.tpot_ms))) / duration_s


def resolve_objective(cfg: EvalConfig, zip_paths: list[str]) -> str:
    """The objective the eval scores by: ``--objective``, else the first existing PPO zip's
    (``specdepth.json``), else throughput. A zip trained for another objective than the one
    scored by gets a warning (scoring a policy by an objective it was not trained for is an
    experiment, not a mistake)."""
    import warnings

    from controller.errors import ControllerWarning
    from controller.ppo_policy import read_ppo_zip

    trained = [(p, read_ppo_zip(p)[0].objective) for p in dict.fromkeys(zip_paths) if Path(p).exists()]
    if cfg.objective is not None:
        chosen = str(parse_objective(cfg.objective))
    else:
        chosen = trained[0][1] if trained else "throughput"
    for path, obj in trained:
        if str(parse_objective(obj)) != chosen:
            warnings.warn(f"{path} was trained for objective {obj}, scored by {chosen}", ControllerWarning, stacklevel=2)
    return chosen


def _trace_arrays(res: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(depth, bs, time in s) per step from a RunResult."""
    return np.asarray(res.trace_depth), np.asarray(res.trace_bs), np.asarray(res.trace_time_s)


# --------------------------------------------------------------------------- the suite


def capacity_req_s(params: Any, depths: tuple[int, ...], opts: str = "") -> float:
    """Requests per second the deployment completes at depth 0 with every slot busy, in steady
    state: closed loop at ``max_running_requests`` (with the workload options ``opts``), 3C
    requests, the rate between the C-th and the 2C-th completion. The first C completions hold
    the fill (every slot's prompt prefilled at once), which a fixed 20 s probe measured instead:
    with 8k-32k prompts whose attention is priced the fill outlasts it, and the long-context
    deployment's capacity read 0.01 requests/s, where its steady state is 0.68."""
    from env.runner import simulate

    c = int(params.engine.max_running_requests)
    spec = f"closed:{c}@" + (f"{opts}," if opts else "") + f"n={3 * c}"
    res = simulate(params, spec, _build_policy("static:0", depths, params), depths=depths, seed=0, n_requests=3 * c)
    done = sorted(r.finish_us for r in res.completed)
    if len(done) < 3:
        raise ConfigError(f"capacity probe {spec!r}: only {len(done)} requests completed")
    lo, hi = len(done) // 3, 2 * len(done) // 3
    return (hi - lo) / max((done[hi] - done[lo]) / 1e6, 1e-9)


def build_suite(cfg: EvalConfig, capacity_req_s: float) -> list[Workload]:
    """The default workloads for a deployment whose capacity is ``capacity_req_s``."""
    s = cfg.scale
    out = [Workload(f"closed:{c}", "closed", float(c), cfg.closed_s * s, f"C={c}") for c in cfg.concurrency]
    for load in POISSON_LOADS:
        rate = round(load * capacity_req_s, 3)
        out.append(Workload(f"poisson:{rate}", "poisson", load, cfg.open_s * s, f"{load:.0%} load"))
    d = cfg.nonstationary_s * s
    lo, hi = round(0.1 * capacity_req_s, 3), round(0.9 * capacity_req_s, 3)
    mid = round(0.5 * capacity_req_s, 3)
    out += [
        Workload(f"ramp:{lo},{hi},{d:g}", "nonstationary", None, d, "load ramp 10→90%"),
        Workload(
            f"burst:{lo},{round(1.2 * capacity_req_s, 3)},{d / 4:g},0.25", "nonstationary", None, d, "bursts"
        ),
        Workload(f"phase:{d / 3:g}:closed:16", "nonstationary", None, d, "chat↔code, C=16"),
        Workload(f"phase:{d / 3:g}:poisson:{mid}", "nonstationary", None, d, "chat↔code, 50% load"),
    ]
    return out


def _score_metric(w: Workload) -> str:
    base = w.spec.split("@")[0]
    closed_base = base.startswith("closed:") or (base.startswith("phase:") and ":closed:" in base)
    return "throughput_tok_s" if closed_base else "per_request_tok_s"


def _policy_list(cfg: EvalConfig, depths: tuple[int, ...]) -> list[tuple[str, str]]:
    """(display name, spec) of every policy to run."""
    out: list[tuple[str, str]] = []
    if cfg.baselines == "all":
        names = [f"static:{d}" for d in depths] + list(BASELINES) + list(EVAL_ONLY) + list(REFERENCES)
    elif cfg.baselines == "none":
        names = []
    else:
        names = [n.strip() for n in cfg.baselines.split(",") if n.strip()]
    out += [(n, n) for n in names]
    zip_names = iter(zip_policy_names([p for p in cfg.policies if p.endswith(".zip")]))
    for spec in cfg.policies:
        if spec.endswith(".zip"):
            out.append((next(zip_names), str(Path(spec).resolve())))
        else:
            out.append((spec.removeprefix("builtin:"), spec))
    return out


def zip_policy_names(zips: list[str]) -> list[str]:
    """The report's names for the policy zips, in order: the first is ``ppo``, the learned policy
    the targets are checked for; the rest ``ppo:STEM``, or ``ppo:FOLDER/STEM`` where two share
    a stem (``a/ppo.zip`` and ``b/ppo.zip``); a name still taken raises."""
    stems = [Path(z).stem for z in zips]
    names = ["ppo"]
    for z, stem in zip(zips[1:], stems[1:]):
        names.append(f"ppo:{stem}" if stems.count(stem) == 1 else f"ppo:{Path(z).parent.name}/{stem}")
    if len(set(names)) < len(names):
        raise ConfigError(f"--policy zips need distinct names, got {', '.join(zips)}")
    return names[: len(zips)]


def evaluate(cfg: EvalConfig) -> Path:
    """Run the workloads and write report.md, results.json and plots; returns the report path."""
    if cfg.suite is not None:
        return evaluate_suite(cfg)
    params = _as_run(load_sim(cfg.sim, cfg.deployment), cfg)
    depths = cfg.depths
    zips = [p for p in cfg.policies if p.endswith(".zip")]
    if depths is None:
        if zips:
            from controller.ppo_policy import read_ppo_zip

            depths = read_ppo_zip(zips[0])[0].depths
        else:
            depths = DEFAULT_DEPTHS
    policies = _policy_list(cfg, depths)
    for _, spec in policies:  # fail before hours of simulation, not after
        _build_policy(spec, depths, params)
    objective = resolve_objective(cfg, zips)
    cfg.out.mkdir(parents=True, exist_ok=True)
    sim_json = json.dumps(params.to_dict())
    t0 = time.perf_counter()

    capacity = capacity_req_s(params, depths)  # sizes the open-loop loads
    suite = [
        Workload(w.spec, w.family, w.x, w.duration_s, w.label, shifting=w.family == "nonstationary",
                 perturb=cfg.perturb, salt=zlib.crc32(w.spec.encode()))
        for w in build_suite(cfg, capacity)
    ]  # fmt: skip
    trace_wl = next((w.spec for w in suite if w.spec.startswith("ramp:")), None)
    jobs = [
        _Job(
            sim_json,
            w,
            name,
            spec,
            depths,
            seed,
            keep_trace=(seed == 0 and w.spec == trace_wl and name in cfg.trace_policies),
            objective=objective,
        )
        for w in suite
        for name, spec in policies
        for seed in range(cfg.seeds)
    ]
    done = _run_all(jobs, cfg.jobs)
    results = _collect(cfg, params, depths, suite, policies, done, objective)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    results["capacity_req_s"] = capacity
    from agents.report import write_eval_outputs

    return write_eval_outputs(results, cfg.out)


def _run_all(jobs: list[_Job], n_workers: int) -> list[_Job]:
    from tqdm import tqdm

    if n_workers <= 1:
        return [run_job(j) for j in tqdm(jobs, desc="eval", unit="run", mininterval=2.0)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with ProcessPoolExecutor(n_workers) as pool:
        return list(
            tqdm(
                pool.map(run_job, jobs, chunksize=4),
                total=len(jobs),
                desc="eval",
                unit="run",
                mininterval=2.0,
            )
        )


def _collect(
    cfg: EvalConfig,
    params: Any,
    depths: tuple[int, ...],
    suite: list[Workload],
    policies: list[tuple[str, str]],
    done: list[_Job],
    objective: str = "throughput",
) -> dict[str, Any]:
    workloads, traces = collect_workloads(suite, {w.name: policies for w in suite}, done, objective)
    cfg_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {
        "schema": 1,
        "config": cfg_dict,
        "sim": params.name,
        "objective": objective,
        "depths": list(depths),
        "seeds": list(range(cfg.seeds)),
        "workloads": workloads,
        "traces": traces,
    }


def headroom(policies: dict[str, Any]) -> float | None:
    """The oracle's mean score over the best static depth's (None without both)."""
    statics = [v["score"]["mean"] for p, v in policies.items() if p.startswith("static:")]
    if "oracle" not in policies or not statics or max(statics) <= 0:
        return None
    return float(policies["oracle"]["score"]["mean"] / max(statics))


def collect_workloads(
    suite: list[Workload],
    policies: dict[str, list[tuple[str, str]]],
    done: list[_Job],
    objective: str = "throughput",
    objectives: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """results.json's ``workloads`` (and plotted traces) from finished jobs; ``policies`` lists
    each workload's (display name, spec). Under an SLO objective every workload's score is
    goodput under the TPOT target (:func:`slo_goodput_tok_s`). ``objectives`` gives some
    workloads (by name) their own objective instead (a suite scenario's); they record it as
    ``objective``."""
    objectives = objectives or {}
    by: dict[tuple[str, str], list[_Job]] = {}
    for j in done:
        by.setdefault((j.workload.name, j.policy), []).append(j)
    workloads: dict[str, Any] = {}
    traces: dict[str, Any] = {}
    for w in suite:
        w_obj = objectives.get(w.name, objective)
        metric = _score_metric(w) if w_obj == "throughput" else SLO_METRIC
        entry: dict[str, Any] = {
            "family": w.family,
            "x": w.x,
            "label": w.label,
            "spec": w.spec,
            "score_metric": metric,
            "shifting": w.shifting,
            "overload": w.overload,
            "perturb": w.perturb,
            "policies": {},
        }
        if w.deployment:
            entry["deployment"] = w.deployment
        if w.name in objectives:
            entry["objective"] = w_obj
        for name, _ in policies[w.name]:
            runs = sorted(by[(w.name, name)], key=lambda j: j.seed)
            stats: dict[str, Any] = {}
            keys = ["throughput_tok_s", "tpot_ms_mean", "tpot_ms_p99", "per_request_tok_s", "mean_depth"]
            for key in keys + ([SLO_METRIC] if w_obj != "throughput" else []):
                vals = [r.result[key] for r in runs]
                m, lo, hi = ci95(vals)
                stats[key] = {"mean": m, "ci95": [lo, hi], "values": vals}
            stats["score"] = stats[metric]
            entry["policies"][name] = stats
            for r in runs:
                if "trace" in r.result:
                    traces.setdefault(w.name, {})[name] = r.result["trace"]
        entry["headroom"] = headroom(entry["policies"])
        workloads[w.name] = entry
    return workloads, traces


# --------------------------------------------------------------------------- named suites


def _resolve_zip(spec: str, deployment: str) -> str:
    return spec.replace("{deployment}", deployment)


def evaluate_suite(cfg: EvalConfig) -> Path:
    """``controller eval --suite NAME``: every scenario of the suite (:mod:`agents.suite`) on
    its held-out seeds and worlds; report.md, results.json and plots into ``cfg.out``.

    A PPO zip path may hold ``{deployment}`` (e.g. ``agents/bundled/{deployment}/ppo.zip``):
    each scenario then runs the zip of its own deployment, and a scenario whose zip does not
    exist lists the policy as missing. A scenario whose deployment does not exist is listed in
    ``missing`` and runs nothing.
    """
    from agents.suite import get_suite, suite_seeds
    from controller.errors import ControllerError
    from env.deployments import load_deployment

    scenarios = get_suite(cfg.suite or "")
    if cfg.only:
        scenarios = tuple(sc for sc in scenarios if any(x in sc.name for x in cfg.only))
        if not scenarios:
            raise ConfigError(f"--only {','.join(cfg.only)}: no scenario of {cfg.suite} matches")
    seeds = suite_seeds(cfg.seeds)
    zips = [p for p in cfg.policies if p.endswith(".zip")]
    depths = cfg.depths
    t0 = time.perf_counter()
    runnable: list[tuple[Any, Any]] = []
    missing: list[dict[str, str]] = []
    for sc in scenarios:
        try:
            runnable.append((sc, _as_run(load_deployment(sc.deployment), cfg)))
        except ControllerError as exc:
            missing.append({"scenario": sc.name, "deployment": sc.deployment, "reason": str(exc)})
    if depths is None:
        depths = DEFAULT_DEPTHS
        for z in zips:
            path = _resolve_zip(z, runnable[0][0].deployment) if runnable else z
            if Path(path).exists():
                from controller.ppo_policy import read_ppo_zip

                depths = read_ppo_zip(path)[0].depths
                break
    base = _policy_list(replace(cfg, policies=()), depths)
    objective = resolve_objective(
        cfg, [_resolve_zip(z, sc.deployment) for z in zips for sc, _ in runnable]
    )
    cfg.out.mkdir(parents=True, exist_ok=True)
    workloads: list[Workload] = []
    per_workload: dict[str, list[tuple[str, str]]] = {}
    missing_policies: dict[str, list[str]] = {}
    jobs: list[_Job] = []
    own_objective: dict[str, str] = {}  # scenarios scored by their own objective
    capacities: dict[str, float] = {}
    cap_cache: dict[tuple[str, str], float] = {}
    for sc, params in runnable:
        sim_json = json.dumps(params.to_dict())
        opts = sc.options()
        key = (sc.deployment, opts)
        if key not in cap_cache:
            cap_cache[key] = capacity_req_s(params, depths, opts)
        capacities[sc.name] = cap_cache[key]
        spec = sc.resolve(cap_cache[key])
        w = Workload(
            spec, sc.loop, None, sc.duration_s * cfg.scale, sc.label, key=sc.name, shifting=sc.shifting,
            overload=sc.overload, perturb=sc.perturb, salt=sc.salt, deployment=sc.deployment,
        )  # fmt: skip
        for _, pspec in base:
            _build_policy(pspec, depths, params)  # fail before hours of simulation, not after
        pols = list(base)
        zip_names = iter(zip_policy_names([z for z in cfg.policies if z.endswith(".zip")]))
        for z in cfg.policies:
            if not z.endswith(".zip"):
                pols.append((z.removeprefix("builtin:"), z))
                continue
            name = next(zip_names)
            path = _resolve_zip(z, sc.deployment)
            if Path(path).exists():
                pols.append((name, str(Path(path).resolve())))
            else:
                missing_policies.setdefault(sc.name, []).append(f"{name} ({path}: no such file)")
        workloads.append(w)
        per_workload[sc.name] = pols
        keep = sc.name == "llama8b/longmix-wave"
        sc_objective = objective
        if sc.objective is not None:
            sc_objective = own_objective[sc.name] = str(parse_objective(sc.objective))
        jobs += [
            _Job(sim_json, w, name, pspec, depths, seed,
                 keep_trace=keep and seed == seeds[0] and name in cfg.trace_policies, objective=sc_objective)
            for name, pspec in pols
            for seed in seeds
        ]  # fmt: skip
    done = _run_all(jobs, cfg.jobs)
    results_w, traces = collect_workloads(workloads, per_workload, done, objective, own_objective)
    for name, absent in missing_policies.items():
        results_w[name]["missing_policies"] = absent
    cfg_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    results = {
        "schema": 1,
        "suite": cfg.suite,
        "config": cfg_dict,
        "sim": f"suite {cfg.suite}",
        "objective": objective,
        "depths": list(depths),
        "seeds": seeds,
        "workloads": results_w,
        "missing": missing,
        "references": list(REFERENCES),
        "traces": traces,
        "capacity_req_s": capacities,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    from agents.report import write_suite_outputs

    return write_suite_outputs(results, cfg.out)


__all__ = [
    "REFERENCES",
    "EvalConfig",
    "Workload",
    "build_suite",
    "ci95",
    "evaluate",
    "evaluate_suite",
    "headroom",
    "load_sim",
    "model_goodput",
    "resolve_objective",
    "run_job",
    "slo_goodput_tok_s",
    "world_params",
]
