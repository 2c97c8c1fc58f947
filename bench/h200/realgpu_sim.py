"""The simulator fitted to a realgpu call's traces, against the throughput the call measured.

Run: ``python bench/h200/realgpu_sim.py --sim FIT/sim.json CALL.csv [CALL.csv ...]``
(``FIT``: what ``controller train --traces`` wrote; the CSVs: ``realgpu.py``'s
``summary.csv``, one per call).

For every closed point (policy, C) of the CSVs except ``plain``, the same benchmark in the
simulator: closed loop at C, 256-token prompts, 128 output tokens, max(4, 2C) requests (what
``realgpu.py`` sends), the policy deciding one step late, throughput = output tokens / wall
time of the whole run, mean over ``--seeds``. The benchmark sends every point's prompts once
before timing it, so SGLang's radix cache holds them: ``--prefix-hit`` (default 0.99, what the
H200 traces showed, ``bench/sim_vs_real.py``) replaces the fit's. The HTTP and tokenizer path
before the scheduler is not modelled (``bench/sim_vs_real.py`` calibrates it from TTFTs; here it
is left at the fit's). Prints one row per point and the mean and worst absolute error.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEPTHS = (0, 1, 2, 3, 5)  # realgpu.DEPTHS: the hook server's depths
ZIPS = {"ppo": ROOT / "agents" / "bundled" / "h200-llama8b" / "ppo.zip"}  # policyswap.NAMED_ZIPS["ppo"]


def measured(paths: list[Path]) -> dict[tuple[str, int], list[float]]:
    """(policy, C) → tok/s of each repetition, closed points only."""
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for path in paths:
        with path.open() as f:
            for row in csv.DictReader(f):
                if row["workload"].startswith("closed") and row["policy"] != "plain":
                    out[(row["policy"], int(row["concurrency"]))].append(float(row["tok_s"]))
    return dict(out)


def main() -> None:
    from controller.registry import make_factory
    from env.params import SimParams
    from env.runner import simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", type=Path, required=True, help="the fitted sim.json")
    ap.add_argument("csv", type=Path, nargs="+", help="realgpu summary.csv files")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--prefix-hit", type=float, default=0.99)
    args = ap.parse_args()
    params = SimParams.from_dict(json.loads(args.sim.read_text()))
    params = replace(params, engine=replace(params.engine, prefix_cache_hit=args.prefix_hit))
    points = measured(args.csv)
    print("| policy | C | measured tok/s, mean (min-max) | simulated | error |")
    print("|---|---|---|---|---|")
    errors = []
    for (policy, c), reps in sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        spec = str(ZIPS[policy]) if policy in ZIPS else f"builtin:{policy}"
        try:
            factory = make_factory(spec, DEPTHS)
        except Exception as exc:  # a policy the simulator cannot run (SGLang's own rule): say so
            print(f"| {policy} | {c} | {np.mean(reps):.0f} | - | not simulated ({type(exc).__name__}) |")
            continue
        sims = [
            simulate(
                params,
                f"closed:{c}@prompt=256,output=128,n={max(4, 2 * c)}",
                factory(DEPTHS),
                depths=DEPTHS,
                seed=seed,
                action_delay=1,
            ).throughput_tok_s
            for seed in range(args.seeds)
        ]
        real, sim = float(np.mean(reps)), float(np.mean(sims))
        errors.append(sim / real - 1.0)
        print(
            f"| {policy} | {c} | {real:.0f} ({min(reps):.0f}-{max(reps):.0f}) | {sim:.0f} | {100 * (sim / real - 1):+.1f}% |"
        )
    err = np.abs(np.array(errors))
    worst = int(np.argmax(err))
    print(
        f"\n{len(err)} points: mean absolute error {100 * err.mean():.1f}%, worst {100 * errors[worst]:+.1f}%"
    )


if __name__ == "__main__":
    main()
