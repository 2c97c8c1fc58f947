"""Speed of the simulator: mean ``env.step`` at batch 64 on one core, and its parts.

Run: ``python bench/bench_env.py [--steps N]``. Times are CPU time of this process
(``time.process_time``), so other jobs on a shared machine do not inflate them. Prints a
table of µs per step and steps/s for
the whole gym step, the engine step alone, and the Featurizer alone (on the same records),
measured side by side in one run. Target: mean env.step <= 20 µs at batch 64.
"""

from __future__ import annotations

import argparse
import os
import time

# One core: keep numpy's BLAS from spreading (none of the hot path uses BLAS, but be explicit).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from controller.features import Featurizer  # noqa: E402
from env.deployments import load_deployment  # noqa: E402
from env.engine import Engine  # noqa: E402
from env.gym_env import SpecDecodeEnv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--deployment", default="h200-llama8b")
    args = ap.parse_args()
    params = load_deployment(args.deployment)
    # Long outputs keep the batch at C for the whole run (completions are rare, as at bs 64 live).
    wl = f"closed:{args.batch}"
    depths = (0, 1, 2, 3, 5)
    rng = np.random.default_rng(0)
    actions = rng.integers(0, len(depths), size=args.steps)

    env = SpecDecodeEnv(deployment=params, workload=wl, depths=depths, episode_steps=10**9)
    env.reset(seed=0)
    for a in actions[:500]:  # warm up: fill the batch
        env.step(int(a))
    bs_seen = []
    t0 = time.process_time()
    for a in actions:
        _, _, _, _, info = env.step(int(a))
        bs_seen.append(info["step"].bs)
    t_env = (time.process_time() - t0) / args.steps

    eng = Engine(params, wl)
    eng.reset(0)
    for a in actions[:500]:
        eng.step(depths[int(a)])
    recs = []
    t0 = time.process_time()
    for a in actions:
        recs.append(eng.step(depths[int(a)]))
    t_eng = (time.process_time() - t0) / args.steps

    feat = Featurizer(depths)
    t0 = time.process_time()
    for r in recs:
        feat.update(r)
    t_feat = (time.process_time() - t0) / args.steps

    print(
        f"batch {args.batch} (mean bs seen {np.mean(bs_seen):.1f}), {args.steps} steps, deployment {args.deployment}"
    )
    print(f"{'part':<14}{'us/step':>10}{'steps/s':>12}")
    for name, t in (("env.step", t_env), ("engine.step", t_eng), ("featurizer", t_feat)):
        print(f"{name:<14}{t * 1e6:>10.2f}{1.0 / t:>12,.0f}")
    print(f"target env.step <= 20 us: {'PASS' if t_env * 1e6 <= 20.0 else 'FAIL'}")


if __name__ == "__main__":
    main()
