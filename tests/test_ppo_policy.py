"""The PPO zip loader: its MLP == SB3 predict, compiled or not; mismatches refused, nothing unpickled."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
import zipfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from controller._jit import JIT_ENABLED
from controller.errors import PolicyLoadError
from controller.features import FEATURIZER_VERSION, Featurizer
from controller.policy import FusedPolicy, ServingFactory
from controller.ppo_policy import (
    META_NAME,
    MODEL_BS_GRID,
    MODEL_CTX_GRID,
    PPOMeta,
    load_ppo_factory,
    meta_for,
    model_features,
    model_inputs,
    read_ppo_zip,
    tanh32,
    write_metadata,
)
from controller.protocol import Step
from controller.registry import make_factory

DEPTHS = (0, 1, 2, 3, 5)


class _SpacesOnly(gym.Env):
    """An env with the Featurizer's spaces: enough for SB3 to build and save a policy."""

    def __init__(self, obs_dim: int, n: int) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        self.action_space = spaces.Discrete(n)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(self.observation_space.shape, np.float32), {}

    def step(self, action):
        return np.zeros(self.observation_space.shape, np.float32), 0.0, False, False, {}


def _save_model(tmp_path: Path, depths=DEPTHS, activation: str = "tanh", arch=(64, 64), seed: int = 0):
    from stable_baselines3 import PPO

    feat = Featurizer(depths)
    act_fn = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[activation]
    model = PPO(
        "MlpPolicy",
        _SpacesOnly(feat.obs_dim, len(depths)),
        policy_kwargs={"net_arch": list(arch), "activation_fn": act_fn},
        n_steps=64,
        seed=seed,
        device="cpu",
    )
    # Untrained heads are near-uniform; spread the weights so argmax is decided by the input.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.policy.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
    path = tmp_path / f"ppo-{activation}.zip"
    model.save(path)
    write_metadata(path, meta_for(depths, arch, activation))
    return model, path


def _step_stream(n: int, depths=DEPTHS, seed: int = 0) -> list[Step]:
    """A random step stream: mixed depths, batch sizes 1-250, acceptance uniform in 0..depth."""
    rng = random.Random(seed)
    out = []
    for seq in range(1, n + 1):
        d = rng.choice(depths)
        bs = rng.randint(1, 250)
        accept = [rng.randint(0, d) for _ in range(bs)] if d else []
        out.append(
            Step(
                "i",
                seq,
                d,
                bs,
                rng.randint(0, 50),
                accept,
                rng.randint(3000, 90000),
                bs * rng.randint(100, 8000),
                rng.random(),
                rng.randint(1, 4000) if rng.random() < 0.2 else 0,  # most decode steps admit nobody
                seq,
            )
        )
    return out


def _observations(depths=DEPTHS, n: int = 3000, seed: int = 0) -> np.ndarray:
    """Real Featurizer outputs from a random step stream, plus Gaussian noise rows."""
    feat = Featurizer(depths)
    rows = [feat.update(step) for step in _step_stream(n // 2, depths, seed)]
    noise = np.random.default_rng(seed).normal(0, 1.5, (n - len(rows), feat.obs_dim)).astype(np.float32)
    return np.vstack([np.array(rows), noise])


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "plain"])
@pytest.mark.parametrize(
    "activation,arch", [("tanh", (64, 64)), ("relu", (64, 64)), ("tanh", (16,)), ("relu", (32, 32, 32))]
)
def test_mlp_picks_the_same_action_as_sb3_predict(tmp_path, activation, arch, compiled):
    model, path = _save_model(tmp_path, activation=activation, arch=arch)
    obs = _observations()
    expected, _ = model.predict(obs, deterministic=True)
    policy = load_ppo_factory(path, DEPTHS)(DEPTHS)
    if compiled:
        if not JIT_ENABLED:
            pytest.skip("numba is not installed or disabled")
        assert policy._mlp._compiled
    else:
        policy._mlp._compiled = False  # the same source as plain Python, as without numba
        obs, expected = obs[::5], expected[::5]  # plain Python loops: ~2 ms a decision
    dummy = Step("i", 1, 0, 1, 0, [], 1, 1, 0.0, 0, 1)
    got = np.array([policy.act(o, dummy) for o in obs])
    assert len(set(expected.tolist())) > 2, "the test network should use several actions"
    assert (got == expected).mean() == 1.0
    # And the log-probabilities themselves agree with torch's to float32 precision.
    with torch.no_grad():
        ref = model.policy.get_distribution(torch.as_tensor(obs[:50])).distribution.logits.numpy()
    ours = policy.logits(obs[:50]).astype(np.float64)
    ours -= ours.max(1, keepdims=True)  # a stable log-softmax: deep relu nets give large logits
    ours -= np.log(np.exp(ours).sum(1, keepdims=True))
    keep = ref > -30  # below that, float32 logits carry no digits worth comparing
    np.testing.assert_allclose(ours[keep], ref[keep], rtol=1e-4, atol=1e-4)


def test_factory_through_make_factory_and_metadata_round_trip(tmp_path):
    _, path = _save_model(tmp_path)
    factory = make_factory(str(path), DEPTHS)
    assert factory.name.startswith("ppo:")
    meta, _ = read_ppo_zip(path)
    assert meta.depths == DEPTHS and meta.net_arch == (64, 64) and meta.obs_dim == Featurizer(DEPTHS).obs_dim


def test_zip_for_other_depths_is_refused_with_both_lists(tmp_path):
    _, path = _save_model(tmp_path)
    with pytest.raises(
        PolicyLoadError, match=r"trained for depths \[0, 1, 2, 3, 5\], the instance allows \[0, 1, 2, 3\]"
    ):
        load_ppo_factory(path, (0, 1, 2, 3))
    factory = load_ppo_factory(path)
    with pytest.raises(PolicyLoadError, match="trained for depths"):
        factory((0, 2, 4))  # an instance whose hello announces other depths


def _rewrite_meta(path: Path, **changes) -> None:
    with zipfile.ZipFile(path) as zf:
        raw = json.loads(zf.read(META_NAME))
    raw.update(changes)
    members = {}
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist() if n != META_NAME}
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in members.items():
            zf.writestr(n, d)
        zf.writestr(META_NAME, json.dumps(raw))


def test_other_featurizer_version_is_refused(tmp_path):
    _, path = _save_model(tmp_path)
    _rewrite_meta(path, featurizer_version=99)
    with pytest.raises(PolicyLoadError, match="Featurizer version 99, this controller runs versions 2, 3, 4"):
        load_ppo_factory(path, DEPTHS)


def test_a_zip_of_an_older_featurizer_version_is_served_with_that_version():
    """A user's zip keeps working after an upgrade: the policy served in the H200 calls
    (Featurizer version 2) is simulated with the observation it was trained on."""
    from controller.features import featurizer_for, featurizer_version_of
    from env.deployments import load_deployment
    from env.runner import simulate

    path = Path(__file__).resolve().parents[1] / "bench/results/h200/ppo2/ppo.zip"
    depths = (0, 1, 3, 5)
    factory = load_ppo_factory(path, depths)
    assert featurizer_version_of(factory) == 2  # what `controller serve` says at start
    policy = factory(depths)
    assert policy.featurizer_version == 2 and featurizer_for(policy, depths).version == 2
    assert featurizer_for(make_factory("builtin:static:1")(depths), depths).version == FEATURIZER_VERSION
    res = simulate(
        load_deployment("h200-llama8b"), "closed:8@prompt=128,output=32", policy, depths=depths, n_requests=8
    )
    assert res.steps > 0 and res.n_requests == 8


def test_other_feature_layout_is_refused(tmp_path):
    _, path = _save_model(tmp_path)
    names = Featurizer(DEPTHS).feature_names
    _rewrite_meta(path, feature_names=[names[1], names[0], *names[2:]])
    with pytest.raises(PolicyLoadError, match="feature names differ at 0: 'waiting' vs 'bs'"):
        load_ppo_factory(path, DEPTHS)


def test_weights_that_disagree_with_the_metadata_are_refused(tmp_path):
    _, path = _save_model(tmp_path, arch=(32, 32))
    _rewrite_meta(path, net_arch=[64, 64])
    with pytest.raises(PolicyLoadError, match=r"hidden widths \[32, 32\]"):
        load_ppo_factory(path, DEPTHS)


def test_plain_sb3_zip_without_metadata_is_refused(tmp_path):
    model, path = _save_model(tmp_path)
    model.save(tmp_path / "plain.zip")
    with pytest.raises(PolicyLoadError, match=f"no {META_NAME} inside"):
        load_ppo_factory(tmp_path / "plain.zip", DEPTHS)
    with pytest.raises(PolicyLoadError, match="no such policy file"):
        load_ppo_factory(tmp_path / "missing.zip", DEPTHS)
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    with pytest.raises(PolicyLoadError, match="not a zip"):
        load_ppo_factory(tmp_path / "junk.zip", DEPTHS)


class _Boom:
    """Unpickling this runs os.system: the loader must never do it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_never_unpickles(tmp_path):
    _, path = _save_model(tmp_path)
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps(_Boom(marker))).decode()
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    data = json.loads(members["data"])
    data["observation_space"][":serialized:"] = payload  # what SB3's load would unpickle
    data["policy_class"] = {":type:": "<class 'x'>", ":serialized:": payload}
    members["data"] = json.dumps(data).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in members.items():
            zf.writestr(n, d)
    load_ppo_factory(path, DEPTHS)  # loads fine: the pickles are never read
    assert not marker.exists()

    # A policy.pth that is a pickle of code, not tensors, is refused, and nothing runs.
    buf = io.BytesIO()
    torch.save({"mlp_extractor.policy_net.0.weight": _Boom(marker)}, buf)
    members["policy.pth"] = buf.getvalue()
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in members.items():
            zf.writestr(n, d)
    with pytest.raises(PolicyLoadError, match="not a plain tensor state dict"):
        load_ppo_factory(path, DEPTHS)
    assert not marker.exists()


def test_frame_stacked_policy_stacks_its_own_observations(tmp_path):
    from stable_baselines3 import PPO

    feat = Featurizer(DEPTHS)
    model = PPO(
        "MlpPolicy",
        _SpacesOnly(feat.obs_dim * 3, len(DEPTHS)),
        policy_kwargs={"net_arch": [16]},
        n_steps=64,
        seed=0,
        device="cpu",
    )
    with torch.no_grad():
        for p in model.policy.parameters():
            p.normal_(0, 0.7)
    path = tmp_path / "stack.zip"
    model.save(path)
    write_metadata(path, meta_for(DEPTHS, (16,), frame_stack=3))
    factory = load_ppo_factory(path, DEPTHS)
    factory.prepare_serving()  # the stack lives in Python: no fused kernel for it
    policy = factory(DEPTHS)
    assert policy.fused is None
    obs = _observations(n=40)[:20]
    dummy = Step("i", 1, 0, 1, 0, [], 1, 1, 0.0, 0, 1)
    history = [obs[0], obs[0]]
    for o in obs:
        history.append(o)
        stacked = np.concatenate(history[-3:])
        expected, _ = model.predict(stacked, deterministic=True)
        assert policy.act(o, dummy) == int(expected)


def test_meta_json_round_trip():
    meta = meta_for(DEPTHS, (64, 64), extra={"seed": 3})
    assert PPOMeta.from_json(meta.to_json()) == meta
    with pytest.raises(PolicyLoadError, match="malformed"):
        PPOMeta.from_json('{"format": 1}')


def test_a_model_table_of_any_batch_grid_loads_and_a_ragged_one_is_refused():
    """The bs grid's size is the zip's own: zips with the older 19-point table keep loading."""
    nc = len(MODEL_CTX_GRID)
    for nb in (19, len(MODEL_BS_GRID)):
        table = [[[0.1 * k] * nc for _ in range(nb)] for k in range(len(DEPTHS))]
        meta = meta_for(DEPTHS, (64, 64), model_table=table)
        back = PPOMeta.from_json(meta.to_json())
        assert back.model_table is not None and len(back.model_table[0]) == nb
    ragged = [[[0.0] * nc for _ in range(19 if k else 20)] for k in range(len(DEPTHS))]
    with pytest.raises(PolicyLoadError, match="model_table has shape"):
        PPOMeta.from_json(meta_for(DEPTHS, (64, 64), model_table=ragged).to_json())
    short_ctx = [[[0.0] * (nc - 1) for _ in range(19)] for _ in DEPTHS]
    with pytest.raises(PolicyLoadError, match="model_table has shape"):
        PPOMeta.from_json(meta_for(DEPTHS, (64, 64), model_table=short_ctx).to_json())


def test_the_model_table_prices_small_batches_as_the_fit_does():
    """Each batch size to 12 reads the fitted model's own step-time ratio from the table (a
    drafted step's cost jumps where the verify's extend kernel starts another wave), the rest to
    32 within 5%: with 19 points, batch 8 on h200-llama8b read 4-7% dear."""
    import math

    from agents.train import fit_model_table
    from controller.features import decode_ctx, encode_bs
    from env.deployments import load_deployment
    from env.latency import step_time_us

    params = load_deployment("h200-llama8b")
    table = fit_model_table(params, DEPTHS)
    names = Featurizer(DEPTHS).feature_names
    inputs = model_inputs(DEPTHS)
    per_req = decode_ctx(0.7)  # a ctx grid point: only bs interpolates
    for bs in range(1, 33):
        obs = np.zeros(len(names), dtype=np.float32)
        obs[names.index("bs")] = encode_bs(bs)
        obs[names.index("ctx_per_req")] = 0.7
        lat = model_features(obs, table, inputs)[len(names) : len(names) + len(DEPTHS)]
        t0 = step_time_us(params.latency, bs, 0, bs * per_req)
        fit = [math.log(step_time_us(params.latency, bs, d, bs * per_req) / t0) for d in DEPTHS]
        np.testing.assert_allclose(lat, fit, atol=1e-5 if bs <= 12 else 0.05, err_msg=f"bs={bs}")


def test_the_compiled_tanh_stays_within_5e_7_of_the_exact_one():
    x = np.linspace(-12.0, 12.0, 24_001, dtype=np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1e-30, -1e-30, 1e-4, 88.0, -88.0])])
    ours = np.array([tanh32(v) for v in x], dtype=np.float64)
    exact = np.tanh(x.astype(np.float64))
    assert np.abs(ours - exact).max() < 5e-7
    assert tanh32(np.float32(0.0)) == 0.0 and np.all(np.abs(ours) <= 1.0)


def test_a_policy_numba_cannot_compile_is_served_uncompiled(tmp_path, monkeypatch, caplog):
    import controller.ppo_policy as ppo_policy

    if not JIT_ENABLED:
        pytest.skip("numba is not installed or disabled")
    model, path = _save_model(tmp_path)

    def broken(*args):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(ppo_policy, "_mlp_argmax", broken)
    policy = load_ppo_factory(path, DEPTHS)(DEPTHS)
    assert not policy._mlp._compiled
    assert "serving it uncompiled" in caplog.text
    obs = _observations(n=200)
    expected, _ = model.predict(obs, deterministic=True)
    dummy = Step("i", 1, 0, 1, 0, [], 1, 1, 0.0, 0, 1)
    assert [policy.act(o, dummy) for o in obs] == expected.tolist()


@pytest.mark.parametrize(
    "activation,arch", [("tanh", (64, 64)), ("relu", (64, 64)), ("tanh", (16,)), ("relu", (32, 32, 32))]
)
def test_the_fused_kernel_featurizes_and_acts_exactly_as_two_calls(tmp_path, activation, arch):
    if not JIT_ENABLED:
        pytest.skip("numba is not installed or disabled")
    model, path = _save_model(tmp_path, activation=activation, arch=arch)
    factory = load_ppo_factory(path, DEPTHS)
    assert isinstance(factory, ServingFactory) and isinstance(factory(DEPTHS), FusedPolicy)
    assert factory(DEPTHS).fused is None  # not before prepare_serving: loading stays cheap
    factory.prepare_serving()
    policy = factory(DEPTHS)
    assert policy.fused is not None
    two, one = Featurizer(DEPTHS), Featurizer(DEPTHS)
    obs, got = [], []
    for step in _step_stream(3000, seed=5):
        o = two.update(step)
        obs.append(o)
        a = policy.act(o, step)
        b = one.update_with(step, policy.fused)
        got.append(b)
        assert a == b, f"step {step.seq}: two calls chose {a}, the fused kernel {b}"
        assert np.array_equal(one._state, two._state)
    expected, _ = model.predict(np.array(obs), deterministic=True)
    assert len(set(got)) > 1, "the test network should use several actions"
    assert got == expected.tolist()


def test_a_fused_kernel_that_cannot_be_built_leaves_the_two_call_path(tmp_path, monkeypatch, caplog):
    import controller.ppo_policy as ppo_policy

    if not JIT_ENABLED:
        pytest.skip("numba is not installed or disabled")
    _, path = _save_model(tmp_path, arch=(16,))

    def broken(consume):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(ppo_policy, "fuse", broken)
    factory = load_ppo_factory(path, DEPTHS)
    factory.prepare_serving()
    assert factory(DEPTHS).fused is None
    assert "serving in two calls" in caplog.text
