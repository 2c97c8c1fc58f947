"""Tiny-budget smoke runs of ``controller train`` and ``controller eval``; reproducibility."""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from agents.cli import register  # noqa: F401  (the CLI module must import without heavy deps)
from agents.evaluate import EvalConfig, ci95, evaluate
from agents.train import TrainConfig, train, workload_pool
from controller.cli import main
from controller.errors import ConfigError
from controller.ppo_policy import load_ppo_factory

TINY = TrainConfig(
    deployment="seed",
    timesteps=512,
    n_envs=2,
    n_steps=128,
    batch_size=128,
    n_epochs=2,
    episode_steps=150,
    n_workloads=12,
    bc_rounds=1,
    bc_states=600,
    bc_epochs=2,
    progress=False,
)


def _weights(path: Path) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(path) as zf:
        sd = torch.load(io.BytesIO(zf.read("policy.pth")), weights_only=True)
    return {k: v.numpy() for k, v in sd.items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train") / "ppo.zip"
    train(replace(TINY, out=out), log=lambda *_: None)
    return out


@pytest.mark.slow
def test_train_writes_a_servable_zip_and_its_sim(trained):
    folder = trained.parent
    for name in ("sim.json", "train_config.json", "train_report.md"):
        assert (folder / name).is_file(), name
    assert any((folder / "tb").rglob("events.out.tfevents*")), "TensorBoard logs"
    factory = load_ppo_factory(trained, (0, 1, 2, 3, 5))
    assert factory.meta.extra["sim"] == "seed"
    cfg = json.loads((folder / "train_config.json").read_text())
    assert cfg["timesteps"] == 512 and cfg["seed"] == 0
    assert "Warm start" in (folder / "train_report.md").read_text()


@pytest.mark.slow
def test_training_is_reproducible_for_a_seed(trained, tmp_path):
    again = tmp_path / "again" / "ppo.zip"
    train(replace(TINY, out=again), log=lambda *_: None)
    a, b = _weights(trained), _weights(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    other = tmp_path / "other" / "ppo.zip"
    train(replace(TINY, out=other, seed=1), log=lambda *_: None)
    c = _weights(other)
    assert any(not np.array_equal(a[k], c[k]) for k in a), "another seed should train another policy"


def _selection_rows(report: str) -> list[tuple[int, float, bool]]:
    """(timesteps, mean return, kept) from a train report's Selection table."""
    table = report[report.index("## Selection") :].split("\n\n")[1]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((int(cells[0].split()[0]), float(cells[1]), cells[2] == "**yes**"))
    return rows


@pytest.mark.slow
def test_the_zip_holds_the_best_scored_weights_and_the_warm_start_wins_ties(tmp_path):
    """Train twice on one seed, with and without selection (validation never touches the
    training's random numbers, so both runs train the same weights). The selected zip holds
    the warm start's weights where it scored best (ties included: a checkpoint must beat it),
    else the fine-tuned ones; unselected, the fine-tuned ones."""
    run = replace(TINY, learning_rate=1.0, clip_range=10.0, n_epochs=10, timesteps=1024)
    kept, final = tmp_path / "kept" / "ppo.zip", tmp_path / "final" / "ppo.zip"
    train(replace(run, out=kept), log=lambda *_: None)
    train(replace(run, out=final, select_every=0), log=lambda *_: None)
    assert "## Selection" not in (final.parent / "train_report.md").read_text()
    rows = _selection_rows((kept.parent / "train_report.md").read_text())
    assert [t for t, _, _ in rows] == [0, 1024], "scored before PPO and at the end"
    best = max(r for _, r, _ in rows)
    winner = next(i for i, (_, r, _) in enumerate(rows) if r == best)
    assert [k for _, _, k in rows] == [i == winner for i in range(len(rows))]
    w, ws, f = _weights(kept), _weights(kept.with_name("warmstart.zip")), _weights(final)
    assert any(not np.array_equal(f[k], ws[k]) for k in ws), "the fine-tuning changed the weights"
    expected = ws if winner == 0 else f
    for k in expected:
        np.testing.assert_array_equal(w[k], expected[k], err_msg=k)
    assert load_ppo_factory(kept, (0, 1, 2, 3, 5)).meta.extra["selected_timesteps"] == rows[winner][0]


@pytest.mark.slow
def test_validation_select_restores_the_better_of_two_policies():
    """Two policies that act differently (always depth 0, then always depth 5, forced through the
    action head's bias): the callback scores both on the same episodes and keeps the one that
    scored higher, whichever it is."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.vec_env import DummyVecEnv

    from agents.train import capacity_req_s, fit_model_table, fitted_params, make_env, validation_select

    cfg = TINY
    params, _ = fitted_params(cfg)
    pool = workload_pool(np.random.default_rng(0), capacity_req_s(params, cfg.depths), cfg.n_workloads)
    table = fit_model_table(params, cfg.depths)

    def vec(n: int) -> DummyVecEnv:
        return DummyVecEnv([lambda: make_env(params, pool, cfg, table) for _ in range(n)])

    def force(model, action: int) -> None:
        with torch.no_grad():
            bias = model.policy.action_net.bias
            bias.zero_()
            bias[action] = 100.0

    class ForceDepth5(BaseCallback):
        def _on_rollout_end(self) -> None:
            force(self.model, len(cfg.depths) - 1)

        def _on_step(self) -> bool:
            return True

    model = PPO("MlpPolicy", vec(2), n_steps=64, batch_size=64, n_epochs=1, learning_rate=0.0, seed=0, device="cpu")
    force(model, 0)
    select = validation_select(vec(2), 4, 10**6, seed=11)
    model.learn(total_timesteps=128, callback=CallbackList([ForceDepth5(), select]))
    (t0, first), (t1, last) = select.scores
    assert (t0, t1) == (0, 128) and first != last, select.scores
    assert select.best_timesteps == (0 if first > last else 128)
    model.policy.load_state_dict(select.best_state)
    obs = vec(1).reset()
    assert int(model.predict(obs, deterministic=True)[0][0]) == (0 if first > last else len(cfg.depths) - 1)


def test_workload_pool_covers_every_regime():
    pool = workload_pool(np.random.default_rng(0), capacity=10.0, n=400)
    kinds = {w.split(":")[0] for w in pool}
    assert kinds == {"closed", "poisson", "ramp", "burst", "phase", "wave"}
    assert any("odd_shift=" in w for w in pool), "drafter-quality alternation"
    assert any("long=" in w for w in pool) and any("mix=" in w for w in pool)
    cs = [int(w.split(":")[1].split("@")[0]) for w in pool if w.startswith("closed:")]
    assert min(cs) == 1 and max(cs) >= 200
    assert pool == workload_pool(np.random.default_rng(0), capacity=10.0, n=400)


@pytest.mark.slow
def test_the_fitted_model_features_are_served_as_trained(trained):
    """The zip carries the fit's latency table; SB3 (on the training env's observations), the
    policy's two-call path and the fused kernel controller serve runs pick the same depths."""
    from stable_baselines3 import PPO

    from agents.train import ModelFeatures, fit_model_table
    from controller.features import Featurizer
    from env.deployments import load_deployment
    from env.gym_env import SpecDecodeEnv

    depths = (0, 1, 2, 3, 5)
    factory = load_ppo_factory(trained, depths)
    table = fit_model_table(load_deployment("seed"), depths)
    assert factory.meta.model_table is not None
    np.testing.assert_allclose(np.asarray(factory.meta.model_table), table)
    factory.prepare_serving()
    policy = factory(depths)
    sb3 = PPO.load(trained, device="cpu")
    env = ModelFeatures(
        SpecDecodeEnv(deployment="seed", workload="phase:2:closed:12@accept_shift=-2,odd_shift=4"), table
    )
    env.reset(seed=3)
    two_call, fused = Featurizer(depths), Featurizer(depths)
    rng = np.random.default_rng(0)
    for _ in range(400):
        obs, *_, info = env.step(int(rng.integers(len(depths))))
        step = info["step"]
        a = policy.act(two_call.update(step), step)
        assert a == int(sb3.predict(obs, deterministic=True)[0])
        if policy.fused is not None:
            assert fused.update_with(step, policy.fused) == a


def test_policy_zips_that_share_a_file_name_get_distinct_names():
    from agents.evaluate import zip_policy_names

    assert zip_policy_names(["a/ppo.zip", "b/ppo.zip", "b/warmstart.zip"]) == ["ppo", "ppo:b/ppo", "ppo:warmstart"]
    assert zip_policy_names([]) == []
    with pytest.raises(ConfigError, match="distinct names"):
        zip_policy_names(["a/x/ppo.zip", "b/x/ppo.zip", "c/x/ppo.zip"])


def test_ci95():
    m, lo, hi = ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m == 3.0 and lo < 3.0 < hi
    assert abs((hi - lo) / 2 - 2.776 * np.std([1, 2, 3, 4, 5], ddof=1) / np.sqrt(5)) < 1e-3
    assert ci95([2.0]) == (2.0, 2.0, 2.0)


@pytest.mark.slow
def test_eval_writes_report_results_and_plots_and_is_reproducible(trained, tmp_path):
    cfg = EvalConfig(
        deployment="seed",
        policies=(str(trained),),
        baselines="static:0,static:3,sglang-adaptive,goodput,oracle",
        out=tmp_path / "e1",
        seeds=2,
        scale=0.05,
        concurrency=(1, 16),
    )
    report = evaluate(cfg)
    text = report.read_text()
    assert "## Targets" in text and "Closed loop" in text
    res = json.loads((tmp_path / "e1" / "results.json").read_text())
    assert res["schema"] == 1 and res["seeds"] == [0, 1]
    fams = {w["family"] for w in res["workloads"].values()}
    assert fams == {"closed", "poisson", "nonstationary"}
    for w in res["workloads"].values():
        assert set(w["policies"]) == {"static:0", "static:3", "sglang-adaptive", "goodput", "oracle", "ppo"}
        for stats in w["policies"].values():
            s = stats["throughput_tok_s"]
            assert len(s["values"]) == 2 and s["ci95"][0] <= s["mean"] <= s["ci95"][1]
    assert {t["name"].split(":")[0] for t in res["targets"]} >= {
        "closed loop",
        "PPO / oracle, worst workload",
    }
    for png in ("throughput_vs_concurrency.png", "tpot_vs_load.png", "depth_vs_batch_over_time.png"):
        assert (tmp_path / "e1" / png).stat().st_size > 10_000, png
    # Same config, same numbers.
    evaluate(replace(cfg, out=tmp_path / "e2"))
    res2 = json.loads((tmp_path / "e2" / "results.json").read_text())
    for spec, w in res["workloads"].items():
        for p, stats in w["policies"].items():
            assert (
                stats["throughput_tok_s"]["values"]
                == res2["workloads"][spec]["policies"][p]["throughput_tok_s"]["values"]
            )


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["eval", "--sim", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.json" in err
    assert main(["train", "--deployment", "seed", "--out", str(tmp_path / "p.txt")]) == 2
    assert "must name a .zip" in capsys.readouterr().err
    assert main(["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), "--probe-staleness", "1"]) == 2
    assert "--probe-staleness must be in [0, 1)" in capsys.readouterr().err
    assert main(["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), "--probe-gate", "1.5"]) == 2
    assert "--probe-gate must be in [0, 1), got 1.5" in capsys.readouterr().err
    assert main(["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), "--off-draft", "kv"]) == 2
    assert "--off-draft describes the traced server: it needs --traces" in capsys.readouterr().err
    assert main(["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), "--select-every", "-1"]) == 2
    assert "--select-every must be >= 0" in capsys.readouterr().err
    assert main(["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), "--learning-rate", "0"]) == 2
    assert "--learning-rate must be finite and > 0" in capsys.readouterr().err
    assert not (tmp_path / "p.zip").exists()
    assert (
        main(["eval", "--deployment", "seed", "--out", str(tmp_path / "o"), "--policy", "builtin:nope"]) == 2
    )
    assert "unknown builtin" in capsys.readouterr().err


@pytest.mark.slow
def test_train_from_traces_fits_the_simulator_first(tmp_path):
    traces = Path(__file__).resolve().parents[1] / "env" / "example_traces" / "seed"
    out = tmp_path / "fit" / "ppo.zip"
    train(
        replace(TINY, out=out, deployment=None, traces=traces, timesteps=256, bc_states=300),
        log=lambda *_: None,
    )
    assert (out.parent / "fit_report.txt").read_text().startswith("fit report")
    assert json.loads((out.parent / "sim.json").read_text())["name"] == "fitted"
    load_ppo_factory(out, (0, 1, 2, 3, 5))


def test_drafter_mix_draws_drafters_across_the_quality_range():
    from env.gym_env import DRAFTER_ALPHA_RANGE, DRAFTER_SIGMA_RANGE, SpecDecodeEnv

    fitted = SpecDecodeEnv(deployment="h200-llama8b").base_params.acceptance
    env = SpecDecodeEnv(deployment="h200-llama8b", drafter_mix=1.0, episode_steps=4)
    alphas, sigmas = [], []
    for seed in range(40):
        env.reset(seed=seed)
        assert env.engine is not None
        ap = env.engine.params.acceptance
        alphas.append(ap.alpha)
        sigmas.append(ap.sigma)
    assert DRAFTER_ALPHA_RANGE[0] <= min(alphas) and max(alphas) <= DRAFTER_ALPHA_RANGE[1]
    assert DRAFTER_SIGMA_RANGE[0] <= min(sigmas) and max(sigmas) <= DRAFTER_SIGMA_RANGE[1]
    # Both a near-useless and a near-perfect drafter show up, and the draw is the seed's.
    assert min(alphas) < -3.0 and max(alphas) > 2.5
    env.reset(seed=7)
    again = env.engine.params.acceptance.alpha  # type: ignore[union-attr]
    assert again == alphas[7]
    off = SpecDecodeEnv(deployment="h200-llama8b", episode_steps=4)
    off.reset(seed=3)
    assert off.engine is not None and off.engine.params.acceptance == fitted
    with pytest.raises(Exception, match="drafter_mix"):
        SpecDecodeEnv(deployment="h200-llama8b", drafter_mix=1.5)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--seeds", "0"], "--seeds"),
        (["--scale", "-1"], "--scale"),
        (["--jobs", "0"], "--jobs"),
    ],
)
def test_eval_refuses_bad_arguments_before_it_runs_anything(tmp_path, capsys, flags, needle):
    out = tmp_path / "never"
    rc = main(["eval", "--deployment", "seed", "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("controller eval: error:") and needle in err, (
        err
    )
    assert "eval:" not in err.split("error:", 1)[1] and not out.exists()  # no progress bar, no output


def test_the_realistic_experts_probe_drafts_after_a_stretch_at_depth_0_and_ends_on_a_bad_drafter():
    from agents.train import ProbeRule
    from controller.features import Featurizer

    cfg = replace(TINY, bc_probe_staleness=0.9, bc_probe_cost_steps=0.0, bc_probe_depth=2, bc_probe_keep=0.85)
    rule = ProbeRule.for_config(cfg)
    assert rule is not None and rule.action == cfg.depths.index(2)
    names = Featurizer(cfg.depths).feature_names
    obs = np.zeros(len(names) + 2 * len(cfg.depths), dtype=np.float32)
    at_zero = np.array([1.0, 0.7, 0.9, 0.8, 0.6])  # depth 0 is the model's best
    assert not rule.probes(obs, at_zero)  # drafted recently: no probe
    obs[names.index("spec_staleness")] = 0.95
    assert rule.probes(obs, at_zero)
    labels = rule.labels(obs, at_zero)
    assert labels[rule.action] - np.delete(labels, rule.action).max() > 0.02
    assert not rule.probes(obs, np.array([0.9, 1.0, 0.8, 0.7, 0.6]))  # drafting already wins: no probe needed
    # Just probed at depth 2: continue while the accepted fraction rises and depth 2 is close.
    obs[names.index("spec_staleness")] = 0.0
    obs[names.index("depth=2")] = 1.0
    obs[names.index("accept_trend")] = 0.05
    assert rule.probes(obs, at_zero)
    obs[names.index("accept_trend")] = -0.05  # a bad drafter: the trend turns down, the probe ends
    assert not rule.probes(obs, at_zero)
    obs[names.index("accept_trend")] = 0.05
    assert not rule.probes(obs, np.array([1.0, 0.7, 0.8, 0.8, 0.6]))  # depth 2 far below depth 0
    # The gate: no probe where no drafting depth could pay for a good drafter on the model's
    # step times (log ratios, the 2n-th to n-th last entries), however stale the estimate.
    n = len(cfg.depths)
    obs[names.index("depth=2")] = 0.0
    obs[names.index("spec_staleness")] = 0.95
    lat = slice(len(obs) - 2 * n + 1, len(obs) - n)
    obs[lat] = 1.2  # depths 1-3 cost 3.3× a plain step: 0.8 per position gives at most 2.95 tokens
    obs[len(obs) - 2 * n + cfg.depths.index(5)] = 2.0
    assert rule.gate_logs and not rule.probes(obs, at_zero)
    obs[len(obs) - 2 * n + 1] = 0.5  # depth 1 at 1.65× a plain step: 1.8 tokens would pay
    assert rule.probes(obs, at_zero)
    ungated = ProbeRule.for_config(replace(cfg, bc_probe_gate=0.0))
    assert ungated is not None and not ungated.gate_logs
    obs[lat] = 2.0
    assert ungated.probes(obs, at_zero) and not rule.probes(obs, at_zero)
    assert ProbeRule.for_config(replace(cfg, bc_probe_staleness=0.0)) is None
    with pytest.raises(ConfigError, match="bc_probe_depth 4"):
        ProbeRule.for_config(replace(cfg, bc_probe_depth=4))


def test_a_costlier_probe_waits_longer_at_depth_0():
    """``bc_probe_cost_steps``: the probe waits ``cost_steps`` × the share of depth 0's goodput
    it gives up, on top of ``bc_probe_staleness`` (spec_staleness is 1 − exp(−steps / 50))."""
    from agents.train import ProbeRule
    from controller.features import Featurizer

    cfg = replace(TINY, bc_probe_staleness=0.5, bc_probe_cost_steps=400.0)
    rule = ProbeRule.for_config(cfg)
    assert rule is not None
    stale = Featurizer(cfg.depths).feature_names.index("spec_staleness")
    obs = np.zeros(rule.onehot_idx + 1 + 2 * len(cfg.depths) + 64, dtype=np.float32)

    def first_probe_step(rel: np.ndarray) -> int:
        for n in range(1, 2000):
            obs[stale] = 1.0 - np.exp(-n / 50.0)
            if rule.probes(obs, rel):
                return n
        raise AssertionError("never probes")

    cheap = np.array([1.0, 0.99, 0.99, 0.9, 0.8])  # a probe at depth 2 gives up 1%
    dear = np.array([1.0, 0.8, 0.75, 0.7, 0.6])  # 25%
    assert abs(first_probe_step(cheap) - (35 + 4)) <= 1  # 50·ln 2 ≈ 34.7 steps, + 400 × 0.01
    assert abs(first_probe_step(dear) - (35 + 100)) <= 1
    fixed = ProbeRule.for_config(replace(cfg, bc_probe_cost_steps=0.0))
    assert fixed is not None and fixed.threshold(cheap) == fixed.threshold(dear) == 0.5


def test_train_takes_the_servers_decision_delay(tmp_path):
    """``controller train --delay`` sets the range of action delays the episodes draw from (the
    H100 testbed's hook ran each decision three steps after its record); bad ranges are refused."""
    from agents.train import TrainConfig
    from controller.cli import build_parser

    def config(*delay: str) -> TrainConfig:
        argv = ["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), *delay]
        return TrainConfig.from_args(build_parser().parse_args(argv), None)

    assert config().delay == (1, 2)
    for text, want in (("3", (3, 3)), ("1,3", (1, 3))):
        assert config("--delay", text).delay == want
    for bad in ("0", "3,1", "1,2,3", "x", "9"):
        with pytest.raises(ConfigError, match="--delay"):
            config("--delay", bad)


def test_train_on_featurizer_version_7_writes_a_zip_served_with_it(tmp_path):
    """``controller train --featurizer-version 7``: the episodes' observations, the zip's
    metadata and the Featurizer that serves it are version 7's (the first drafted step after
    depth 0 is no evidence), and versions this controller cannot serve are refused."""
    from controller.cli import build_parser
    from controller.features import FEATURIZER_VERSION, featurizer_for
    from controller.protocol import Step
    from env.gym_env import SpecDecodeEnv

    def config(*flag: str) -> TrainConfig:
        argv = ["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), *flag]
        return TrainConfig.from_args(build_parser().parse_args(argv), None)

    assert config().featurizer_version == FEATURIZER_VERSION
    cfg = config("--featurizer-version", "7")
    assert cfg.featurizer_version == 7
    for bad in ("6", "1"):
        with pytest.raises(ConfigError, match="--featurizer-version"):
            config("--featurizer-version", bad)
    assert SpecDecodeEnv(deployment="seed", featurizer_version=7).featurizer.version == 7
    out = tmp_path / "v7" / "ppo.zip"
    train(replace(TINY, out=out, featurizer_version=7, timesteps=256, bc_states=300), log=lambda *_: None)
    factory = load_ppo_factory(out, (0, 1, 2, 3, 5))
    assert factory.meta.featurizer_version == 7
    feat = featurizer_for(factory(factory.meta.depths), factory.meta.depths)
    assert feat.version == 7

    # Served: a resume's zeros leave the acceptance estimate where depth 0 left it (aged one
    # step more; version 5 would read four failed requests).
    def rec(seq: int, depth: int, accept: list[int]) -> Step:
        return Step(
            instance="t", seq=seq, depth=depth, bs=4, waiting=0, accept=accept, step_us=9000,
            ctx_tokens=2048, kv_usage=0.1, prefill_tokens=0, ts_ns=seq * 10**7,
        )  # fmt: skip

    feat.update(rec(0, 3, [3, 3, 3, 3]))
    feat.update(rec(1, 0, []))
    p = feat.accept_prob(1)
    feat.update(rec(2, 3, [0, 0, 0, 0]))
    assert feat.accept_prob(1) > p - 0.01


@pytest.mark.parametrize("name", ["h200-llama8b", "h200-llama8b-longctx"])
def test_the_capacity_probe_reads_the_steady_state_not_the_fill(name):
    """The open-loop loads are sized by ``capacity_req_s``. A fixed 20 s probe measured the fill
    (every slot's prompt prefilled at once) and read the long-context deployment at 0.01
    requests/s once a prompt's attention was priced. The probe's rate agrees with the rate a run
    twice as long keeps over its second half, at depth 0 with every slot busy."""
    from agents.evaluate import _build_policy, capacity_req_s
    from env.deployments import load_deployment
    from env.runner import simulate

    params = load_deployment(name)
    depths = (0, 1, 2, 3, 5)
    cap = capacity_req_s(params, depths)
    c = params.engine.max_running_requests
    res = simulate(params, f"closed:{c}@n={6 * c}", _build_policy("static:0", depths, params), depths=depths,
                   seed=1, n_requests=6 * c)  # fmt: skip
    done = sorted(r.finish_us for r in res.completed)
    half = len(done) // 2
    steady = (len(done) - 1 - half) / ((done[-1] - done[half]) / 1e6)
    assert cap == pytest.approx(steady, rel=0.15)
    # the fill alone: what the first 20 s completed, far below it for long prompts
    early = sum(1 for t in done if t <= 20e6) / 20.0
    if name.endswith("longctx"):
        assert early < 0.5 * cap
