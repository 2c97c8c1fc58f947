"""Rebuild the bundled demo policies and their eval reports: ``python -m agents.bundle``.

For each bundled deployment (:data:`DEPLOYMENTS`) it runs exactly what a user would:

    controller train --deployment NAME --out agents/bundled/NAME/ppo.zip --seed 0
    controller eval --deployment NAME --policy agents/bundled/NAME/ppo.zip --baselines all \\
        --out agents/bundled/NAME/eval

Trainings run side by side (one process each), then the evals (``--jobs`` workers in all).
Same seed, same platform → the same files (see ``tests/test_train_eval.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

BUNDLED = Path(__file__).resolve().parent / "bundled"
DEPLOYMENTS = ("h200-llama8b", "seed", "h200-llama8b-longctx", "h200-70b")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.bundle", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BUNDLED)
    ap.add_argument("--jobs", type=int, default=2, help="eval worker processes in all")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    ap.add_argument("--skip-train", action="store_true", help="evaluate the zips already there")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--timesteps", type=int, default=None)
    args = ap.parse_args(argv)
    deps = [d for d in args.deployments.split(",") if d]
    cli = [sys.executable, "-m", "agents.cli"]  # = `controller`, minus the service's imports
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    if not args.skip_train:
        procs = []
        for d in deps:
            folder = args.out / d
            folder.mkdir(parents=True, exist_ok=True)
            cmd = [
                *cli,
                "train",
                "--deployment",
                d,
                "--out",
                str(folder / "ppo.zip"),
                "--seed",
                "0",
                "--no-progress",
            ]
            if args.timesteps is not None:
                cmd += ["--timesteps", str(args.timesteps)]
            log = open(folder / "train.log", "w")  # noqa: SIM115 - closed after wait
            procs.append((d, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        rc = _wait_all("train", procs, t0)
        if rc:
            return rc
    if not args.skip_eval:
        per = max(1, args.jobs // len(deps))
        procs = []
        for d in deps:
            folder = args.out / d
            cmd = [*cli, "eval", "--deployment", d, "--policy", str(folder / "ppo.zip")]
            extra = folder / "warmstart.zip"
            if extra.exists():
                cmd += ["--policy", str(extra)]
            cmd += ["--baselines", "all", "--out", str(folder / "eval"), "--jobs", str(per)]
            log = open(folder / "eval.log", "w")  # noqa: SIM115 - closed after wait
            procs.append((d, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        rc = _wait_all("eval", procs, t0)
        if rc:
            return rc
    return 0


def _wait_all(stage: str, procs: list, t0: float) -> int:  # type: ignore[type-arg]
    """Wait for every (deployment, process, log) of a stage; the first failing exit status, else 0."""
    first_failure = 0
    for d, p, log in procs:
        rc = p.wait()
        log.close()
        print(f"{stage} {d}: exit {rc} at {time.perf_counter() - t0:.0f} s", flush=True)
        first_failure = first_failure or rc
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
