"""The numba-compiled kernels and their plain-Python source give the same results, bit for bit.

The Featurizer's and the engine's hot loops are one source, compiled when numba is
installed (``controller/_jit.py``). This runs the simulator (engine, Featurizer, gym
reward) and the Featurizer on its own in this process, and again in a subprocess with
``SPECDEPTH_NO_JIT=1``, and compares digests of everything they produced, stage by stage.
Run as a script it prints the digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from dataclasses import astuple, replace
from pathlib import Path

import msgpack
import numpy as np
import pytest

from controller._jit import JIT_ENABLED

DEPTHS = (0, 1, 2, 3, 5)


def _env_digest(name: str, steps: int, **kw: object) -> str:
    from env.gym_env import SpecDecodeEnv

    h = hashlib.sha256()
    env = SpecDecodeEnv(episode_steps=steps, **kw)  # type: ignore[arg-type]
    obs, info = env.reset(seed=7)
    h.update(obs.tobytes())
    rng = np.random.default_rng(1)
    for _ in range(steps):
        obs, reward, term, trunc, info = env.step(int(rng.integers(len(env.depths))))
        h.update(obs.tobytes())
        h.update(
            msgpack.packb([reward, term, trunc, info["step"].to_wire(), info["busy_us"], info["now_us"]])
        )
        if term or trunc:
            break
    assert env.engine is not None
    h.update(repr([astuple(c) for c in env.engine.completed]).encode())
    h.update(repr(float(env.engine.drift)).encode())
    return f"{name}:{h.hexdigest()}"


def _engine_digest(steps: int) -> str:
    """Stale penalty on, drift on, depths beyond the default noise width (the block grows)."""
    from env.deployments import load_deployment
    from env.engine import Engine

    p = load_deployment("h200-llama8b")
    p = replace(p, acceptance=replace(p.acceptance, stale_logit=1.5, stale_recover_steps=4.0, drift_sd=0.4))
    eng = Engine(p, "poisson:60")
    eng.reset(3)
    h = hashlib.sha256()
    rng = np.random.default_rng(2)
    for _ in range(steps):
        rec = eng.step(int(rng.choice((0, 0, 1, 4, 9))))
        h.update(msgpack.packb([rec.to_wire(), eng.last_model_us, eng.last_base_us, eng.drift]))
    h.update(msgpack.packb([eng.expected_rate(d) for d in (0, 3, 9)]))
    return f"engine:{h.hexdigest()}"


def _featurizer_digest(n: int) -> str:
    """Random records over several depth sets, incl. accepted counts above 255 (int64 path),
    and over every version still served."""
    from controller.features import SUPPORTED_VERSIONS, Featurizer
    from controller.protocol import Step

    h = hashlib.sha256()
    rnd = random.Random(5)
    runs = [(depths, None) for depths in (DEPTHS, (3,), (1, 2), tuple(range(16)), (0, 300))]
    runs += [(DEPTHS, v) for v in SUPPORTED_VERSIONS]
    for depths, version in runs:
        f = Featurizer(depths) if version is None else Featurizer(depths, version)
        for seq in range(n):
            d = rnd.choice(depths)
            bs = rnd.randint(1, 300)
            if d > 255:  # counts a bytearray cannot hold
                accept = [rnd.randint(0, d) for _ in range(bs)]
            else:
                accept = [min(d, int(rnd.expovariate(0.3))) for _ in range(bs)] if d else []
            step = Step("i", seq, d, bs, rnd.randint(0, 50), accept, rnd.randint(0, 90_000),
                        rnd.randint(0, 10**7), rnd.random(), rnd.choice((0, 0, 4000)), seq)  # fmt: skip
            h.update(f.update(step).tobytes())
        h.update(repr([f.expected_tokens(d) for d in depths]).encode())
        h.update(repr([f.latency_ratio(d, 64) for d in depths]).encode())
    return f"featurizer:{h.hexdigest()}"


def digests() -> list[str]:
    """One digest per stage (a few thousand steps in all)."""
    return [
        _env_digest("env-closed", 1500, workload="closed:64"),
        _env_digest("env-randomized", 1500, workload="poisson:30", randomize=1.0, action_delay=(1, 2)),
        _env_digest("env-drafters", 1000, workload="burst:2,30,5,0.3", drafter_mix=1.0),
        _engine_digest(1500),
        _featurizer_digest(300),
    ]


@pytest.mark.slow
@pytest.mark.skipif(not JIT_ENABLED, reason="numba not installed (or disabled): nothing compiled to compare")
def test_compiled_and_plain_python_agree_bit_for_bit() -> None:
    env = dict(os.environ, SPECDEPTH_NO_JIT="1")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plain["jit"] is False
    assert digests() == plain["digests"]


@pytest.mark.skipif(not JIT_ENABLED, reason="numba not installed (or disabled): nothing to compile")
def test_serve_compiles_the_featurizer_before_it_binds(tmp_path: Path) -> None:
    """A (re)started controller answers its first step without waiting for the compiler."""
    code = (
        "from controller.features import _fold\n"
        "from controller.service import ServeConfig, Server\n"
        "assert not _fold.signatures\n"  # a fresh process: nothing compiled on import
        f"s = Server(ServeConfig(policy='builtin:static:0', bind='ipc://{tmp_path}/c.sock'))\n"
        "print(len(_fold.signatures))\n"
        "s.close()\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 1


if __name__ == "__main__":
    print(json.dumps({"jit": JIT_ENABLED, "digests": digests()}))
