"""Why a greedy per-step rule loses to depth 0 on a scenario: what its steps gain against the
states its choices lead to.

Run: ``python bench/greedy_consequence.py [--scenario longctx/long-prompts-c32] [--seeds 15]
[--policy PPO_ZIP]`` (default: the scenario of ``decisions-v3`` where every depth-choosing
policy reads below ``static:0``, with the bundled zip of its deployment).

Each policy runs on the suite's held-out seeds and worlds (as ``controller eval --suite``
does). Per policy the table prints, means over the seeds:

- its throughput over ``static:0``'s on the same seed and world;
- the mean context per running request over its decode steps (which requests its batches hold);
- depth 0's true expected rate (tokens/s, the engine's ``expected_rate(0)``) of the states it
  visited: what the batches it led to were worth without drafting;
- the ratio of the true expected rate of the depth it chose to depth 0's, per decision: what
  each step gained as a one-step choice (the clairvoyant ``oracle`` maximises exactly this).

A policy whose steps gain (ratio > 1) and whose score still falls below ``static:0`` loses
through the states its choices lead to, which no per-step rule sees.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from controller.features import featurizer_version_of
from controller.policy import EngineBound


class _Watch:
    """Wraps a policy and, before each decision, reads what the engine says the step is worth:
    depth 0's true expected rate and the chosen depth's over it. ``simulate`` binds the engine
    (an :class:`~controller.policy.EngineBound` policy), so the run is the suite's own loop."""

    def __init__(self, policy: Any, depths: tuple[int, ...]) -> None:
        self.policy, self.depths, self.name = policy, depths, policy.name
        self.featurizer_version = featurizer_version_of(policy)
        self.engine: Any = None
        self.ctx: list[float] = []
        self.rate0: list[float] = []
        self.gain: list[float] = []

    def bind_engine(self, engine: Any) -> None:
        self.engine = engine
        if isinstance(self.policy, EngineBound):
            self.policy.bind_engine(engine)

    def reset(self) -> None:
        self.policy.reset()

    def act(self, obs: Any, step: Any) -> int:
        a = int(self.policy.act(obs, step))
        r0 = self.engine.expected_rate(0)
        if r0 > 0:
            self.ctx.append(step.ctx_tokens / step.bs)
            self.rate0.append(r0)
            self.gain.append(self.engine.expected_rate(self.depths[a]) / r0)
        return a


def scenario_of(name: str) -> Any:
    """The ``decisions-v3`` scenario called ``name``; exits naming it if there is none."""
    from agents.suite import get_suite

    sc = next((s for s in get_suite("decisions-v3") if s.name == name), None)
    if sc is None:
        raise SystemExit(f"no scenario {name!r} in decisions-v3")
    return sc


def run(scenario: str, seeds: int, policies: list[str]) -> list[tuple[str, np.ndarray]]:
    """One row per policy: (name, per-seed [throughput ratio, ctx/request, depth-0 rate, gain])."""
    from agents.evaluate import Workload, _build_policy, world_params
    from agents.suite import suite_seeds
    from controller.ppo_policy import read_ppo_zip
    from controller.protocol import DEFAULT_DEPTHS
    from env.deployments import load_deployment
    from env.runner import simulate

    sc = scenario_of(scenario)
    params = load_deployment(sc.deployment)
    w = Workload(sc.workload, sc.loop, None, sc.duration_s, key=sc.name, perturb=sc.perturb, salt=sc.salt)
    zips = [p for p in policies if p.endswith(".zip")]
    depths = read_ppo_zip(zips[0])[0].depths if zips else DEFAULT_DEPTHS
    rows: dict[str, list[list[float]]] = {p: [] for p in policies}
    for seed in suite_seeds(seeds):
        world = world_params(params, w, seed)
        for spec in policies:
            pol = _Watch(_build_policy(spec, depths, params, world), depths)
            res = simulate(world, sc.workload, pol, depths=depths, seed=seed, duration_s=sc.duration_s)
            rows[spec].append(
                [
                    res.throughput_tok_s,
                    float(np.mean(pol.ctx)),
                    float(np.mean(pol.rate0)),
                    float(np.mean(pol.gain)),
                ]
            )
        base = rows["static:0"][-1][0]
        for spec in policies:
            rows[spec][-1][0] /= base
    return [(p, np.array(v)) for p, v in rows.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="longctx/long-prompts-c32")
    ap.add_argument("--seeds", type=int, default=15)
    ap.add_argument(
        "--policy", default=None, help="a PPO zip (default: the bundled zip of the scenario's deployment)"
    )
    args = ap.parse_args(argv)
    from agents.evaluate import _resolve_zip

    if args.policy is None:  # as controller eval --suite resolves a {deployment} zip
        args.policy = _resolve_zip("agents/bundled/{deployment}/ppo.zip", scenario_of(args.scenario).deployment)
    policies = ["static:0", args.policy, "goodput-fit", "oracle"]
    print(f"{args.scenario}, {args.seeds} seeds (mean, min-max over seeds)\n")
    print(
        "| policy | ÷ static:0 | ctx per request | depth 0's rate of the states visited, tok/s | chosen ÷ depth 0, per step |"
    )
    print("|---|---|---|---|---|")
    for name, v in run(args.scenario, args.seeds, policies):
        r = v[:, 0]
        label = "ppo" if name.endswith(".zip") else name
        print(
            f"| {label} | {r.mean():.3f} ({r.min():.3f}-{r.max():.3f}) | {v[:, 1].mean():,.0f} | {v[:, 2].mean():,.0f} | {v[:, 3].mean():.4f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
