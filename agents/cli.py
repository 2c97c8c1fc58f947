"""``controller train`` and ``controller eval``: the offline half of the project.

Heavy imports (torch, SB3, gymnasium, matplotlib) happen inside the handlers so that
``controller --help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agents.suite import SUITES
from controller.errors import ConfigError
from controller.objective import OBJECTIVE_HELP


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``train`` and ``eval`` to the ``controller`` command."""
    t = subparsers.add_parser(
        "train",
        help="fit the simulator to traces and train a PPO depth policy in it",
        description=(
            "Fit the simulator (traces + latency profiles, or a bundled deployment), train SB3 PPO "
            "in it with domain randomization over the fit's uncertainty, workloads and the "
            "overlap-scheduling action delay, and write ppo.zip (servable by `controller serve "
            "--policy`), the sim.json it used, TensorBoard logs and a training report."
        ),
    )
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", type=Path, help="folder of recorded runs/*.msgpack traces to fit")
    src.add_argument("--deployment", help="a bundled deployment instead of traces (h200-llama8b, seed)")
    src.add_argument("--sim", type=Path, help="an already fitted sim.json")
    t.add_argument(
        "--profile", type=Path, action="append", default=[], help="latency profile CSV (repeatable)"
    )
    t.add_argument("--out", type=Path, required=True, help="where ppo.zip goes; its folder gets the rest")
    t.add_argument("--timesteps", type=int, default=None, help="PPO environment steps (default: the budget)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--n-envs", type=int, default=None, help="parallel simulator copies (in-process)")
    t.add_argument("--depths", default=None, help="allowed depths, e.g. 0,1,2,3,5")
    t.add_argument("--warm-start-rounds", type=int, default=None, help="DAgger rounds before PPO (0 = none)")
    t.add_argument(
        "--reward",
        choices=("objective", "regret", "extra-tokens"),
        default=None,
        help="training reward (default objective: tokens per request-second over time, γ > 0)",
    )
    t.add_argument("--objective", default=None, metavar="OBJECTIVE", help=OBJECTIVE_HELP + "; stored in the zip")
    t.add_argument(
        "--slo-credit",
        choices=("step", "running"),
        default=None,
        help="how the objective reward credits an slo:TPOT_MS objective: 'step' (default: a step "
        "counts for a request if its own time per token is on target) or 'running' (each "
        "request's running TPOT: tokens count while it is on target, all of them are taken back "
        "by the step that pushes it over)",
    )
    t.add_argument("--gamma", type=float, default=None, help="PPO discount (default 0.98)")
    t.add_argument(
        "--learning-rate", type=float, default=None, help="PPO learning rate, decayed linearly to 0 (default 2e-5)"
    )
    t.add_argument(
        "--select-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="score the policy on validation episodes of the training distribution before PPO, every STEPS "
        "PPO steps and at the end, and save the best scored weights (default 28672; 0 = save the final "
        "weights unscored); train_report.md lists the scores",
    )
    t.add_argument(
        "--delay",
        default=None,
        metavar="LO,HI",
        help="steps between a record and the step its decision runs at, drawn per episode from LO..HI "
        "(default 1,2; bench/h200/decision_delay.py measures a server's: 3 on the H100 testbed)",
    )
    t.add_argument(
        "--drafter-mix",
        type=float,
        default=None,
        help="fraction of episodes with a drafter of random quality, from useless to near perfect "
        "(default 0.3; 0 = only the fitted acceptance)",
    )
    t.add_argument(
        "--probe-staleness",
        type=float,
        default=None,
        help="the warm start's expert drafts once to look at the drafter after spec_staleness reaches "
        "this at depth 0 (1 − exp(−steps/50): default 0.5, about 35 steps, postponed by --probe-cost-steps; "
        "0 = never probes)",
    )
    t.add_argument(
        "--probe-cost-steps",
        type=float,
        default=None,
        help="postpone that probe by this many steps × the share of depth 0's goodput a probe step "
        "gives up on the fitted model (default 400; 0: a fixed staleness; docs/results.md has a comparison)",
    )
    t.add_argument(
        "--probe-gate",
        type=float,
        default=None,
        help="probe only where some depth would beat depth 0 on the fitted model for a drafter "
        "accepting this fraction per position (default 0.8; 0 = probe everywhere)",
    )
    t.add_argument(
        "--off-draft",
        choices=("kv", "keep", "skip"),
        default=None,
        help="with --traces: what the traced server's drafter did at depth 0 (its --spec-off-draft; "
        "kv is the hook's default), so the fit reads its depth-0 steps right (default: the base deployment's, kv; the committed example traces ran keep)",
    )
    t.add_argument(
        "--featurizer-version",
        type=int,
        default=None,
        help="the observation's definition (default: the current one, FEATURIZER_VERSION in "
        "controller/features.py): 7 does not read the first drafted step after depth 0 as acceptance "
        "evidence (an off switch resumed cold loses those drafts; bench/resume_evidence.py compares)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)

    e = subparsers.add_parser(
        "eval",
        help="evaluate a PPO policy against every baseline in the simulator",
        description=(
            "Run every policy on identical seeds and workloads (closed-loop concurrency sweep, "
            "open-loop Poisson loads, non-stationary workloads) and write report.md, "
            "results.json and PNG plots."
        ),
    )
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--sim", type=Path, help="a fitted sim.json")
    src.add_argument("--deployment", help="a bundled deployment (h200-llama8b, seed)")
    src.add_argument(
        "--suite",
        help=f"a named, held-out scenario suite across deployments (agents/suite.py: {', '.join(SUITES)}); "
        "a zip path may hold {deployment}",
    )
    e.add_argument("--policy", action="append", default=[], help="PPO zip or builtin:NAME (repeatable)")
    e.add_argument("--baselines", default="all", help="'all', 'none' or a comma list of builtin names")
    e.add_argument("--out", type=Path, required=True, help="output folder")
    e.add_argument("--seeds", type=int, default=None, help="seeds per (workload, policy); ≥ 5 for the report")
    e.add_argument("--scale", type=float, default=None, help="multiply every run's length (default 1)")
    e.add_argument("--concurrency", default=None, help="closed-loop C values, e.g. 1,2,4,...,250")
    e.add_argument("--jobs", type=int, default=1, help="worker processes")
    e.add_argument("--depths", default=None, help="allowed depths, e.g. 0,1,2,3,5")
    e.add_argument(
        "--perturb",
        type=float,
        default=None,
        help="run each seed on a world drawn around the fit at this × its standard errors "
        "(default 0; suites set their own)",
    )
    e.add_argument(
        "--objective",
        default=None,
        metavar="OBJECTIVE",
        help="score every policy by this objective: 'throughput' or 'slo:TPOT_MS' (goodput: tokens/s of "
        "the completed requests whose TPOT is at most TPOT_MS ms). Default: the first PPO zip's "
        "objective (controller train --objective), else throughput",
    )
    e.add_argument(
        "--only", default=None, help="with --suite: run the scenarios whose name contains one of these"
    )
    e.add_argument(
        "--warm-resume",
        action="store_true",
        help="simulate the hook's warm resume (its off switch's default): one more depth-0 step before "
        "drafting resumes after depth 0, and a fit's resume loss taken out (the bundled deployments "
        "leave it off)",
    )
    e.set_defaults(func=_eval)


def _depths(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        depths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--depths must be a comma list of integers, got {text!r}") from None
    if not depths or list(depths) != sorted(set(depths)) or depths[0] < 0:
        raise ConfigError(f"--depths must be strictly increasing non-negative integers, got {text!r}")
    return depths


def _train(args: argparse.Namespace) -> int:
    from agents.train import TrainConfig, train

    cfg = TrainConfig.from_args(args, depths=_depths(args.depths))
    result = train(cfg)
    print(
        f"wrote {result.zip_path} ({result.timesteps} steps in {result.wall_s:.0f} s); report {result.report_path}"
    )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from agents.evaluate import EvalConfig, evaluate

    cfg = EvalConfig.from_args(args, depths=_depths(args.depths))
    report = evaluate(cfg)
    print(f"wrote {report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m agents.cli train|eval ...``: the same as ``controller train|eval`` without the
    service's dependencies (pyzmq), for machines that only train and evaluate."""
    import sys

    from controller.errors import ControllerError

    parser = argparse.ArgumentParser(prog="controller")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ControllerError as exc:
        print(f"controller {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
