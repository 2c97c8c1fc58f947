"""Held-out scenario suites (``controller eval --suite``), their workloads and fair baselines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agents import suite as suite_mod
from agents.evaluate import EvalConfig, Workload, _build_policy, evaluate, world_params
from agents.suite import SUITES, Scenario, get_suite, suite_seeds
from controller.baselines import SGLangAdaptivePolicy, launcher_adaptive_config
from controller.errors import ConfigError
from controller.registry import make_factory
from env.acceptance import marginal_conditionals, mean_accept_length
from env.deployments import load_deployment
from env.workload import TASK_SHIFTS, Arrivals, parse_workload

DEPTHS = (0, 1, 2, 3, 5)


# ----------------------------------------------------------------------------- workloads


def _arrivals(spec: str, n: int, seed: int = 0) -> list[tuple[int, int, int, float]]:
    wp = load_deployment("h200-llama8b").workload
    arr = Arrivals(parse_workload(spec), wp, 0.8, np.random.default_rng(seed))
    return [arr.pop() for _ in range(n)]


@pytest.mark.parametrize("deployment", ["h200-llama8b", "seed"])
def test_task_shifts_match_the_published_figures(deployment):
    ap = load_deployment(deployment).acceptance
    chat = mean_accept_length(ap, 7)
    # EAGLE-3 model card, T=1, k=7: MT-bench 2.77, HumanEval 3.49, GSM8K 3.34.
    assert mean_accept_length(ap, 7, TASK_SHIFTS["code"]) / chat == pytest.approx(3.49 / 2.77, rel=0.03)
    assert mean_accept_length(ap, 7, TASK_SHIFTS["math"]) / chat == pytest.approx(3.34 / 2.77, rel=0.03)
    # Long documents: 5-8% acceptance (vLLM issue #52258).
    p1 = marginal_conditionals(replace(ap, alpha=ap.alpha + TASK_SHIFTS["longdoc"]), 1)[0]
    assert 0.04 <= p1 <= 0.09


def test_task_mix_draws_tasks_in_their_fractions():
    shifts = [a[3] for a in _arrivals("poisson:50@mix=code:0.3+longdoc:0.2", 4000)]
    got = {name: np.mean(np.isclose(shifts, s)) for name, s in TASK_SHIFTS.items() if name != "math"}
    assert got["code"] == pytest.approx(0.3, abs=0.03)
    assert got["longdoc"] == pytest.approx(0.2, abs=0.03)
    assert got["chat"] == pytest.approx(0.5, abs=0.03)


def test_long_prompts_and_prompt_ranges():
    prompts = np.array([a[1] for a in _arrivals("poisson:50@long=0.25:4096-16384", 4000)])
    assert np.mean(prompts >= 4096) == pytest.approx(0.25, abs=0.04)
    assert prompts.max() <= 16384
    prompts = np.array([a[1] for a in _arrivals("poisson:50@prompt=100-32000", 2000)])
    assert prompts.min() >= 100 and prompts.max() <= 32000
    assert np.median(prompts) == pytest.approx(np.sqrt(100 * 32000), rel=0.2)  # log-uniform


def test_long_prompts_accept_less_through_the_deployment_not_the_workload():
    # The fall with context is one formula, the deployment's (AcceptanceParams.ctx_shift):
    # a workload's arrivals carry no context shift of their own.
    from env.deployments import load_deployment

    arr = _arrivals("poisson:50@prompt=100-32000", 300)
    assert all(a[3] == 0.0 for a in arr)  # (t, prompt, out, shift, zero_accept)
    acc = load_deployment("h200-llama8b").acceptance
    assert acc.ctx_shift(20_000) < acc.ctx_shift(2_000) <= 0.0


def test_phase_odd_shift_and_odd_long_follow_the_half_periods():
    arr = _arrivals("phase:10:poisson:40@accept_shift=-3,odd_shift=4,odd_long=1.0:8192-9000", 800)
    for t_us, prompt, _, shift, _ in arr:
        odd = int(t_us // 5e6) % 2 == 1
        assert shift == (1.0 if odd else -3.0)
        assert 8192 <= prompt <= 9000 if odd else prompt <= 8192


def test_wave_swings_from_a_trickle_to_the_peak_and_back():
    arr = _arrivals("wave:1,41,40", 3000)
    t = np.array([a[0] for a in arr]) / 1e6
    t = t[t < 40]
    per_bin = np.histogram(t, bins=8, range=(0, 40))[0] / 5.0
    assert per_bin[0] < 8 and per_bin[-1] < 8  # near the trickle at both ends
    assert per_bin[3] > 30 and per_bin[4] > 30  # near the peak in the middle


def test_specs_without_the_new_options_draw_as_before():
    # No extra random draws unless an option asks for them: old specs, old streams.
    a = _arrivals("poisson:20", 50, seed=3)
    b = _arrivals("poisson:20@long=0.0", 50, seed=3)
    assert a == b


@pytest.mark.parametrize("bad", ["closed:4@mix=poetry:0.2", "closed:4@long=2:1-2", "closed:4@prompt=9-3"])
def test_bad_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        parse_workload(bad)


# ----------------------------------------------------------------------------- baselines


def test_sglang_adaptive_all_uses_the_launchers_tiers():
    from sglang_hook.launch_server import plan

    argv = ["--spec-controller", "ipc:///tmp/x", "--spec-depths", "0,1,2,3,5", "--model-path", "m",
            "--speculative-algorithm", "EAGLE3"]  # fmt: skip
    p = plan(argv, "/tmp/adaptive.json")
    assert p.adaptive_config == launcher_adaptive_config(DEPTHS)
    pol = make_factory("builtin:sglang-adaptive-all", DEPTHS)(DEPTHS)
    assert isinstance(pol, SGLangAdaptivePolicy)
    # One tier for every batch size, with every depth, starting at the launcher's start depth.
    slot = pol._route(200)
    assert slot is pol._route(1)
    assert slot.candidate_steps == list(DEPTHS)
    assert slot.current_steps == 2


def test_goodput_fit_is_given_the_fit_and_goodput_exact_the_world():
    fit = load_deployment("h200-llama8b")
    w = Workload("closed:8", "closed", 8.0, 5.0, perturb=1.0, salt=7)
    world = world_params(fit, w, 1000)
    assert world.latency != fit.latency
    assert world_params(fit, w, 1000) == world  # the same draw for the same (scenario, seed)
    assert world_params(fit, w, 1001) != world
    g_fit = _build_policy("goodput-fit", DEPTHS, fit, world)
    g_exact = _build_policy("goodput-exact", DEPTHS, fit, world)
    from env.latency import step_time_us

    assert g_fit.latency_fn(3, 16, 8000) == step_time_us(fit.latency, 16, 3, 8000)
    assert g_exact.latency_fn(3, 16, 8000) == step_time_us(world.latency, 16, 3, 8000)
    served = _build_policy("goodput", DEPTHS, fit, world)
    assert served.latency_fn is None  # what `controller serve --policy builtin:goodput` runs


# ----------------------------------------------------------------------------- the suite


def test_suites_are_well_formed_and_held_out():
    for name, scenarios in SUITES.items():
        assert get_suite(name) is scenarios
        names = [s.name for s in scenarios]
        assert len(names) == len(set(names))
        deployments = {s.deployment for s in scenarios}
        assert {"h200-llama8b", "seed", "h200-llama8b-longctx", "h200-70b"} <= deployments
        for s in scenarios:
            parse_workload(s.resolve(10.0))  # every spec parses once its rates are resolved
            assert s.loop in ("closed", "open")
    assert min(suite_seeds(5)) >= 1000  # training draws its own episode seeds
    with pytest.raises(ConfigError, match="unknown suite"):
        get_suite("nope")


def test_suite_eval_reports_headroom_shifting_and_missing_deployments(tmp_path, monkeypatch):
    tiny = (
        Scenario("t/alt-c4", "h200-llama8b", "phase:4:closed:4@accept_shift=-3,odd_shift=4", 6, True),
        Scenario("t/wave", "h200-llama8b", "wave:{0.05},{1.2},6", 6, True, True),
        Scenario("t/absent", "no-such-deployment", "closed:4", 6, False),
    )
    monkeypatch.setitem(suite_mod.SUITES, "tiny", tiny)
    cfg = EvalConfig(
        suite="tiny",
        baselines="static:0,static:3,sglang-adaptive-all,goodput-fit,goodput-exact,oracle",
        policies=(str(tmp_path / "{deployment}" / "ppo.zip"),),
        out=tmp_path / "out",
        seeds=2,
    )
    report = evaluate(cfg)
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["seeds"] == [1000, 1001]
    assert set(res["workloads"]) == {"t/alt-c4", "t/wave"}
    assert res["missing"][0]["scenario"] == "t/absent"
    for w in res["workloads"].values():
        assert w["family"] in ("closed", "open")
        assert isinstance(w["shifting"], bool)
        assert w["headroom"] > 0.5
        assert "oracle" in w["policies"] and "ppo" not in w["policies"]
        assert w["missing_policies"]  # no zip for the deployment: listed, not a crash
    assert res["workloads"]["t/wave"]["overload"] is True
    assert "goodput-fit" in res["robustness"] and "oracle" in res["robustness"]
    text = report.read_text()
    assert "Robustness across the suite" in text and "t/absent" in text
    assert (tmp_path / "out" / "suite_ratios.png").exists()


def test_decisions_v2_is_v1_unchanged_plus_scenarios_with_their_own_slo():
    v1, v2 = get_suite("decisions-v1"), get_suite("decisions-v2")
    assert v2[: len(v1)] == v1  # v1's results stay comparable: same scenarios, names, salts
    assert all(s.objective is None for s in v1)
    extra = v2[len(v1) :]
    assert extra and all(s.objective is not None and s.objective.startswith("slo:") for s in extra)
    from controller.objective import parse_objective

    for s in extra:
        assert parse_objective(s.objective).is_slo and "slo" in s.name


def test_decisions_v3_is_v1_unchanged_plus_scenarios_where_the_right_depth_moves(tmp_path):
    """v3 adds four scenarios to v1 (whose results stay comparable) and in each the right depth
    moves: over the suite's 5 seeds the clairvoyant oracle beats every static depth, by 5% or more
    on three (the code and long-document phases at 2 and 4 requests, 21-28% since SGLang's
    extend loop over each prefix is priced: drafting pays on the code and costs several steps'
    worth on the documents; 70b/drafter-alt-c4 18%). The fourth, 70b/wave-drafter-alt, was
    chosen at 9.3% and holds 2.3% since the loop is priced: at the open loop's peaks drafting
    costs the 70B more than it gains. The suite-level target of half the scenarios at 5% is
    reported, and missed, in docs/results.md. With fewer seeds the margins need not hold (2
    seeds gave 70b/drafter-alt-c4 2.7% before)."""
    v1, v3 = get_suite("decisions-v1"), get_suite("decisions-v3")
    assert v3[: len(v1)] == v1
    extra = v3[len(v1) :]
    assert len(extra) == 4 and all(s.objective is None and s.shifting for s in extra)
    cfg = EvalConfig(
        suite="decisions-v3",
        baselines="static:0,static:1,static:2,static:3,static:5,oracle",
        out=tmp_path / "out",
        seeds=5,
        only=tuple(s.name for s in extra),
    )
    evaluate(cfg)
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(res["workloads"]) == {s.name for s in extra}
    headroom = {name: w["headroom"] for name, w in res["workloads"].items()}
    assert all(h >= 1.02 for h in headroom.values()), headroom
    assert sum(h >= 1.05 for h in headroom.values()) >= 3, headroom


def test_a_scenario_with_its_own_objective_is_scored_by_it(tmp_path, monkeypatch):
    tiny = (
        Scenario("t/c8", "h200-llama8b", "closed:8", 4, False),
        Scenario("t/c8-slo", "h200-llama8b", "closed:8", 4, False, objective="slo:8"),
    )
    monkeypatch.setitem(suite_mod.SUITES, "tiny-slo", tiny)
    cfg = EvalConfig(suite="tiny-slo", baselines="static:0,static:3", out=tmp_path / "out", seeds=1)
    report = evaluate(cfg)
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["objective"] == "throughput"
    plain, slo = res["workloads"]["t/c8"], res["workloads"]["t/c8-slo"]
    assert plain["score_metric"] == "throughput_tok_s" and "objective" not in plain
    assert slo["score_metric"] == "slo_goodput_tok_s" and slo["objective"] == "slo:8"
    for p in ("static:0", "static:3"):
        assert "slo_goodput_tok_s" not in plain["policies"][p]
        s = slo["policies"][p]
        assert s["score"] == s["slo_goodput_tok_s"] and s["score"]["mean"] <= s["throughput_tok_s"]["mean"]
    # h200-llama8b at C=8: depth 0 takes more than 8 ms a token, a good drafter less.
    assert slo["policies"]["static:0"]["score"]["mean"] < slo["policies"]["static:3"]["score"]["mean"]
    assert "t/c8-slo (slo:8)" in report.read_text()


def test_the_suite_runs_the_hooks_warm_resume_when_asked(tmp_path, monkeypatch):
    """``--warm-resume``: every deployment inserts the hook's depth-0 step before each resume.
    A policy that never drafts runs exactly as before; one that toggles does not; the report
    says which was run."""
    tiny = (Scenario("t/alt-c4", "h200-llama8b", "phase:2:closed:4@accept_shift=-3,odd_shift=4", 6, True),)
    monkeypatch.setitem(suite_mod.SUITES, "tiny-warm", tiny)
    scores = {}
    for warm in (False, True):
        cfg = EvalConfig(suite="tiny-warm", baselines="static:0,oracle", out=tmp_path / str(warm), seeds=1,
                         warm_resume=warm)  # fmt: skip
        report = evaluate(cfg)
        res = json.loads((tmp_path / str(warm) / "results.json").read_text())
        assert res["config"]["warm_resume"] is warm
        assert ("warm resume" in report.read_text()) is warm
        pols = res["workloads"]["t/alt-c4"]["policies"]
        scores[warm] = {p: pols[p]["score"]["mean"] for p in ("static:0", "oracle")}
    assert scores[True]["static:0"] == scores[False]["static:0"]
    assert scores[True]["oracle"] != scores[False]["oracle"]


def test_suite_eval_with_a_policy_and_no_baselines_reports_dashes(tmp_path, monkeypatch):
    # A user timing only their zip must get a report, with "—" where no competitor ran.
    monkeypatch.setitem(suite_mod.SUITES, "solo", (Scenario("t/c4", "seed", "closed:4", 6, False),))
    cfg = EvalConfig(
        suite="solo",
        baselines="none",
        policies=(str(Path(__file__).resolve().parents[1] / "agents" / "bundled" / "{deployment}" / "ppo.zip"),),
        out=tmp_path / "out",
        seeds=1,
    )
    text = evaluate(cfg).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| t/c4"))
    assert "—" in row
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(res["workloads"]["t/c4"]["policies"]) == {"ppo"}
