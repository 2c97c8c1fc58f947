"""Behaviour frozen before a refactor: served decisions, observations, simulator and env output.

``tests/golden/behaviour.json`` holds what the code computed when it was written (the commit is
named in the file): the decisions of the bundled PPO policies and of every builtin baseline over
recorded traces and a random step stream, the bytes a real ``Server`` answered to a trace, the
Featurizer's observations, engine records, ``SpecDecode-v0`` observations and rewards, and
``simulate`` results. The test recomputes all of it with the code as it is and wants it equal,
bit for bit.

Exact floats depend on the platform (the C library's ``exp``/``log``, numba's vector code), so
the comparison runs only where the file's platform fingerprint matches this one; elsewhere it
skips and says why. Regenerate (only for an intended behaviour change, saying so in the
commit): ``python tests/test_golden.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "behaviour.json"
DEPTHS = (0, 1, 2, 3, 5)
BUNDLED = ROOT / "agents" / "bundled"
EXAMPLES = ROOT / "env" / "example_traces"
BUILTINS = (
    "static:0",
    "static:3",
    "vllm-dsd",
    "trtllm-schedule",
    "sglang-adaptive",
    "goodput",
    "bandit",
)


def fingerprint() -> dict[str, str]:
    import numba

    from controller._jit import JIT_ENABLED

    return {
        "jit": str(JIT_ENABLED),
        "machine": platform.machine(),
        "libc": " ".join(platform.libc_ver()),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
    }


def _sha(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else msgpack.packb(p))
    return h.hexdigest()


# ----------------------------------------------------------------------------- streams


def random_stream(n: int, seed: int, depths: tuple[int, ...] = DEPTHS) -> list[Any]:
    """A step stream from Python's ``random`` alone: no C library in its making."""
    from controller.protocol import Step

    rng = random.Random(seed)
    out = []
    bs = 8
    for seq in range(1, n + 1):
        d = rng.choice(depths)
        bs = max(1, min(256, bs + rng.randint(-6, 6) if rng.random() < 0.9 else rng.randint(1, 256)))
        p = rng.random()
        accept = []
        for _ in range(bs if d else 0):
            a = 0
            while a < d and rng.random() < p:
                a += 1
            accept.append(a)
        out.append(
            Step(
                "g",
                seq,
                d,
                bs,
                rng.randint(0, 40),
                accept,
                rng.randint(4000, 60000),
                bs * rng.randint(100, 6000),
                round(rng.random(), 6),
                rng.choice((0, 0, 0, 512, 4000)),
                seq * 1000,
            )  # fmt: skip
        )
    return out


def trace_streams() -> dict[str, tuple[tuple[int, ...], list[Any]]]:
    """Every instance of the bundled example traces (simulated and measured): depths, steps."""
    from controller.traces import iter_records, step_records, trace_files

    out: dict[str, tuple[tuple[int, ...], list[Any]]] = {}
    for folder in ("h200-llama8b", "h200-real-same", "h200-real-noisy"):
        depths: dict[str, tuple[int, ...]] = {}
        for path in trace_files(EXAMPLES / folder):
            for r in iter_records(path):
                if r["t"] == "hello":
                    depths[r["instance"]] = tuple(r["depths"])
        for inst, steps in sorted(step_records(EXAMPLES / folder).items()):
            out[f"{folder}/{inst}"] = (depths[inst], steps)
    return out


# ----------------------------------------------------------------------------- what is frozen


def _policy(spec: str, depths: tuple[int, ...]) -> Any:
    from controller.registry import make_factory

    return make_factory(spec, depths)(depths)


def _ppo_specs() -> dict[str, str]:
    return {f"ppo:{name}": str(BUNDLED / name / "ppo.zip") for name in ("h200-llama8b", "seed")}


def decisions(stream: list[Any], depths: tuple[int, ...]) -> dict[str, str]:
    """Each policy's actions over ``stream`` (a digit per step), as the service decides them
    (with the Featurizer version each policy was made for)."""
    from controller.features import featurizer_for
    from controller.registry import make_factory

    specs = {name: f"builtin:{name}" for name in BUILTINS}
    if depths == DEPTHS:
        specs.update(_ppo_specs())
    out: dict[str, str] = {}
    for name, spec in specs.items():
        if name == "static:3" and 3 not in depths:
            continue
        factory = make_factory(spec, depths)
        policy = factory(depths)
        feat = featurizer_for(policy, depths)
        acts = [int(policy.act(feat.update(s), s)) for s in stream]
        out[name] = "".join(map(str, acts))
        if spec.endswith(".zip"):  # the fused kernel the service serves with decides the same
            factory.prepare_serving()
            fused = factory(depths)
            feat = featurizer_for(fused, depths)
            acts_fused = [int(feat.update_with(s, fused.fused)) for s in stream] if fused.fused else acts
            assert acts_fused == acts, name
    return out


def observations(stream: list[Any], depths: tuple[int, ...]) -> str:
    from controller.features import Featurizer

    feat = Featurizer(depths)
    return _sha(*(feat.update(s).tobytes() for s in stream))


def served_replies(stream: list[Any], depths: tuple[int, ...], spec: str) -> str:
    """The bytes an in-process ``Server`` answers to a hello and the stream's steps."""
    import zmq

    from controller.protocol import Hello
    from controller.service import ServeConfig, Server

    ctx = zmq.Context()
    server = Server(ServeConfig(policy=spec, bind="inproc://golden", poll="block"), context=ctx)
    peer = ctx.socket(zmq.DEALER)
    peer.connect("inproc://golden")
    replies = []
    try:
        for msg in [Hello("golden", depths, "sim", "m", 1), *stream]:
            wire = msg.to_wire()
            if wire["t"] == "step":
                wire["instance"] = "golden"
            peer.send(msgpack.packb(wire))
            while not server.drain():
                pass
            replies.append(peer.recv())
    finally:
        peer.close(0)
        server.close()
        ctx.term()
    return _sha(*replies)


def engine_records(workload: str, seed: int, n: int) -> str:
    from env.deployments import load_deployment
    from env.engine import Engine

    eng = Engine(load_deployment("h200-llama8b"), workload)
    eng.reset(seed)
    rng = random.Random(seed)
    parts = []
    for _ in range(n):
        if eng.done:
            break
        rec = eng.step(rng.choice((0, 1, 2, 3, 5, 7)))
        parts.append([rec.to_wire(), eng.last_model_us, eng.last_base_us, eng.drift])
    parts.append([eng.expected_rate(d) for d in (0, 1, 3, 5)])
    return _sha(*parts)


def env_episode(n: int, **kw: Any) -> str:
    from env.gym_env import SpecDecodeEnv

    env = SpecDecodeEnv(episode_steps=n, **kw)
    obs, info = env.reset(seed=11)
    parts: list[Any] = [obs.tobytes()]
    rng = random.Random(3)
    for _ in range(n):
        obs, reward, term, trunc, info = env.step(rng.randrange(len(env.depths)))
        parts += [
            obs.tobytes(),
            [reward, term, trunc, info["step"].to_wire(), info["busy_us"], info["now_us"]],
        ]
        if term or trunc:
            break
    return _sha(*parts)


def simulated(spec: str, deployment: str, workload: str, seconds: float) -> dict[str, Any]:
    from env.deployments import load_deployment
    from env.runner import simulate

    res = simulate(
        load_deployment(deployment),
        workload,
        _policy(spec, DEPTHS),
        depths=DEPTHS,
        seed=4,
        duration_s=seconds,
    )
    return {
        "result": res.as_dict(),
        "trace": _sha(res.trace_time_s.tobytes(), res.trace_bs.tobytes(), res.trace_depth.tobytes()),
    }


def evaluated(spec: str, workload: str, seconds: float) -> dict[str, Any]:
    """One ``controller eval`` run (its goodput uses the fitted latency model, its oracle the engine)."""
    from agents.evaluate import Workload, _Job, run_job
    from env.deployments import load_deployment

    sim_json = json.dumps(load_deployment("h200-llama8b").to_dict())
    job = run_job(
        _Job(sim_json, Workload(workload, "x", None, seconds), spec, spec, DEPTHS, 2, keep_trace=True)
    )
    return job.result


def trained() -> str:
    """A tiny ``controller train`` (warm start with the numpy actor, then PPO): its weights."""
    import io
    import tempfile
    import zipfile

    import torch

    from agents.train import TrainConfig, train

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ppo.zip"
        cfg = TrainConfig(
            out=out, deployment="seed", timesteps=256, n_envs=2, n_steps=128, batch_size=128, n_epochs=1,
            episode_steps=100, n_workloads=8, bc_rounds=2, bc_states=300, bc_epochs=1, progress=False,
        )  # fmt: skip
        train(cfg, log=lambda *_: None)
        with zipfile.ZipFile(out) as zf:
            sd = torch.load(io.BytesIO(zf.read("policy.pth")), weights_only=True)
    return _sha(*(k.encode() + v.numpy().tobytes() for k, v in sorted(sd.items())))


def compute() -> dict[str, Any]:
    out: dict[str, Any] = {"decisions": {}, "observations": {}}
    rand = random_stream(3000, seed=1)
    out["decisions"]["random"] = decisions(rand, DEPTHS)
    out["observations"]["random"] = observations(rand, DEPTHS)
    for name, (depths, steps) in trace_streams().items():
        steps = steps[:1500]
        out["decisions"][name] = decisions(steps, depths)
        out["observations"][name] = observations(steps, depths)
    out["served"] = {
        name: served_replies(rand[:1500], DEPTHS, spec)
        for name, spec in {**_ppo_specs(), "builtin:sglang-adaptive": "builtin:sglang-adaptive"}.items()
    }
    out["engine"] = {
        "closed:48": engine_records("closed:48", 5, 3000),
        "phase:4:poisson:20": engine_records("phase:4:poisson:20", 6, 3000),
    }
    out["env"] = {
        "closed:32": env_episode(1500, workload="closed:32"),
        "randomized": env_episode(
            1500,
            workload=["poisson:25", "burst:2,30,5,0.3"],
            randomize=1.0,
            action_delay=(1, 2),
            drafter_mix=0.5,
        ),
        "seed": env_episode(800, deployment="seed", workload="closed:8"),
    }
    out["simulate"] = {
        f"{spec} {dep} {wl}": simulated(spec, dep, wl, 15.0)
        for spec, dep, wl in (
            (_ppo_specs()["ppo:h200-llama8b"], "h200-llama8b", "ramp:1,40,12@output=256"),
            (_ppo_specs()["ppo:seed"], "seed", "closed:16"),
            ("builtin:sglang-adaptive", "h200-llama8b", "closed:64"),
            ("builtin:goodput", "h200-llama8b", "poisson:10"),
            ("builtin:bandit", "seed", "closed:4"),
        )
    }
    out["eval"] = {
        spec: evaluated(spec, wl, 10.0)
        for spec, wl in (
            ("goodput", "poisson:12"),
            ("oracle", "closed:24"),
            (str(BUNDLED / "h200-llama8b" / "ppo.zip"), "phase:4:closed:16"),
        )
    }
    out["eval"] = {k.replace(str(ROOT) + "/", ""): v for k, v in out["eval"].items()}
    out["train"] = trained()
    # Keys that name files by absolute path would tie the file to one checkout.
    out["simulate"] = {k.replace(str(ROOT) + "/", ""): v for k, v in out["simulate"].items()}
    return out


# ----------------------------------------------------------------------------- the test


def _load() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.slow
def test_behaviour_is_what_the_golden_file_froze() -> None:
    golden = _load()
    if golden["platform"] != fingerprint():
        pytest.skip(f"golden file made on {golden['platform']}, this is {fingerprint()}: exact floats differ")
    now = compute()
    assert set(now) == set(golden["data"])
    problems = [f"{path}: {why}" for path, why in _differences(golden["data"], now, "")]
    assert not problems, "behaviour changed:\n" + "\n".join(problems[:20])


def _differences(want: Any, got: Any, path: str) -> list[tuple[str, str]]:
    """Where ``got`` differs from ``want``; for action strings, the first step that differs."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [(f"{path}/{k}", "missing") for k in want if k not in got]
        out += [(f"{path}/{k}", "unexpected") for k in got if k not in want]
        for k in want:
            if k in got:
                out += _differences(want[k], got[k], f"{path}/{k}")
        return out
    if want == got:
        return []
    if isinstance(want, str) and isinstance(got, str) and want.isdigit() and got.isdigit():
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        return [(path, f"first differs at step {first} of {len(want)}")]
    return [(path, f"{want!r} != {got!r}")]


def main(argv: list[str]) -> int:
    data = compute()
    if "--write" in argv:
        commit = argv[argv.index("--write") + 1] if len(argv) > argv.index("--write") + 1 else "unknown"
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(
            json.dumps({"generated_at_commit": commit, "platform": fingerprint(), "data": data}, indent=1)
            + "\n"
        )
        print(f"wrote {GOLDEN}")
    else:
        print(json.dumps(data, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
