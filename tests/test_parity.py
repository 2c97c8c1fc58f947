"""Serve vs simulator: the same step-record stream gives the same actions.

The simulator runs a policy through the real Featurizer (``env.runner.simulate``) and we
record every step record it produced and every action the policy answered. Then a real
``controller serve`` process gets the same records over a raw ZeroMQ DEALER and must answer
the same depths, one decision per step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from controller.features import Featurizer
from controller.ppo_policy import meta_for, write_metadata
from controller.protocol import Hello, Step, encode
from controller.registry import make_factory

DEPTHS = (0, 1, 2, 3, 5)
BUNDLED = Path(__file__).resolve().parents[1] / "agents" / "bundled" / "h200-llama8b" / "ppo.zip"


class Recording:
    """Wraps a policy; remembers each record it was shown and the action it answered."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.log: list[tuple[Step, int]] = []
        if hasattr(inner, "featurizer_version"):  # simulate() then builds the version it was trained on
            self.featurizer_version = inner.featurizer_version

    def reset(self) -> None:
        self.inner.reset()

    def act(self, obs: np.ndarray, step: Step) -> int:
        a = int(self.inner.act(obs, step))
        self.log.append((step, a))
        return a


def _random_ppo_zip(folder: Path) -> Path:
    import gymnasium as gym
    from stable_baselines3 import PPO

    obs_dim = Featurizer(DEPTHS).obs_dim

    class Spaces(gym.Env):
        observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        action_space = gym.spaces.Discrete(len(DEPTHS))

    model = PPO("MlpPolicy", Spaces(), policy_kwargs={"net_arch": [64, 64]}, n_steps=64, seed=0, device="cpu")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.policy.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = folder / "random-ppo.zip"
    model.save(path)
    write_metadata(path, meta_for(DEPTHS, (64, 64)))
    return path


def _sim_params():
    try:
        from env.deployments import load_deployment

        return load_deployment("h200-llama8b")
    except Exception:  # the bundled deployments are not in this checkout yet
        from env.params import SimParams

        return SimParams()


def _sim_log(spec: str, workload: str, seed: int, delay: int) -> list[tuple[Step, int]]:
    from env.runner import simulate

    rec = Recording(make_factory(spec, DEPTHS)(DEPTHS))
    # 16 simulated seconds: a policy that drafts at long contexts runs steps of ~0.2 s there.
    simulate(_sim_params(), workload, rec, depths=DEPTHS, seed=seed, duration_s=16.0, action_delay=delay)
    return rec.log


@pytest.fixture()
def server(tmp_path):
    procs = []

    def start(policy: str) -> tuple[zmq.Socket, str]:
        endpoint = f"ipc:///tmp/agents-parity-{os.getpid()}-{len(procs)}.sock"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "controller.cli",
                "serve",
                "--policy",
                policy,
                "--bind",
                endpoint,
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc, endpoint

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _replay(endpoint: str, proc, log: list[tuple[Step, int]], instance: str) -> list[int]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        hello = encode(Hello(instance=instance, depths=DEPTHS, engine="sim", model="parity"))
        deadline = time.monotonic() + 60
        while True:  # the server may still be loading torch; hello until welcomed
            assert proc.poll() is None, proc.stdout.read().decode()
            sock.send(hello)
            if sock.poll(500):
                reply = msgpack.unpackb(sock.recv())
                assert reply["t"] == "welcome", reply
                break
            assert time.monotonic() < deadline, "controller serve did not answer hello"
        got = []
        for step, _ in log:
            wire = step.to_wire()
            wire["instance"] = instance
            sock.send(msgpack.packb(wire))
            while True:  # skip the welcomes of repeated hellos
                assert sock.poll(10_000), "no decision within 10 s"
                reply = msgpack.unpackb(sock.recv())
                if reply["t"] != "welcome":
                    break
            assert reply["t"] == "decision" and reply["seq"] == step.seq, reply
            got.append(reply["depth"])
        return got
    finally:
        sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["ppo", "builtin:sglang-adaptive", "builtin:bandit"])
def test_serve_and_simulator_pick_the_same_actions(server, tmp_path, which):
    if which == "ppo":
        policies = [str(_random_ppo_zip(tmp_path))] + ([str(BUNDLED)] if BUNDLED.exists() else [])
    else:
        policies = [which]
    for policy in policies:
        proc, endpoint = server(policy)
        used: set[int] = set()
        for i, (workload, delay) in enumerate(
            [("phase:2:closed:12", 1), ("burst:2,30,2,0.3", 2), ("closed:120", 1)]
        ):
            log = _sim_log(policy, workload, seed=i, delay=delay)
            assert len(log) > 100
            expected = [DEPTHS[a] for _, a in log]
            got = _replay(endpoint, proc, log, instance=f"sim-{i}")
            mismatches = [k for k, (a, b) in enumerate(zip(expected, got)) if a != b]
            assert not mismatches, f"{policy} on {workload}: first mismatch at step {mismatches[0]}"
            used |= set(expected)
        if which == "ppo":
            assert len(used) > 1, f"{policy} should use several depths on these workloads"
