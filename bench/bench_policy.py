"""Per-decision cost of the served PPO policy: its MLP (compiled, and plain) vs SB3 ``predict``.

Usage: ``python bench/bench_policy.py [PPO_ZIP]`` (default: the bundled policy, or a freshly
initialised 2×64 tanh policy when none is bundled). Prints one table; the ratios are measured
in this one run, on the same observations. The numba row is what ``controller serve`` runs
where numba is installed (the ``serve`` extra); the plain row, the same source run by Python,
what it runs without (timed on fewer observations: it is three orders of magnitude slower).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from controller.features import Featurizer
from controller.ppo_policy import load_ppo_factory, meta_for, write_metadata
from controller.protocol import DEFAULT_DEPTHS as DEPTHS
from controller.protocol import Step

N = 5000
N_PLAIN = 200


def _fresh_zip(folder: Path) -> Path:
    import gymnasium as gym
    from stable_baselines3 import PPO

    obs_dim = Featurizer(DEPTHS).obs_dim

    class Spaces(gym.Env):
        observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        action_space = gym.spaces.Discrete(len(DEPTHS))

    path = folder / "fresh.zip"
    PPO("MlpPolicy", Spaces(), policy_kwargs={"net_arch": [64, 64]}, device="cpu", n_steps=64).save(path)
    write_metadata(path, meta_for(DEPTHS, (64, 64)))
    return path


def main() -> None:
    import torch
    from stable_baselines3 import PPO

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("zip", nargs="?", type=Path, help="a PPO zip (default: the bundled h200-llama8b one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundled = Path(__file__).resolve().parents[1] / "agents" / "bundled" / "h200-llama8b" / "ppo.zip"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.zip if args.zip else bundled if bundled.exists() else _fresh_zip(Path(tmp))
        factory = load_ppo_factory(path)
        policy = factory(factory.meta.depths)
        obs = np.random.default_rng(0).normal(0, 1, (N, factory.meta.obs_dim)).astype(np.float32)
        step = Step("i", 1, 0, 1, 0, [], 1, 1, 0.0, 0, 1)
        model = PPO.load(path, device="cpu")  # trusted local file: only the benchmark unpickles

        def timed(fn, n: int = N) -> float:
            fn(obs[0])
            t0 = time.perf_counter()
            for o in obs[:n]:
                fn(o)
            return (time.perf_counter() - t0) / n * 1e6

        mlp = policy._mlp
        compiled = mlp._compiled
        rows: list[tuple[str, float, float]] = []
        # SB3 gets the MLP's input: the observation plus, for a zip with a model table, the
        # fitted model's features (policy.act computes them itself, and is timed with them).
        predict_us = timed(lambda o: model.predict(policy._input(o), deterministic=True))
        expected = [int(model.predict(policy._input(o), deterministic=True)[0]) for o in obs[:1000]]
        for label, on, n in (("numba MLP", True, N), ("plain-Python MLP", False, N_PLAIN)):
            if on and not compiled:
                continue  # numba not installed or disabled
            mlp._compiled = on
            us = timed(lambda o: policy.act(o, step), n)
            agree = float(np.mean([policy.act(o, step) == e for o, e in zip(obs[:n], expected)]))
            rows.append((label, us, agree))
        mlp._compiled = compiled
    print(f"policy: {path}")
    print(f"{'method':<22}{'µs/decision':>12}{'vs predict':>12}  agreement with predict")
    for label, us, agree in rows:
        print(f"{label:<22}{us:>12.1f}{predict_us / us:>11.1f}×  {agree:.3f}")
    print(f"{'SB3 predict':<22}{predict_us:>12.1f}")


if __name__ == "__main__":
    main()
