"""The simulator's public API: SpecDecode-v0, the runner, workloads, params, deployments."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest

import env  # noqa: F401 — registers SpecDecode-v0
from controller.baselines import StaticPolicy
from controller.errors import ConfigError
from controller.features import Featurizer
from env.deployments import DEPLOYMENTS, load_deployment
from env.errors import FitError
from env.gym_env import SpecDecodeEnv
from env.params import SimParams
from env.runner import simulate
from env.workload import parse_workload

DEPTHS = (0, 1, 2, 3, 5)


def test_registered_and_passes_both_env_checkers():
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    spec = gym.spec("SpecDecode-v0")
    assert spec.max_episode_steps == 2048
    e = gym.make("SpecDecode-v0", workload="closed:16")
    check_env(e.unwrapped, skip_render_check=True)
    sb3_check_env(SpecDecodeEnv(workload="closed:16"), warn=True)
    assert e.observation_space.shape == (Featurizer(DEPTHS).obs_dim,)
    assert e.action_space.n == len(DEPTHS)


def _episode(e: SpecDecodeEnv, seed: int, n: int = 120):
    obs, _ = e.reset(seed=seed)
    out = [obs]
    rewards = []
    for i in range(n):
        obs, r, term, trunc, info = e.step(i % len(DEPTHS))
        out.append(obs)
        rewards.append(r)
    return out, rewards


def test_same_seed_same_episode():
    e = SpecDecodeEnv(workload=["closed:8", "poisson:30"], randomize=0.5, action_delay=(1, 2))
    a, ra = _episode(e, 7)
    b, rb = _episode(e, 7)
    c, _ = _episode(e, 8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and ra == rb
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_observation_is_the_featurizer_of_the_records():
    e = SpecDecodeEnv(workload="closed:24")
    obs, info = e.reset(seed=1)
    feat = Featurizer(DEPTHS)
    assert np.array_equal(obs, feat.update(info["step"]))
    for i in range(200):
        obs, _, _, _, info = e.step((i * 7) % len(DEPTHS))
        assert np.array_equal(obs, np.clip(feat.update(info["step"]), -10, 10).astype(np.float32))
        assert e.observation_space.contains(obs)


def test_reward_is_extra_tokens_over_no_speculation():
    e = SpecDecodeEnv(workload="closed:16", reward_scale=8.0)
    e.reset(seed=0)
    for _ in range(50):
        _, r, *_ = e.step(0)
        assert r == 0.0  # depth 0 is the reference
    total, extra = 0.0, 0.0
    for _ in range(200):
        _, r, _, _, info = e.step(3)
        rec = info["step"]
        eng = e.engine
        extra += rec.tokens - rec.bs * eng.last_model_us / eng.last_base_us
        total += r
    assert math.isclose(total * 8.0, extra, rel_tol=1e-9)
    assert total > 0  # speculation pays at batch 16 on the H200


def test_action_delay_applies_decisions_later():
    e = SpecDecodeEnv(workload="closed:4", action_delay=2)
    e.reset(seed=0)
    _, _, _, _, info = e.step(4)
    assert info["depth"] == 0  # the decision made from record 0 lands one step later
    _, _, _, _, info = e.step(1)
    assert info["depth"] == DEPTHS[4]
    e1 = SpecDecodeEnv(workload="closed:4", action_delay=1)
    e1.reset(seed=0)
    assert e1.step(4)[4]["depth"] == DEPTHS[4]


def test_a_warm_resume_runs_one_more_depth_0_step_first():
    """``EngineParams.warm_resume``: the loop runs the hook's own rule (``WarmResume``): a depth
    above 0 right after depth 0 runs one more step at depth 0 first, then drafts at least once
    (a one-step probe is not swallowed), and the records say so."""
    from dataclasses import replace

    from env.engine import Engine
    from env.runner import DecodeLoop

    base = load_deployment("h200-llama8b")
    cycle = [3, 3, 0, 0, 0, 5, 0, 0, 1, 0, 3, 3]  # depths asked, action delay 1
    depths = (0, 1, 3, 5)
    ran = {}
    for warm in (False, True):
        params = replace(base, engine=replace(base.engine, warm_resume=warm))
        engine = Engine(params, "closed:8")
        engine.reset(0)
        loop = DecodeLoop(engine, depths)
        recs = [loop.start()[0]] + [loop.advance(depths.index(d))[0] for d in cycle * 30]
        ran[warm] = [r.depth for r in recs]
    assert ran[False] == [0, *cycle * 30]
    first = [0, 0, 3, 0, 0, 0, 0, 5, 0, 0, 1, 3, 3]  # the start (depth 0), then the first cycle
    assert ran[True] == first + [3, 3, 0, 0, 0, 0, 5, 0, 0, 1, 3, 3] * 29


def test_a_cold_fit_replays_warm_without_its_resume_loss():
    """``env.params.warm_resumed``: a fit of cold traces carries the resume loss; for a hook that
    resumes warm the loss goes and the loop inserts the depth-0 step instead."""
    from dataclasses import replace

    from env.acceptance import AcceptanceParams, with_resume_loss
    from env.params import warm_resumed

    base = load_deployment("h200-llama8b")
    cold = replace(base, acceptance=with_resume_loss(base.acceptance))
    warm = warm_resumed(cold)
    assert warm.engine.warm_resume and not cold.engine.warm_resume
    assert warm.acceptance != cold.acceptance
    assert warm.acceptance.stale_logit == AcceptanceParams().stale_logit
    assert replace(warm.acceptance, stale_logit=0.0, stale_tau_steps=1.0, stale_recover_steps=1.0) == replace(
        cold.acceptance, stale_logit=0.0, stale_tau_steps=1.0, stale_recover_steps=1.0
    )  # nothing else moved
    assert warm_resumed(base).acceptance == base.acceptance  # no loss fitted: acceptance as it was


def test_reset_options_and_truncation():
    e = SpecDecodeEnv(deployment="seed", workload="closed:2", episode_steps=5)
    _, info = e.reset(seed=0, options={"concurrency": 64})
    assert e.engine is not None and e.engine.spec.args == (64.0,)
    for _ in range(4):
        assert not e.step(0)[3]
    assert e.step(0)[3]  # truncated at episode_steps
    e.reset(seed=0, options={"workload": "closed:3@n=3,output=5"})
    done = False
    for _ in range(100):
        _, _, term, _, _ = e.step(1)
        if term:
            done = True
            break
    assert done


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError):
        SpecDecodeEnv(depths=(1, 2))
    with pytest.raises(ConfigError):
        SpecDecodeEnv(deployment="nope")
    with pytest.raises(ConfigError):
        SpecDecodeEnv(action_delay=0)
    e = SpecDecodeEnv()
    e.reset(seed=0)
    with pytest.raises(ConfigError):
        e.step(99)


# ----------------------------------------------------------------------------- runner


def test_simulate_static_policies_and_bind_engine():
    params = load_deployment("h200-llama8b")
    bound = []

    class Oracle:
        name = "oracle"

        def reset(self) -> None:
            pass

        def bind_engine(self, engine) -> None:
            bound.append(engine)

        def act(self, obs, step) -> int:
            rates = [bound[0].expected_rate(d) for d in DEPTHS]
            return int(np.argmax(rates))

    r0 = simulate(params, "closed:8", StaticPolicy(0, DEPTHS), depths=DEPTHS, seed=0, duration_s=5)
    r3 = simulate(params, "closed:8", StaticPolicy(3, DEPTHS), depths=DEPTHS, seed=0, duration_s=5)
    ro = simulate(params, "closed:8", Oracle(), depths=DEPTHS, seed=0, duration_s=5)
    assert bound and r0.depth_hist == {0: r0.steps}
    assert set(r3.depth_hist) == {0, 3} and r3.depth_hist[0] == 1  # only the step before the first decision
    assert r3.throughput_tok_s > r0.throughput_tok_s > 0
    assert ro.throughput_tok_s >= 0.97 * r3.throughput_tok_s
    assert r0.tpot_ms_mean > r3.tpot_ms_mean > 0
    assert len(r0.trace_time_s) == r0.steps == len(r0.trace_bs)
    assert math.isclose(r0.throughput_tok_s, r0.tokens / r0.duration_s)


def test_simulate_needs_a_stop_condition_and_valid_actions():
    params = load_deployment("seed")
    with pytest.raises(ConfigError):
        simulate(params, "poisson:5", StaticPolicy(0, DEPTHS), depths=DEPTHS)

    class Bad:
        name = "bad"

        def reset(self) -> None:
            pass

        def act(self, obs, step) -> int:
            return 7

    with pytest.raises(ConfigError):
        simulate(params, "closed:2", Bad(), depths=DEPTHS, duration_s=1)


@pytest.mark.slow
def test_seed_deployment_reproduces_the_published_figures():
    """reference/seed_benchmark.md, each figure within 10% (long runs: 300 simulated s)."""
    params = load_deployment("seed")

    def tput(wl: str, depth: int) -> float:
        return simulate(
            params, wl, StaticPolicy(depth, DEPTHS), depths=DEPTHS, seed=0, duration_s=300
        ).throughput_tok_s

    figures = {
        ("preset:single_stream", 0): 92.6,
        ("preset:single_stream", 3): 96.1,
        ("closed:1", 0): 92.6,
        ("closed:1", 3): 77.5,
        ("closed:64", 0): 773.0,
        ("closed:64", 3): 354.0,
    }
    for (wl, depth), reported in figures.items():
        got = tput(wl, depth)
        assert abs(got / reported - 1.0) <= 0.10, (wl, depth, got, reported)
    for c in (2, 8, 30, 250):
        assert tput(f"closed:{c}", 3) < tput(f"closed:{c}", 0)


# ----------------------------------------------------------------------------- workloads, params


@pytest.mark.parametrize(
    "spec",
    ["closed:4", "poisson:2.5", "burst:1,20,10", "burst:1,20,10,0.5", "ramp:1,50,30", "phase:20:closed:8",
     "closed:1@prompt=64,output=9,accept_shift=1.5,n=3", "closed:2@output=64~0.7,n=4"],
)  # fmt: skip
def test_workload_specs_parse_and_run(spec):
    w = parse_workload(spec)
    assert w.text == spec
    r = simulate(load_deployment("seed"), spec, StaticPolicy(1, DEPTHS), depths=DEPTHS, duration_s=3)
    assert r.steps > 0


@pytest.mark.parametrize(
    "spec", ["closed:0", "closed:2.5", "poisson", "poisson:-1", "burst:1,2", "ramp:1,2,0", "zipf:3", "closed:2@foo=1",
             "closed:2@prompt=-3", "phase:x:closed:2", "preset:none", "replay:", "closed:2@output=64~-1",
             "closed:2@output=0~0.5", "closed:2@output=64~x"],
)  # fmt: skip
def test_bad_workload_specs(spec):
    with pytest.raises(ConfigError):
        parse_workload(spec)


def test_phase_workload_shifts_acceptance():
    from env.workload import Arrivals

    w = parse_workload("phase:10:poisson:5")
    arr = Arrivals(w, load_deployment("seed").workload, 0.8, np.random.default_rng(0))
    assert arr.shift_at(1_000_000) == 0.0 and arr.shift_at(6_000_000) == 0.8


def test_replay_csv(tmp_path):
    path = tmp_path / "arrivals.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,20\n0.5,200,30\n0.7,50,10\n")
    r = simulate(load_deployment("seed"), f"replay:{path}", StaticPolicy(0, DEPTHS), depths=DEPTHS)
    assert r.n_requests == 3 and r.tokens == 60
    bad = tmp_path / "bad.csv"
    bad.write_text("when,prompt\n1,2\n")
    with pytest.raises(ConfigError, match="bad.csv"):
        simulate(load_deployment("seed"), f"replay:{bad}", StaticPolicy(0, DEPTHS), depths=DEPTHS)


def _depth_3_steps_per_part(tmp_path, header: str, row: str, workload: str) -> dict[int, int]:
    """Steps at depth 3 to serve four 400-token requests, a CSV of ``header`` and four ``row``s
    (formatted with ``zero``), under ``workload`` (formatted with ``path``), for each
    ``zero_accept`` value: 1 the fitted acceptance's zero part, 0 the other."""
    steps = {}
    for zero in (0, 1):
        f = tmp_path / f"zero{zero}.csv"
        f.write_text(header + "\n" + (row.format(zero=zero) + "\n") * 4)
        run = simulate(load_deployment("seed"), workload.format(path=f), StaticPolicy(3, DEPTHS), depths=DEPTHS)
        assert run.tokens == 1600
        steps[zero] = run.steps
    return steps


def test_replay_csv_sets_each_requests_acceptance_part(tmp_path):
    """``replay:PATH`` takes ``zero_accept`` as ``requests=`` does: at depth 3, arrivals in the
    fitted acceptance's zero part (1) take about a step per token, the same arrivals in the
    other part (0) far fewer; blank is drawn; any other value names the row."""
    from env.workload import Arrivals

    steps = _depth_3_steps_per_part(
        tmp_path, "arrival_s,prompt_tokens,output_tokens,zero_accept", "0.0,128,400,{zero}", "replay:{path}"
    )
    assert steps[1] > 0.9 * 400 and steps[0] < 0.7 * steps[1]  # four at once: 400 tokens each
    blank = tmp_path / "blank.csv"
    blank.write_text("arrival_s,prompt_tokens,output_tokens,zero_accept\n0.0,100,20,\n0.5,100,20,1\n0.7,100,20,0\n")
    wp = load_deployment("seed").workload
    arr = Arrivals(parse_workload(f"replay:{blank}"), wp, 0.8, np.random.default_rng(0))
    assert [arr.pop()[4] for _ in range(3)] == [None, True, False]
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,zero_accept\n0.0,100,0\n0.5,100,2\n")
    with pytest.raises(ConfigError, match="bad.csv: row 2"):
        simulate(load_deployment("seed"), f"replay:{bad}", StaticPolicy(0, DEPTHS), depths=DEPTHS)


def test_closed_loop_sends_the_requests_of_a_file_in_order(tmp_path):
    """``requests=PATH``: each request's lengths from its row, in the order sent; ``zero_accept``
    puts it in the fitted acceptance's zero part (1) or the other (0); the loop stops after the
    last row (no ``n=`` needed). A benchmark's own requests replayed (realgpu_sim.py)."""
    from env.workload import Arrivals

    path = tmp_path / "requests.csv"
    path.write_text("prompt_tokens,output_tokens\n100,20\n300,40\n50,10\n")
    wp = load_deployment("seed").workload
    arr = Arrivals(parse_workload(f"closed:2@requests={path}"), wp, 0.8, np.random.default_rng(0))
    first = [arr.pop()[1:3] for _ in range(2)]  # the two clients' first requests
    arr.on_complete(5)
    assert first + [arr.pop()[1:3]] == [(100, 20), (300, 40), (50, 10)]
    arr.on_complete(6)
    assert arr.peek() is None  # the file is exhausted
    r = simulate(load_deployment("seed"), f"closed:2@requests={path}", StaticPolicy(0, DEPTHS), depths=DEPTHS)
    assert r.n_requests == 3 and r.tokens == 70

    # The acceptance part: at depth 3, requests the drafter cannot help take about a step per
    # token; the same requests in the other part take far fewer.
    steps = _depth_3_steps_per_part(
        tmp_path, "prompt_tokens,output_tokens,zero_accept", "128,400,{zero}", "closed:1@requests={path}"
    )
    assert steps[1] > 0.9 * 1600 and steps[0] < 0.7 * steps[1]
    blank = tmp_path / "blank.csv"  # a blank acceptance part is drawn, as without the column
    blank.write_text("prompt_tokens,output_tokens,zero_accept\n100,20,\n100,20,1\n")
    arr = Arrivals(parse_workload(f"closed:2@requests={blank}"), wp, 0.8, np.random.default_rng(0))
    assert [arr.pop()[4] for _ in range(2)] == [None, True]

    for text, match in [("when,prompt\n1,2\n", "missing column"), ("prompt_tokens,output_tokens\n", "no rows"),
                        ("prompt_tokens,output_tokens,zero_accept\n10,5,2\n", "row 1"),
                        ("prompt_tokens,output_tokens\n10,x\n", "row 1")]:  # fmt: skip
        bad = tmp_path / "bad.csv"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            simulate(load_deployment("seed"), f"closed:1@requests={bad}", StaticPolicy(0, DEPTHS), depths=DEPTHS)
    with pytest.raises(ConfigError):
        parse_workload("closed:1@requests=")


def test_params_json_roundtrip_and_perturb(tmp_path):
    for name in DEPLOYMENTS:
        p = load_deployment(name)
        path = tmp_path / f"{name}.json"
        p.to_json(path)
        assert SimParams.from_json(path) == p
        assert p.perturb(np.random.default_rng(0), 0.0) is p
        q = p.perturb(np.random.default_rng(0), 1.0)
        assert q != p and q.latency.w_us > 0
        assert q == p.perturb(np.random.default_rng(0), 1.0)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(FitError, match="x.json"):
        SimParams.from_json(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"format": 1, "latency": {}}')
    with pytest.raises(FitError, match="y.json"):
        SimParams.from_json(tmp_path / "y.json")
