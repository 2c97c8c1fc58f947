"""Speed of the simulator: mean ``env.step`` at batch 64 on one core, and its parts.

Run: ``python bench/bench_env.py [--steps N] [--repeat R]``; ``SPECDEPTH_NO_JIT=1`` in front
measures the plain-Python path (numba not used, see ``controller/_jit.py``). Times are CPU
time of this process (``time.process_time``), so other jobs on a shared machine do not
inflate them much; each part is measured ``R`` times, interleaved, and the table shows the
median and the fastest repeat in µs per step. Parts: the whole gym step, the engine step
alone, and the Featurizer alone (on the engine's records). Target: median env.step <= 20 µs
at batch 64. The closed loop at C = 64 keeps the batch full; with the deployment's output
lengths about 0.4 requests complete (and one is admitted) per step, part of the cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# One core: keep numpy's BLAS from spreading (none of the hot path uses BLAS, but be explicit).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from controller._jit import JIT_ENABLED  # noqa: E402
from controller.features import Featurizer  # noqa: E402
from controller.protocol import DEFAULT_DEPTHS  # noqa: E402
from env.deployments import load_deployment  # noqa: E402
from env.engine import Engine  # noqa: E402
from env.gym_env import SpecDecodeEnv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--deployment", default="h200-llama8b")
    args = ap.parse_args()
    params = load_deployment(args.deployment)
    wl = f"closed:{args.batch}"
    depths = DEFAULT_DEPTHS
    rng = np.random.default_rng(0)
    actions = [int(a) for a in rng.integers(0, len(depths), size=args.steps)]

    env = SpecDecodeEnv(deployment=params, workload=wl, depths=depths, episode_steps=10**9)
    env.reset(seed=0)
    eng = Engine(params, wl)
    eng.reset(0)
    for a in actions[:500]:  # warm up (and compile on a first run): fill the batch
        env.step(a)
        eng.step(depths[a])
    times: dict[str, list[float]] = {"env.step": [], "engine.step": [], "featurizer": []}
    bs_seen: list[int] = []
    for _ in range(args.repeat):
        t0 = time.process_time()
        for a in actions:
            _, _, _, _, info = env.step(a)
            bs_seen.append(info["step"].bs)
        times["env.step"].append((time.process_time() - t0) / args.steps)

        t0 = time.process_time()
        recs = [eng.step(depths[a]) for a in actions]
        times["engine.step"].append((time.process_time() - t0) / args.steps)

        feat = Featurizer(depths)
        t0 = time.process_time()
        for r in recs:
            feat.update(r)
        times["featurizer"].append((time.process_time() - t0) / args.steps)

    print(
        f"batch {args.batch} (mean bs seen {np.mean(bs_seen):.1f}), {args.steps} steps x {args.repeat}, "
        f"deployment {args.deployment}, JIT {'on (numba)' if JIT_ENABLED else 'off (plain Python)'}"
    )
    print(f"{'part':<14}{'median us':>10}{'min us':>9}{'steps/s':>12}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<14}{med * 1e6:>10.2f}{min(ts) * 1e6:>9.2f}{1.0 / med:>12,.0f}")
    env_us = statistics.median(times["env.step"]) * 1e6
    print(f"target median env.step <= 20 us: {'PASS' if env_us <= 20.0 else 'FAIL'}")


if __name__ == "__main__":
    main()
