"""``--objective``: throughput (default) or goodput under a TPOT target, from train to eval to serve."""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agents.evaluate import (
    EvalConfig,
    Workload,
    _Job,
    collect_workloads,
    resolve_objective,
    run_job,
    slo_goodput_tok_s,
)
from agents.train import RegretReward, TrainConfig, on_target_tokens
from controller.cli import main
from controller.errors import ConfigError, PolicyLoadError
from controller.objective import Objective, parse_objective
from controller.ppo_policy import META_NAME, PPOMeta, load_ppo_factory, read_ppo_zip, write_metadata
from env.deployments import load_deployment
from env.engine import RequestStats

BUNDLED_SEED = Path(__file__).resolve().parents[1] / "agents" / "bundled" / "seed" / "ppo.zip"


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "tpot_ms", "canonical"),
    [
        (None, None, "throughput"),
        ("throughput", None, "throughput"),
        ("slo:50", 50.0, "slo:50"),
        ("slo:12.5", 12.5, "slo:12.5"),
        (" slo:40.0 ", 40.0, "slo:40"),
    ],
)
def test_parse_objective_accepts_throughput_and_slo(text, tpot_ms, canonical):
    obj = parse_objective(text)
    assert obj.tpot_ms == tpot_ms
    assert str(obj) == canonical
    assert parse_objective(str(obj)) == obj  # the canonical spelling round-trips


@pytest.mark.parametrize(
    "text", ["", "goodput", "slo", "slo:", "slo:abc", "slo:0", "slo:-5", "slo:inf", "slo:nan", "SLO:50", "tpot:50"]
)
def test_a_malformed_objective_says_what_is_accepted(text):
    with pytest.raises(ConfigError, match=r"'throughput' or 'slo:TPOT_MS'.*e\.g\. slo:50"):
        parse_objective(text)


def test_meets_is_the_tpot_target():
    assert Objective().meets(1e9)
    slo = parse_objective("slo:20")
    assert slo.meets(20.0) and slo.meets(0.0) and not slo.meets(20.01)


# --------------------------------------------------------------------------- the zip


def _meta(objective: str = "throughput") -> PPOMeta:
    return PPOMeta(
        depths=(0, 1), featurizer_version=2, obs_dim=3, feature_names=("a", "b", "c"), net_arch=(4,),
        objective=objective,
    )  # fmt: skip


def test_metadata_round_trips_the_objective_and_older_zips_mean_throughput():
    assert PPOMeta.from_json(_meta("slo:35").to_json()).objective == "slo:35"
    raw = json.loads(_meta().to_json())
    del raw["objective"]
    assert PPOMeta.from_json(json.dumps(raw)).objective == "throughput"
    raw["objective"] = "slo:-1"
    with pytest.raises(PolicyLoadError, match="objective"):
        PPOMeta.from_json(json.dumps(raw))


def _with_objective(tmp_path: Path, objective: str) -> Path:
    """The bundled seed policy, re-labelled with ``objective`` (the weights are what they are)."""
    out = tmp_path / f"{objective.replace(':', '_')}.zip"
    shutil.copy(BUNDLED_SEED, out)
    meta, _ = read_ppo_zip(out)
    write_metadata(out, replace(meta, objective=objective))
    return out


def test_objective_round_trips_through_a_zip(tmp_path):
    path = _with_objective(tmp_path, "slo:45")
    with zipfile.ZipFile(path) as zf:
        assert json.loads(zf.read(META_NAME))["objective"] == "slo:45"
    assert read_ppo_zip(path)[0].objective == "slo:45"
    assert load_ppo_factory(path).objective == "slo:45"
    assert load_ppo_factory(BUNDLED_SEED).objective == "throughput"


def test_eval_takes_the_zips_objective_unless_told(tmp_path):
    slo = str(_with_objective(tmp_path, "slo:45"))
    cfg = EvalConfig(deployment="seed", policies=(slo,), out=tmp_path)
    assert resolve_objective(cfg, [slo]) == "slo:45"
    assert resolve_objective(cfg, []) == "throughput"
    with pytest.warns(UserWarning, match="trained for objective slo:45, scored by throughput"):
        assert resolve_objective(replace(cfg, objective="throughput"), [slo]) == "throughput"
    with pytest.raises(ConfigError, match="slo:TPOT_MS"):
        EvalConfig(deployment="seed", out=tmp_path, objective="slo:fast")


# --------------------------------------------------------------------------- eval scoring


def _req(rid: int, first_us: int, finish_us: int, out: int) -> RequestStats:
    return RequestStats(rid, 0, first_us, finish_us, 10, out)


def test_slo_goodput_counts_only_the_requests_on_target():
    # A: 101 tokens at 10 ms/token, B: 51 tokens at 40 ms/token, C: one token (no TPOT).
    reqs = [_req(0, 0, 1_000_000, 101), _req(1, 0, 2_000_000, 51), _req(2, 0, 0, 1)]
    assert [r.tpot_ms for r in reqs] == [10.0, 40.0, 0.0]
    assert slo_goodput_tok_s(reqs, 2.0, parse_objective("slo:20")) == pytest.approx((101 + 1) / 2.0)
    assert slo_goodput_tok_s(reqs, 2.0, parse_objective("slo:40")) == pytest.approx(153 / 2.0)
    assert slo_goodput_tok_s(reqs, 2.0, parse_objective("slo:5")) == pytest.approx(1 / 2.0)


def test_eval_scores_by_goodput_under_an_slo_and_it_can_rank_otherwise(tmp_path):
    """Same runs, two objectives: throughput scores every token; a TPOT target between the two
    policies' TPOTs makes the faster-per-request one the only one with any goodput."""
    w = Workload("closed:4", "closed", 4.0, 3.0)
    sim = json.dumps(load_deployment("h200-llama8b").to_dict())
    runs = {}
    for obj in ("throughput", "slo:1000"):
        for name in ("static:0", "static:3"):
            runs[(obj, name)] = run_job(_Job(sim, w, name, name, (0, 1, 2, 3, 5), 0, objective=obj))
    tpot = {n: runs[("throughput", n)].result["tpot_ms_mean"] for n in ("static:0", "static:3")}
    assert tpot["static:3"] < tpot["static:0"]  # a good drafter at C=4: deeper is faster per request
    target = f"slo:{(tpot['static:0'] + tpot['static:3']) / 2:.3f}"
    done = {}
    for obj in ("throughput", target):
        jobs = [run_job(_Job(sim, w, n, n, (0, 1, 2, 3, 5), 0, objective=obj)) for n in ("static:0", "static:3")]
        pols = {w.name: [("static:0", "static:0"), ("static:3", "static:3")]}
        done[obj] = collect_workloads([w], pols, jobs, obj)[0][w.name]
    thr, slo = done["throughput"], done[target]
    assert thr["score_metric"] == "throughput_tok_s" and slo["score_metric"] == "slo_goodput_tok_s"
    assert thr["policies"]["static:0"]["score"]["mean"] > 0
    # Every static:0 request is slower than the target (one seed, one deployment: they are all alike).
    assert slo["policies"]["static:0"]["score"]["mean"] < 0.5 * thr["policies"]["static:0"]["score"]["mean"]
    assert slo["policies"]["static:3"]["score"]["mean"] <= thr["policies"]["static:3"]["score"]["mean"]
    assert slo["policies"]["static:3"]["score"]["mean"] > slo["policies"]["static:0"]["score"]["mean"]


# --------------------------------------------------------------------------- the reward


def test_slo_reward_counts_on_target_tokens_and_stays_finite():
    from env.gym_env import SpecDecodeEnv

    def env(objective: str) -> RegretReward:
        sim = SpecDecodeEnv(deployment="h200-llama8b", workload="closed:32", episode_steps=50)
        return RegretReward(sim, reward="objective", objective=objective)

    thr, slo, none = env("throughput"), env("slo:15"), env("slo:0.001")
    for e in (thr, slo, none):
        e.reset(seed=3)
    for _ in range(20):
        rewards = [e.step(2)[1] for e in (thr, slo, none)]
        assert all(np.isfinite(rewards))
    eng = thr.unwrapped.engine
    times = np.array([1e3, 1e5, 1e7])
    got = on_target_tokens(eng, (0, 1, 2), times, 15.0)
    full = np.array([eng.expected_tokens(d) for d in (0, 1, 2)])
    assert got[0] == pytest.approx(full[0]) and got[2] == 0.0 and np.all(got <= full + 1e-9)
    assert slo.objective.tpot_ms == 15.0
    # A target no step meets: no token counts, and every depth only costs time.
    assert none._tokens.sum() == 0.0 and rewards[2] < 0


def test_train_config_validates_and_normalises_the_objective(tmp_path):
    class Args:
        out = tmp_path / "p.zip"
        traces = profile = sim = None
        deployment = "seed"
        seed = 0
        no_progress = True
        timesteps = n_envs = None
        objective = "slo:50.0"

    Args.profile = []
    assert TrainConfig.from_args(Args(), None).objective == "slo:50"
    Args.objective = "slo:zero"
    with pytest.raises(ConfigError, match="slo:TPOT_MS"):
        TrainConfig.from_args(Args(), None)


# --------------------------------------------------------------------------- CLI and serve


@pytest.mark.parametrize("command", ["train", "eval"])
def test_help_documents_the_objective(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--objective OBJECTIVE" in text and "slo:TPOT_MS" in text and "throughput" in text


def test_serve_help_says_a_zip_serves_its_objective(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "objective it was trained for" in text and "specdepth_policy_info" in text


def test_train_refuses_a_malformed_objective_in_one_line(tmp_path, capsys):
    rc = main(["train", "--deployment", "seed", "--out", str(tmp_path / "p.zip"), "--objective", "slo:"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("controller train: error: --objective must be") and err.count("\n") == 1
    assert not (tmp_path / "p.zip").exists()


def test_serve_reports_the_policys_objective(tmp_path):
    zmq = pytest.importorskip("zmq")
    from controller.metrics import render
    from controller.service import ServeConfig, Server

    ctx = zmq.Context()
    path = _with_objective(tmp_path, "slo:30")
    servers = [
        Server(ServeConfig(policy=str(path), bind="inproc://objective"), context=ctx),
        Server(ServeConfig(policy="builtin:static:2", bind="inproc://objective2"), context=ctx),
    ]
    try:
        zipped, builtin = servers
        assert zipped.objective == "slo:30" and builtin.objective == "throughput"
        metrics = render(zipped.stats)
        assert 'specdepth_policy_info{objective="slo:30",policy="ppo:slo_30.zip"} 1.0' in metrics
    finally:
        for server in servers:
            server.close()
        ctx.term()
