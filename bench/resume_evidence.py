"""What the off switch's resume does to policies that learn acceptance from the step records.

Run: ``python bench/resume_evidence.py [--deployment h200-llama8b] [--seeds 5] [--conc 4,16,64]
[--policy LABEL=ZIP ...]`` (about 10 s on two cores, more with each zip).

With the hook's off switch (``--spec-off-draft kv``) resumed cold (``SPECDEPTH_OFF_RESUME=cold``,
the default before 2026-12-06) the first drafted step after a depth-0 step proposes from a
stale hidden state and accepts nothing: 0 of the first draft tokens of 628 such steps on the
H100 testbed, against 0.38 on the other drafted steps (``docs/simulator.md``). Fits of those
traces model the loss (``env.acceptance.with_resume_loss``). A policy that reads those zeros as
evidence sees every probe fail. Resumed warm (the default now) one more depth-0 step runs first
and nothing is lost. The table runs one deployment as bundled, with the loss, and warm, with
the decision applied one step after its record (the simulator's default) and three (what the
hook measured on the H100 testbed, ``bench/h200/decision_delay.py``), closed loop at each C:

- ``static:0`` and ``static:3`` (no evidence read);
- ``goodput`` on Featurizer version 5 (today's default) and version 7 (the first drafted
  record after a depth-0 one is not evidence: ``controller/features.py``);
- the deployment's bundled PPO zip (served with the version it was trained on), and any zip
  given with ``--policy`` (``controller train --featurizer-version 7`` trains one on version 7).

Throughput in tokens/s, mean over ``--seeds`` engine seeds, and each policy over the better of
the two static depths in the same world.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.protocol import DEFAULT_DEPTHS  # noqa: E402
from controller.registry import make_factory  # noqa: E402
from env.acceptance import with_resume_loss  # noqa: E402
from env.deployments import deployment_path, load_deployment  # noqa: E402
from env.runner import simulate  # noqa: E402


def policies(deployment: str, extra: list[str]) -> list[tuple[str, str, int | None]]:
    """(label, policy spec, Featurizer version or None for the policy's own); ``extra``:
    ``LABEL=ZIP`` entries to run as well."""
    zip_path = ROOT / "agents" / "bundled" / deployment / "ppo.zip"
    return [
        ("static:0", "builtin:static:0", None),
        ("static:3", "builtin:static:3", None),
        ("goodput v5", "builtin:goodput", 5),
        ("goodput v7", "builtin:goodput", 7),
        ("ppo (bundled)", str(zip_path), None),
    ] + [(e.partition("=")[0], e.partition("=")[2], None) for e in extra]


def worlds(base: Any) -> list[tuple[str, Any]]:
    """The deployment as bundled, with the cold off switch's resume loss, and with the hook's
    warm resume (no loss; one more depth-0 step before each resume: ``EngineParams.warm_resume``)."""
    return [
        ("as bundled", base),
        ("resume loses its drafts", replace(base, acceptance=with_resume_loss(base.acceptance))),
        ("warm resume", replace(base, engine=replace(base.engine, warm_resume=True))),
    ]


def run(params: Any, spec: str, version: int | None, c: int, delay: int, seeds: int) -> float:
    """Mean closed-loop throughput of one policy at C over ``seeds`` engine seeds."""
    depths = DEFAULT_DEPTHS
    factory = make_factory(spec, depths)
    out = []
    for seed in range(seeds):
        policy = factory(depths)
        if version is not None:  # a builtin declares none: set, it reads as a VersionedPolicy
            setattr(policy, "featurizer_version", version)  # noqa: B010
        workload = f"closed:{c}@n={max(16, 8 * c)}"
        out.append(
            simulate(params, workload, policy, depths=depths, seed=seed, action_delay=delay).throughput_tok_s
        )
    return float(np.mean(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="h200-llama8b", help="a bundled deployment")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--conc", default="4,16,64", help="closed-loop concurrencies, comma list")
    ap.add_argument("--delays", default="1,3", help="decision delays in steps, comma list")
    ap.add_argument(
        "--policy", action="append", default=[], metavar="LABEL=ZIP", help="a PPO zip to run as well"
    )
    args = ap.parse_args(argv)
    bad = [e for e in args.policy if "=" not in e or not Path(e.partition("=")[2]).is_file()]
    if bad:
        ap.error(f"--policy takes LABEL=ZIP with an existing zip: {', '.join(bad)}")
    if not deployment_path(args.deployment).is_file():
        ap.error(f"no bundled deployment {args.deployment!r}")
    try:
        concs = [int(x) for x in args.conc.split(",")]
        delays = [int(x) for x in args.delays.split(",")]
    except ValueError:
        ap.error("--conc and --delays take comma lists of integers")
    if args.seeds < 1 or min(concs) < 1 or min(delays) < 1:
        ap.error("--seeds, --conc and --delays must be at least 1")
    pols = policies(args.deployment, args.policy)
    print(f"{args.deployment}, {args.seeds} seeds; tok/s (÷ the better of static:0 and static:3)\n")
    print("| world | delay | C | " + " | ".join(label for label, _, _ in pols) + " |")
    print("|---|---|---|" + "---|" * len(pols))
    for world, params in worlds(load_deployment(args.deployment)):
        for delay in delays:
            for c in concs:
                tok = [run(params, spec, version, c, delay, args.seeds) for _, spec, version in pols]
                best = max(tok[0], tok[1])
                cells = [f"{v:,.0f} ({v / best:.3f})" for v in tok]
                print(f"| {world} | {delay} | {c} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
