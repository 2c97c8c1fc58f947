"""Baselines on hand-made step streams through the real Featurizer, and through the registry."""

from __future__ import annotations

import random

import numpy as np
import pytest

from agents.oracle import OraclePolicy
from controller.baselines import (
    BanditPolicy,
    GoodputPolicy,
    SGLangAdaptivePolicy,
    nearest_allowed_at_most,
)
from controller.errors import ConfigError, PolicyLoadError
from controller.features import Featurizer
from controller.protocol import Step
from controller.registry import builtin_names, make_factory

DEPTHS = (0, 1, 2, 3, 5)


def make_step(seq: int, depth: int, bs: int, accept: list[int] | None = None, step_us: int = 10_000) -> Step:
    if accept is None:
        accept = [] if depth == 0 else [depth] * bs
    return Step(
        instance="i",
        seq=seq,
        depth=depth,
        bs=bs,
        waiting=0,
        accept=accept,
        step_us=step_us,
        ctx_tokens=bs * 1000,
        kv_usage=0.1,
        prefill_tokens=0,
        ts_ns=seq * 1000,
    )


def drive(policy, steps: list[Step], depths=DEPTHS) -> list[int]:
    feat = Featurizer(depths)
    return [depths[policy.act(feat.update(s), s)] for s in steps]


def test_registry_lists_every_baseline():
    names = builtin_names()
    for n in ("static:", "vllm-dsd", "trtllm-schedule", "sglang-adaptive", "goodput", "bandit", "oracle"):
        assert n in names


def test_oracle_is_refused_outside_the_simulator():
    with pytest.raises(PolicyLoadError, match="simulator only"):
        make_factory("builtin:oracle", DEPTHS)
    with pytest.raises(ConfigError):
        OraclePolicy(DEPTHS).act(np.zeros(3), make_step(1, 0, 1))


def test_oracle_picks_the_best_true_rate():
    class Engine:
        def expected_rate(self, depth: int) -> float:
            return {0: 10.0, 1: 12.0, 2: 30.0, 3: 29.0, 5: 1.0}[depth]

    oracle = OraclePolicy(DEPTHS)
    oracle.bind_engine(Engine())
    assert DEPTHS[oracle.act(np.zeros(3), make_step(1, 0, 1))] == 2


def test_nearest_allowed_at_most():
    got = [DEPTHS[nearest_allowed_at_most(k, DEPTHS)] for k in (0, 1, 2, 3, 4, 5, 9)]
    assert got == [0, 1, 2, 3, 3, 5, 5]
    assert (1, 3)[nearest_allowed_at_most(0, (1, 3))] == 1  # none ≤ k: the smallest


@pytest.mark.parametrize(
    ("name", "table"),
    [
        ("vllm-dsd", {1: 5, 16: 5, 17: 3, 32: 3, 33: 3, 64: 3, 65: 1, 128: 1, 129: 0, 250: 0}),
        ("trtllm-schedule", {1: 3, 4: 3, 5: 2, 8: 2, 9: 1, 32: 1, 33: 0, 200: 0}),
    ],
)
def test_table_baselines_follow_the_batch_size(name, table):
    policy = make_factory(f"builtin:{name}", DEPTHS)(DEPTHS)
    steps = [make_step(i + 1, 1, bs) for i, bs in enumerate(table)]
    assert drive(policy, steps) == list(table.values())


def test_static_through_the_registry():
    policy = make_factory("builtin:static:2", DEPTHS)(DEPTHS)
    assert set(drive(policy, [make_step(i + 1, 0, 1 + i) for i in range(20)])) == {2}
    with pytest.raises(PolicyLoadError):
        make_factory("builtin:static:4", DEPTHS)


def test_sglang_adaptive_rises_with_acceptance_and_falls_without():
    policy = make_factory("builtin:sglang-adaptive", DEPTHS)(DEPTHS)
    # bs 1: tier "1", candidates [1, 3, 5, 7] ∩ DEPTHS = [1, 3, 5], starts at 3.
    out = drive(policy, [make_step(i + 1, 3, 1, [3]) for i in range(40)])
    assert out[:10] == [3] * 10  # warm-up: no change for 10 batches
    assert out[-1] == 5  # EMA → 3 > 3 − 0.5: step up
    policy.reset()
    out = drive(policy, [make_step(i + 1, 3, 1, [0]) for i in range(60)])
    assert out[-1] == 1  # accepts nothing: down to the tier's floor
    policy.reset()
    # bs 100: tier "64" is [0] only.
    assert drive(policy, [make_step(1, 0, 100)]) == [0]


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_adaptive_matches_sglang_itself():
    """Same verify stream → the same steps as SGLang 0.5.23's own AdaptiveSpeculativeParams."""
    mod = pytest.importorskip("sglang.srt.speculative.adaptive_spec_params")
    depths = (0, 1, 3, 5, 7)  # every default candidate is allowed, so no intersection effects
    from controller.baselines import SGLANG_SPEC_GRAPH_BS

    ref = mod.AdaptiveSpeculativeParams(initial_steps=3)
    ref.set_cuda_graph_bs(list(SGLANG_SPEC_GRAPH_BS))
    ours = SGLangAdaptivePolicy("sglang-adaptive", depths)
    rng = random.Random(0)
    feat = Featurizer(depths)
    depth, bs = 3, 1
    agree = 0
    for seq in range(1, 3000):
        if rng.random() < 0.05:
            bs = rng.choice([1, 2, 5, 7, 8, 9, 20, 31, 33, 57, 61, 64, 100])
        p = 0.9 if (seq // 400) % 2 == 0 else 0.3  # acceptance phases
        accept = []
        for _ in range(bs if depth > 0 else 0):
            a = 0
            while a < depth and rng.random() < p:
                a += 1
            accept.append(a)
        step = make_step(seq, depth, bs, accept)
        ref.on_verify_complete(accept if depth > 0 else [0] * bs, bs)
        expected = ref.get_steps_for_batch(bs)
        got = depths[ours.act(feat.update(step), step)]
        assert got == expected, f"seq {seq}: ours {got}, SGLang {expected}"
        agree += 1
        depth = got
    assert agree == 2999


def test_goodput_with_a_latency_model_trades_tokens_for_cost():
    # High acceptance, cheap verify: the deepest depth wins.
    cheap = GoodputPolicy("goodput", DEPTHS, latency_fn=lambda d, bs, ctx: 10_000.0 + 100.0 * d)
    steps = [make_step(i + 1, 5, 4, [5, 5, 5, 4]) for i in range(30)]
    assert drive(cheap, steps)[-1] == 5
    # Same acceptance, verify cost grows steeply with depth: no speculation wins.
    dear = GoodputPolicy("goodput", DEPTHS, latency_fn=lambda d, bs, ctx: 10_000.0 * (1 + d))
    assert drive(dear, steps)[-1] == 0


def test_goodput_measured_table_mode_uses_observed_latency():
    policy = make_factory("builtin:goodput", DEPTHS)(DEPTHS)
    feat = Featurizer(DEPTHS)
    # Depth 0 costs 10 ms, depth 3 costs 11 ms and accepts everything: 4 tokens for 1.1×.
    for i in range(20):
        s = make_step(2 * i + 1, 0, 8, step_us=10_000)
        policy.act(feat.update(s), s)
        s = make_step(2 * i + 2, 3, 8, [3] * 8, step_us=11_000)
        a = policy.act(feat.update(s), s)
    assert DEPTHS[a] in (3, 5)  # deeper than depth 0; 5 is unmeasured (ratio unknown → 0)
    assert DEPTHS[a] != 0


def test_goodput_takes_depth_0_as_measured_only_when_the_featurizer_does():
    """Depth 0 is measured before drafting in a new batch-size bucket; a depth-0 step followed
    by an admitting one does not measure it (Featurizer version 5: that step timed most of the
    admission), so goodput runs depth 0 again instead of drafting on the running ratio."""
    policy = make_factory("builtin:goodput", DEPTHS)(DEPTHS)
    feat = Featurizer(DEPTHS)

    def act(s: Step) -> int:
        return DEPTHS[policy.act(feat.update(s), s)]

    seq = 0
    for _ in range(20):  # bs 8: depth 3 costs 1.1x depth 0 and accepts everything
        act(make_step(seq := seq + 1, 0, 8, step_us=10_000))
        act(make_step(seq := seq + 1, 3, 8, [3] * 8, step_us=11_000))
    act(make_step(seq := seq + 1, 0, 64, step_us=40_000))  # timed the admission counted next
    admitting = make_step(seq := seq + 1, 3, 64, [3] * 64, step_us=12_000)
    admitting.prefill_tokens = 8
    assert act(admitting) == 0 and feat.latency_us(0, 64) == 0.0  # depth 0 unmeasured at bs 64
    act(make_step(seq := seq + 1, 0, 64, step_us=10_000))
    assert act(make_step(seq := seq + 1, 0, 64, step_us=10_000)) in (3, 5)  # measured: drafts


def test_bandit_converges_to_the_best_arm_and_credits_the_depth_that_ran():
    policy = BanditPolicy("bandit", DEPTHS)
    feat = Featurizer(DEPTHS)
    rng = np.random.default_rng(0)
    # True tokens/s per depth at bs 16: depth 2 best.
    rate = {0: 1000.0, 1: 1400.0, 2: 1800.0, 3: 1600.0, 5: 900.0}
    chosen = []
    action = 0
    for seq in range(1, 1500):
        d = DEPTHS[action]
        tokens = 16 * (1 + min(d, 2))
        step_us = int(tokens / (rate[d] * rng.uniform(0.95, 1.05)) * 1e6)
        accept = [] if d == 0 else [min(d, 2)] * 16
        s = make_step(seq, d, 16, accept, step_us=step_us)
        action = policy.act(feat.update(s), s)
        chosen.append(DEPTHS[action])
    assert chosen[-300:].count(2) > 200


def test_policies_are_deterministic_for_the_same_stream():
    rng = random.Random(1)
    steps = []
    for seq in range(1, 400):
        d = rng.choice(DEPTHS)
        bs = rng.randint(1, 80)
        steps.append(
            make_step(
                seq, d, bs, [rng.randint(0, d) for _ in range(bs)] if d else [], rng.randint(5000, 30000)
            )
        )
    for name in ("vllm-dsd", "trtllm-schedule", "sglang-adaptive", "goodput", "bandit"):
        f = make_factory(f"builtin:{name}", DEPTHS)
        assert drive(f(DEPTHS), steps) == drive(f(DEPTHS), steps), name


def test_optional_capabilities_are_declared_not_guessed(tmp_path):
    from controller.baselines import StaticPolicy
    from controller.policy import EngineBound, FusedPolicy, Policy, ServingFactory

    static = StaticPolicy(0, DEPTHS)
    assert isinstance(static, Policy)
    assert not isinstance(static, FusedPolicy | EngineBound)
    assert isinstance(OraclePolicy(DEPTHS), EngineBound)
    builtin = make_factory("builtin:goodput", DEPTHS)
    assert not isinstance(builtin, ServingFactory)
