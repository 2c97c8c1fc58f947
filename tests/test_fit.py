"""Fitting: the latency model on the H200 profile, recovery from simulated traces, bad input."""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from controller.cli import main as cli_main
from env.acceptance import AcceptanceParams, accept_length_pmf, fit_acceptance, marginal_conditionals
from env.deployments import load_deployment
from env.errors import FitError
from env.fit import fit_sim, predict_profile
from env.latency import (
    OFF_EXTEND,
    fit_profile,
    predict_component_ms,
    profile_mape,
    read_profile,
    step_time_us,
)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "env" / "profiles" / "h200_llama8b" / "latency.csv"  # shipped: no test skips for it
EXAMPLES = ROOT / "env" / "example_traces"


def test_latency_fit_predicts_held_out_profile_rows_within_5_percent():
    df = read_profile(str(PROFILE))
    rng = np.random.default_rng(0)
    hold = rng.random(len(df)) < 0.2
    lp, _ = fit_profile(df[~hold])
    mape = profile_mape(lp, df[hold])
    assert mape["target"] <= 5.0
    assert mape["target_gemm"] <= 5.0
    assert mape["draft"] <= 6.0 and mape["draft_nofc"] <= 6.0


def test_latency_model_extrapolates_sanely():
    lp = load_deployment("h200-llama8b").latency
    # Monotone in batch, depth and context; linear (not explosive) far past the fitted range.
    t = [step_time_us(lp, b, 3, b * 4096) for b in (64, 128, 256, 512)]
    assert all(b > a for a, b in zip(t, t[1:]))
    assert 1.6 < t[3] / t[2] < 2.2
    by_depth = [step_time_us(lp, 64, d, 64 * 1024) for d in (0, 1, 2, 3, 5, 8)]
    assert all(b > a for a, b in zip(by_depth, by_depth[1:]))
    long = [float(predict_component_ms(lp, "target", 1, 1, L)) for L in (4096, 32768, 131072)]
    assert long[0] < long[1] < long[2] < 10 * long[0]
    # Verify at small batch costs about one decode (memory-bound); at large batch it scales.
    small = float(
        predict_component_ms(lp, "target", 1, 4, 1024) / predict_component_ms(lp, "target", 1, 1, 1024)
    )
    large = float(
        predict_component_ms(lp, "target", 256, 8, 1024) / predict_component_ms(lp, "target", 256, 1, 1024)
    )
    assert small < 1.15 and large > 2.5


def test_acceptance_mle_recovers_parameters():
    true = replace(AcceptanceParams(), alpha=1.4, beta=-0.2, sigma=0.7)
    rng = np.random.default_rng(0)
    counts = {d: rng.multinomial(20000, accept_length_pmf(true, d)).astype(float) for d in (1, 3, 5)}
    fit, rep = fit_acceptance(counts, AcceptanceParams())
    # alpha and sigma trade off (both move the mean), so check what the data identify: the
    # accept-length distributions, at the fitted depths and at one never seen.
    for d in (1, 3, 5, 7):
        assert np.abs(accept_length_pmf(fit, d) - accept_length_pmf(true, d)).sum() < 0.03
    assert abs(fit.beta + 0.2) < 0.1
    assert rep["tv_mean"] < 0.01


def test_default_acceptance_matches_published_conditionals():
    ap = load_deployment("h200-llama8b").acceptance
    assert np.allclose(marginal_conditionals(ap, 3), [0.73, 0.71, 0.68], atol=0.01)


def test_fit_recovers_the_deployment_from_its_own_traces():
    truth = load_deployment("h200-llama8b")
    params, report = fit_sim(str(EXAMPLES / "h200-llama8b"), [])
    assert report.step_mape_holdout is not None and report.step_mape_holdout < 5.0
    assert report.accept_tv_fit is not None and report.accept_tv_fit < 0.05
    # The traces' requests longer than ctx_ref_tokens accept less (the fall with context), which
    # step records cannot attribute to requests (their mean length stays below it): the fit reads
    # that as a slightly worse drafter, hence 0.12 rather than the 0.1 of a context-free model.
    for d in (1, 3, 5):
        assert (
            np.abs(accept_length_pmf(params.acceptance, d) - accept_length_pmf(truth.acceptance, d)).sum()
            < 0.12
        )
    assert abs(params.engine.kv_budget_tokens / truth.engine.kv_budget_tokens - 1) < 0.01
    assert "fitted" in str(report)


def test_fit_cli_with_profile_holdout_and_predictions(tmp_path, capsys):
    df = pd.read_csv(PROFILE)
    held = df.sample(frac=0.2, random_state=1)
    df.drop(held.index).to_csv(tmp_path / "fit.csv", index=False)
    held.to_csv(tmp_path / "held.csv", index=False)
    rc = cli_main(
        ["fit", "--profile", str(tmp_path / "fit.csv"), "--out", str(tmp_path / "sim.json"),
         "--holdout", str(tmp_path / "held.csv"), "--predictions", str(tmp_path / "pred.csv")]
    )  # fmt: skip
    assert rc == 0
    out = pd.read_csv(tmp_path / "pred.csv")
    assert list(out.columns) == list(df.columns) + ["predicted_ms"] and len(out) == len(held)
    target = out[out.component == "target"]
    assert (abs(target.predicted_ms - target.median_ms) / target.median_ms).mean() <= 0.05
    assert "MAPE" in capsys.readouterr().out
    report = json.loads((tmp_path / "sim.report.json").read_text())
    assert report["profile_mape_holdout"]["target"] <= 5.0
    from env.params import SimParams

    _, mape = predict_profile(SimParams.from_json(tmp_path / "sim.json"), str(tmp_path / "held.csv"))
    assert mape["target"] <= 5.0


# ----------------------------------------------------------------------------- bad input


def test_fit_refuses_no_input():
    with pytest.raises(FitError, match="nothing to fit"):
        fit_sim(None, [])


def test_fit_empty_folder_names_it(tmp_path):
    with pytest.raises(FitError, match=str(tmp_path)):
        fit_sim(str(tmp_path), [])


def test_fit_corrupt_trace_names_the_file(tmp_path):
    src = next((EXAMPLES / "seed").glob("*closed1*"))  # gzipped; its records, corrupted, go plain
    data = bytearray(gzip.decompress(src.read_bytes()))
    data[2000:2100] = b"\xc1" * 100  # 0xc1 is never valid msgpack
    (tmp_path / "x-1.msgpack").write_bytes(bytes(data))
    with pytest.raises(FitError, match="x-1.msgpack"):
        fit_sim(str(tmp_path), [])


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
def test_fit_truncated_trace_uses_the_records_before_the_tear(tmp_path, gzipped):
    from controller.errors import TraceWarning

    src = next((EXAMPLES / "seed").glob("*closed8*"))
    if gzipped:  # the gzip stream cut short, as a plain file is by a crash
        packed = src.read_bytes()
        (tmp_path / "t-1.msgpack.gz").write_bytes(packed[: len(packed) - 1000])
    else:
        data = gzip.decompress(src.read_bytes())
        (tmp_path / "t-1.msgpack").write_bytes(data[: len(data) - 37])  # torn last record
    with pytest.warns(TraceWarning, match="t-1.msgpack"):
        params, report = fit_sim(str(tmp_path), [])
    assert report.n_steps > 1000


def test_fit_traces_without_accept_lists_fall_back_and_say_so(tmp_path):
    from controller.traces import TraceWriter
    from env.engine import Engine

    eng = Engine(load_deployment("seed"), "closed:4")
    eng.reset(0)
    with TraceWriter(tmp_path, "nospec", start_ns=1) as w:
        for _ in range(300):
            rec = eng.step(0)
            w.write(rec.to_wire(), rec.ts_ns)
    params, report = fit_sim(str(tmp_path), [])
    assert any("kept the published defaults" in n for n in report.notes)
    assert report.accept_tv_fit is None


def test_pinned_passes_fit_only_a_plain_servers_overheads_and_admissions(tmp_path, capsys):
    """``fit_sim(pin_passes=True)`` (``controller fit --passes-from``): a server that runs the
    deployment's passes at depth 0 with no drafter, its own per-step overhead and admission
    cost. Given the deployment as the base, the fit keeps every pass term and recovers the two
    costs from records that, unpinned, cannot tell them from the pass scales."""
    from controller.traces import TraceWriter
    from env.engine import Engine

    base = load_deployment("h200-llama8b")
    truth = replace(base, latency=replace(base.latency, off_extend=0.0, oh_us=base.latency.oh_us + 700.0, admit_us=4000.0))
    for seed, c in ((0, 8), (1, 32), (2, 96)):  # the batch spread a plain server's records have
        eng = Engine(truth, f"closed:{c}")
        eng.reset(seed)
        with TraceWriter(tmp_path, f"plain-{c}", start_ns=seed + 1) as w:
            for _ in range(600):
                rec = eng.step(0)
                w.write(rec.to_wire(), rec.ts_ns)
    params, report = fit_sim(str(tmp_path), [], base=base, off_draft="skip", pin_passes=True)
    lp = params.latency
    for name in ("t_fix_us", "w_us", "f_us_per_tok", "dec_kv_us_per_tok", "pf_scale", "d_w_us"):
        assert getattr(lp, name) == getattr(base.latency, name), name
    assert lp.oh_us == pytest.approx(truth.latency.oh_us, rel=0.05)
    # the admission's three terms trade off along the records' steps: their sum is what is pinned
    from controller.traces import step_records

    no_admit = replace(lp, admit_us=0.0, admit_seq_us=0.0, admit_hide=0.0)
    admitting = [s for steps in step_records(tmp_path).values() for s in steps if s.prefill_tokens > 0]
    cost = [step_time_us(lp, s.bs, 0, s.ctx_tokens, s.prefill_tokens) - step_time_us(no_admit, s.bs, 0, s.ctx_tokens, s.prefill_tokens) for s in admitting]
    assert len(admitting) > 100 and float(np.mean(cost)) == pytest.approx(4000.0, rel=0.15) and lp.off_extend == 0.0
    assert report.step_mape_holdout is not None and report.step_mape_holdout < 3.0
    assert any("pinned" in n for n in report.notes)
    free, _ = fit_sim(str(tmp_path), [], base=base, off_draft="skip")
    assert free.latency.t_fix_us != base.latency.t_fix_us  # unpinned, the passes move too

    sim = tmp_path / "base.json"
    base.to_json(sim)
    out = tmp_path / "plain.json"
    assert cli_main(["fit", "--traces", str(tmp_path), "--passes-from", str(sim), "--off-draft", "skip", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["latency"]["w_us"] == base.latency.w_us
    assert cli_main(["fit", "--passes-from", str(sim), "--out", str(out)]) == 2
    assert "--passes-from needs --traces" in capsys.readouterr().err
    assert cli_main(["fit", "--traces", str(tmp_path), "--profile", str(PROFILE), "--passes-from", str(sim), "--out", str(out)]) == 2
    assert "give one" in capsys.readouterr().err


def test_profile_missing_columns_and_bad_values_name_the_file(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text("component,batch,q,median_ms\ntarget,1,1,5.0\n")
    with pytest.raises(FitError, match=r"p\.csv.*ctx"):
        fit_sim(None, [str(p)])
    p.write_text("component,batch,q,ctx,median_ms\ntarget,1,1,1024,abc\n")
    with pytest.raises(FitError, match=r"p\.csv: line 2"):
        fit_sim(None, [str(p)])
    p.write_text("")
    with pytest.raises(FitError, match=r"p\.csv"):
        fit_sim(None, [str(p)])
    with pytest.raises(FitError, match="missing.csv"):
        fit_sim(None, [str(tmp_path / "missing.csv")])
    p.write_text("component,batch,q,ctx,median_ms\ndraft,1,1,1024,0.3\n")
    with pytest.raises(FitError, match="target"):
        fit_sim(None, [str(p)])


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    rc = cli_main(["fit", "--traces", str(tmp_path / "nope"), "--out", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "nope" in err


def test_bench_cli_json(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = cli_main(
        ["bench", "--deployment", "seed", "--policy", "builtin:static:0", "--concurrency", "1,4",
         "--duration-s", "20", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in res] == [1, 4]
    assert abs(res[0]["throughput_tok_s"] / 92.6 - 1) < 0.1
    assert res[1]["throughput_tok_s"] > res[0]["throughput_tok_s"] and res[0]["tpot_ms_mean"] > 0
    assert "tok/s" in capsys.readouterr().out


def test_traces_of_a_kv_server_fit_its_depth_0_steps_as_kv():
    """``--off-draft kv``: the depth-0 steps are the target plus kv's share of the drafter's
    extend, so the fit keeps that share, and the step it predicts for depth 0 is the one it fitted
    (the target priced for what is left of the step); a bad mode is refused."""
    from env.errors import FitError
    from env.fit import fit_sim

    keep, _ = fit_sim(str(EXAMPLES / "h200-llama8b"), [], off_draft="keep")
    kv, _ = fit_sim(str(EXAMPLES / "h200-llama8b"), [], off_draft="kv")
    assert keep.latency.off_extend == 1.0 and kv.latency.off_extend == OFF_EXTEND["kv"]
    for bs in (1, 16, 64):
        k0, v0 = (step_time_us(p.latency, bs, 0, bs * 512.0) for p in (keep, kv))
        # both fit the same depth-0 steps (within 3%: the drafter's share now carries the extend
        # kernel's loop over the prefix, which the pass classes absorb only in part) ...
        assert abs(v0 / k0 - 1.0) < 0.03, bs
        plain_k, plain_v = (step_time_us(replace(p.latency, off_extend=0.0), bs, 0, bs * 512.0) for p in (keep, kv))
        assert plain_v > 1.02 * plain_k, bs  # ... so kv leaves more of them to the target
    with pytest.raises(FitError, match="off_draft"):
        fit_sim(str(EXAMPLES / "h200-llama8b"), [], off_draft="half")


def test_example_traces_are_labelled_simulated():
    readme = (EXAMPLES / "README.md").read_text()
    assert "SIMULATED" in readme
    assert shutil.disk_usage(EXAMPLES)  # exists
    total = sum(
        p.stat().st_size for name in ("h200-llama8b", "seed") for p in (EXAMPLES / name).glob("*.msgpack.gz")
    )
    assert 0 < total < 1_000_000  # gzipped: the repository and the device tool's 64 MiB stay small


def _composed_step_us(lp, bs: int, depth: int, ctx_tokens: float, prefill_tokens: float) -> float:
    """The step formula of env/latency.py's docstring, composed here from the pass terms: a
    second derivation to check the one step kernel against (not bit for bit: the kernel
    groups the same terms in another order)."""
    from env.latency import draft_us, gemm_us, target_us

    t = lp.oh_us + lp.oh_req_us * bs
    pf = 0.0
    if prefill_tokens > 0:
        p = float(prefill_tokens)
        pf = lp.t_fix_us + lp.pf_scale * (gemm_us(lp, p) + lp.tok_us_per_tok * p) + lp.layers * lp.dec_fix_us
        pf += lp.pf_attn_us_per_tok * p + lp.admit_us + lp.admit_seq_us * bs
        pf += lp.layers * lp.pf_pair_us * p * (p + 1.0) / 2.0  # one prompt, nothing cached: quadratic in it
    waves = -(-bs // lp.ext_wave_seqs)  # whole waves of ext_wave_seqs requests
    ver = lp.verify_seq_us * bs + lp.verify_ctx_us_per_tok * ctx_tokens / bs * waves  # SGLang's extend kernel
    ext = ver * lp.d_layers / lp.layers  # the draft extend's share
    if depth > 0:
        t += lp.oh_spec_us + float(draft_us(lp, bs, 1, ctx_tokens, True))
        t += (depth - 1) * float(draft_us(lp, bs, 1, ctx_tokens, False))
        t += float(target_us(lp, bs, depth + 1, ctx_tokens)) + ver
        t += float(draft_us(lp, bs, depth + 1, ctx_tokens)) + ext
    else:
        t += float(target_us(lp, bs, 1, ctx_tokens))
        if lp.off_path == "verify":
            t += lp.oh_spec_us + ver + lp.v0_fix_us + lp.v0_seq_us * bs
            t += float(draft_us(lp, bs, 1, ctx_tokens)) + ext
        elif lp.off_extend:  # its share of the drafter's one-token extend
            t += lp.off_extend * (float(draft_us(lp, bs, 1, ctx_tokens, False)) + ext)
    # the admission's cost, less the share the step it joins hides
    return t + pf - min(lp.admit_us + lp.admit_seq_us * bs, lp.admit_hide * t) if pf else t


def test_the_step_kernel_agrees_with_the_pass_terms_and_over_arrays():
    from env.latency import prefill_us, step_times_us

    rng = np.random.default_rng(0)
    bs = rng.integers(1, 300, 100)
    d = rng.choice([0, 1, 2, 3, 5, 7], 100)
    c = bs * rng.integers(10, 9000, 100)
    pf = rng.choice([0, 0, 100, 5000], 100)
    for name in ("h200-llama8b", "h200-70b", "seed"):
        for off in ("plain", "verify", "kv"):
            base = load_deployment(name).latency
            lp = replace(base, off_path="plain", off_extend=OFF_EXTEND["kv"]) if off == "kv" else replace(base, off_path=off)
            if off == "kv":  # and an admission cost and an extend loop, as fitted to the H100 testbed's traces
                lp = replace(lp, admit_us=30_000.0, admit_seq_us=150.0, admit_hide=0.8)
                lp = replace(lp, verify_ctx_us_per_tok=2.2)
            ref = np.array(
                [_composed_step_us(lp, int(b), int(k), float(x), float(p)) for b, k, x, p in zip(bs, d, c, pf)]
            )
            one = np.array(
                [step_time_us(lp, int(b), int(k), float(x), float(p)) for b, k, x, p in zip(bs, d, c, pf)]
            )
            np.testing.assert_allclose(one, ref, rtol=1e-12)
            assert np.array_equal(step_times_us(lp, bs, d, c, pf), one)  # the same kernel, the same floats
            assert prefill_us(lp, 0) == 0.0
            hidden = min(lp.admit_us + lp.admit_seq_us * 8, lp.admit_hide * step_time_us(lp, 8, 3, 8000.0))
            assert step_time_us(lp, 8, 3, 8000.0, 512) - step_time_us(lp, 8, 3, 8000.0) == pytest.approx(
                prefill_us(lp, 512, 8) - hidden, rel=1e-12
            )


def test_the_coefficient_indices_name_step_coeffs():
    from env import latency

    named = {
        "I_T_FIX": "t_fix_us", "I_W": "w_us", "I_F": "f_us_per_tok", "I_P": "p", "I_TOK": "tok_us_per_tok",
        "I_LAYERS": "layers", "I_WAVE": "wave_seqs", "I_SHARP": "wave_sharpness", "I_DEC": "dec_fix_us",
        "I_SPLIT": "split_fix_us", "I_SPLIT_Q": "split_q_rel", "I_MQ": "mq_fix_us", "I_D_FIX": "d_fix_us",
        "I_D_FC": "d_fc_us", "I_D_W": "d_w_us", "I_D_F": "d_f_us_per_tok", "I_D_TOK": "d_tok_us_per_tok",
        "I_D_LAYERS": "d_layers", "I_OH": "oh_us", "I_OH_SPEC": "oh_spec_us", "I_OH_REQ": "oh_req_us",
        "I_OFF_VERIFY": "off_verify", "I_OFF_EXTEND": "off_extend", "I_V0_FIX": "v0_fix_us",
        "I_V0_SEQ": "v0_seq_us", "I_PF_ATTN": "pf_attn_us_per_tok", "I_PF_SCALE": "pf_scale",
        "I_VER_SEQ": "verify_seq_us", "I_ADMIT": "admit_us", "I_ADMIT_SEQ": "admit_seq_us",
        "I_ADMIT_HIDE": "admit_hide", "I_VER_CTX": "verify_ctx_us_per_tok", "I_EXT_WAVE": "ext_wave_seqs",
    }  # fmt: skip
    for const, name in named.items():
        assert latency.STEP_COEFFS[getattr(latency, const)] == name, const
    for k in ("dec", "split", "mq"):  # each kernel's four per-layer terms in order
        i = getattr(latency, f"I_{k.upper()}")
        assert latency.STEP_COEFFS[i : i + 4] == (
            f"{k}_fix_us", f"{k}_seq_us", f"{k}_kv1_us_per_tok", f"{k}_kv_us_per_tok"
        )  # fmt: skip
    lp = load_deployment("h200-llama8b").latency
    c = latency.step_coeffs(lp)
    for i, name in enumerate(latency.STEP_COEFFS):
        want = (lp.off_path == "verify") if name == "off_verify" else getattr(lp, name)
        assert c[i] == float(want), name


def test_the_extend_loop_is_priced_per_cached_token_of_a_sequence():
    """SGLang's extend-attention kernel loops over each request's prefix, the requests of one wave
    (``ext_wave_seqs``, 4.125) side by side: a drafted step (and SGLang's own depth 0) pays
    ``verify_ctx_us_per_tok`` per cached token *per sequence* in the verify and its draft-extend
    share, so up to a wave of requests of L tokens pay the loop about once, not once each, and a
    batch of 64 pays it for each of its ~16 waves; the off switch's plain depth 0 pays only its
    extend share."""
    base = replace(load_deployment("h200-llama8b").latency, jitter=0.0, verify_ctx_us_per_tok=0.0)
    lp = replace(base, verify_ctx_us_per_tok=2.2)
    loop = 2.2 * (1.0 + lp.d_layers / lp.layers)  # µs per cached token per sequence: verify + draft extend
    for depth in (1, 3, 5):
        for bs, waves in ((1, 1.0), (2, 1.0), (4, 1.0), (64, 64 / 4.125)):
            for per_seq in (300.0, 1500.0):
                ctx = bs * per_seq
                extra = step_time_us(lp, bs, depth, ctx) - step_time_us(base, bs, depth, ctx)
                assert extra == pytest.approx(loop * per_seq * waves, rel=0.1), (depth, bs, per_seq)
    one = step_time_us(lp, 1, 3, 1500.0) - step_time_us(base, 1, 3, 1500.0)
    assert one == pytest.approx(loop * 1500.0, rel=1e-5)  # batch 1: the whole loop, once
    kv = replace(lp, off_extend=OFF_EXTEND["kv"])
    d0 = step_time_us(kv, 1, 0, 1500.0) - step_time_us(replace(kv, verify_ctx_us_per_tok=0.0), 1, 0, 1500.0)
    assert d0 == pytest.approx(OFF_EXTEND["kv"] * 2.2 * lp.d_layers / lp.layers * 1500.0, rel=1e-5)
    sg = replace(lp, off_path="verify")
    d0 = step_time_us(sg, 1, 0, 1500.0) - step_time_us(replace(sg, verify_ctx_us_per_tok=0.0), 1, 0, 1500.0)
    assert d0 == pytest.approx(loop * 1500.0, rel=1e-5)


def _drafted_records(lp, prompt: str, seed: int = 0) -> list:
    """A simulated server's records at batch 1-2 drafting at depths 1, 3 and 5 in turn."""
    from env.engine import Engine

    params = replace(load_deployment("h200-llama8b"), latency=lp)
    eng = Engine(params, f"closed:2@prompt={prompt},output=80,n=60")
    eng.reset(seed)
    recs = []
    while not eng.done:
        recs.append(eng.step((1, 3, 5)[len(recs) % 3]))
    return recs


def test_the_extend_loop_is_recovered_from_drafted_steps_of_spread_contexts():
    """``fit_step_latency`` on records whose drafted steps' cached tokens per sequence spread
    (prompts of 100-2,000 tokens) recovers the loop's cost per token, so a batch-1 step at a short
    context is priced as the records had it and not at their mean context; it reads none where
    the records had none; where every sequence holds about as many tokens it cannot tell the
    loop from ``oh_spec_us`` and leaves it as given."""
    from env.fit import fit_step_latency

    base = replace(load_deployment("h200-llama8b").latency, jitter=0.01, verify_ctx_us_per_tok=0.0)
    truth = replace(base, verify_ctx_us_per_tok=2.2)
    fitted = fit_step_latency(base, _drafted_records(truth, "100-2000"))
    assert fitted.verify_ctx_us_per_tok == pytest.approx(2.2, rel=0.1)
    for per_seq in (150.0, 2000.0):
        for depth in (1, 5):
            got, want = (step_time_us(lp, 1, depth, per_seq) for lp in (fitted, truth))
            assert got == pytest.approx(want, rel=0.03), (per_seq, depth)
    assert fit_step_latency(base, _drafted_records(base, "100-2000")).verify_ctx_us_per_tok < 0.2
    same = fit_step_latency(replace(base, verify_ctx_us_per_tok=1.0), _drafted_records(truth, "400"))
    assert same.verify_ctx_us_per_tok == 1.0


def test_an_admission_cost_split_over_two_records_is_recovered(tmp_path):
    """``fit_admission`` on the example traces with an admission cost added the way SGLang's
    overlap scheduler records it: 30 ms + 200 µs per running request, 60% of it in the record
    before the one that counts the prefilled tokens. The fit reads the pairs and recovers it;
    the traces as simulated (no such cost) give almost none."""
    from controller.traces import step_records
    from env.fit import fit_admission

    base = load_deployment("h200-llama8b").latency
    recs = step_records(EXAMPLES / "h200-llama8b")
    lp0, n0 = fit_admission(base, recs)
    admitting = [s for steps in recs.values() for s in steps if s.prefill_tokens > 0]
    cost0 = [
        step_time_us(lp0, s.bs, s.depth, s.ctx_tokens, s.prefill_tokens)
        - step_time_us(base, s.bs, s.depth, s.ctx_tokens, s.prefill_tokens)
        for s in admitting
    ]
    assert n0 >= 10 and float(np.mean(cost0)) < 1000.0  # under 1 ms an admission, where none was charged
    a_us, b_us = 30_000.0, 200.0
    charged = {}
    for name, steps in recs.items():
        out = list(steps)
        for i in range(1, len(out)):
            if out[i].prefill_tokens > 0 and out[i - 1].prefill_tokens == 0:
                cost = a_us + b_us * out[i].bs
                out[i - 1] = replace(out[i - 1], step_us=out[i - 1].step_us + int(0.6 * cost))
                out[i] = replace(out[i], step_us=out[i].step_us + int(0.4 * cost))
        charged[name] = out
    lp, n = fit_admission(base, charged)
    assert n == n0
    assert lp.admit_us == pytest.approx(a_us, rel=0.15) and lp.admit_seq_us == pytest.approx(b_us, rel=0.15)
    assert fit_admission(base, {k: v[:5] for k, v in recs.items()})[1] == 0  # too few: unchanged


def test_the_simulator_prices_an_admitting_step_as_the_fit_reads_it():
    """One formula for an admission: the engine's step that admits requests costs
    ``step_time_us`` of its own record's fields (what ``fit_admission`` and ``step_mape`` evaluate)
    and its prompts' attention pairs, admission terms included; and ``fit_admission`` on the simulator's own records recovers the
    terms it ran with (it charges the whole admission to the record that counts the prefill, so
    the pair's excess is that record's)."""
    from env.engine import Engine
    from env.fit import fit_admission

    h200 = load_deployment("h200-llama8b")
    a_us, b_us, hide = 25_000.0, 200.0, 0.5  # a longer step hides half its time of the admission
    lat = replace(h200.latency, admit_us=a_us, admit_seq_us=b_us, admit_hide=hide, jitter=0.0)
    params = replace(h200, latency=lat, engine=replace(h200.engine, prefix_cache_hit=0.99))
    recs = []
    for c in (4, 16, 48):
        eng = Engine(params, f"closed:{c}@prompt=256,output=40~0.7,n={6 * c}")
        steps, seen = [], 0
        while not eng.done:
            rec = eng.step(3 if c == 16 else 0)
            steps.append(rec)
            if rec.prefill_tokens > 0:
                seen += 1
                # the record's fields and the prompts' attention pairs, which only the engine knows
                want = step_time_us(lat, rec.bs, rec.depth, rec.ctx_tokens, rec.prefill_tokens, eng.last_pairs)
                assert eng.last_model_us == want  # the same kernel, the same float
                assert eng.last_busy_us == int(want)  # no jitter: the record's busy time
        assert seen >= 10
        recs.append(steps)
    fitted, n = fit_admission(
        replace(lat, admit_us=0.0, admit_seq_us=0.0, admit_hide=0.0), {str(i): s for i, s in enumerate(recs)}
    )
    assert n >= 30
    assert fitted.admit_us == pytest.approx(a_us, rel=0.05)
    assert fitted.admit_seq_us == pytest.approx(b_us, rel=0.1)
    assert fitted.admit_hide == pytest.approx(hide, rel=0.1)


def test_the_request_path_is_recovered_from_times_to_first_token():
    """``fit_request_path`` reads a server's HTTP/tokenizer path from its clients' TTFTs: a
    deployment given a known path, measured by the simulator's own TTFTs at C = 1 and 32, gives
    the path back from the deployment without one (the latency exactly, the serial time per
    request to within its mean-place approximation)."""
    from env.fit import fit_request_path, sim_ttft_us

    base = load_deployment("h200-llama8b")
    base = replace(base, engine=replace(base.engine, prefix_cache_hit=0.99))  # a warmed benchmark's prompts
    truth = replace(base, engine=replace(base.engine, request_latency_us=8000, request_serial_us=700))

    def workload(c: int) -> str:
        return f"closed:{c}@prompt=256,output=64,n={2 * c}"

    ttft_ms = {c: sim_ttft_us(truth, workload(c)) / 1000 for c in (1, 32)}
    assert ttft_ms[32] > ttft_ms[1] + 5  # the serial path queues a wave: the fit has something to read
    none = {c: sim_ttft_us(base, workload(c)) / 1000 for c in (1, 32)}
    assert fit_request_path(base, none, workload).engine.request_latency_us == 0  # no path: none read
    assert fit_request_path(base, none, workload).engine.request_serial_us == 0
    fitted = fit_request_path(base, ttft_ms, workload).engine
    assert abs(fitted.request_latency_us - 8000) <= 50
    assert fitted.request_serial_us == pytest.approx(700, rel=0.25)
    # One concurrency: the latency alone; a path shorter than the model's own TTFT: none.
    assert fit_request_path(base, {1: ttft_ms[1]}, workload).engine.request_serial_us == 0
    assert fit_request_path(base, {1: 0.1}, workload).engine.request_latency_us == 0


@pytest.mark.parametrize("lost", [True, False])
def test_the_fit_reads_a_resume_that_loses_its_drafts_apart_from_the_drafter(tmp_path, lost):
    """A server whose first drafted step after depth 0 accepts nothing (the ``kv`` off switch)
    is fitted as such (``with_resume_loss``) and its drafter's acceptance from the other steps;
    a server without that loss is not (its off switch resumed warm), and the fitted acceptance
    is the same either way."""
    from controller.traces import TraceWriter
    from env.acceptance import with_resume_loss
    from env.engine import Engine
    from env.fit import resume_acceptance

    params = load_deployment("h200-llama8b")
    truth = replace(params.acceptance, stale_logit=0.0, drift_sd=0.0, p_zero=0.0)
    params = replace(params, acceptance=with_resume_loss(truth) if lost else truth)
    eng = Engine(params, "closed:8")
    eng.reset(0)
    plan = [0, 0, 3, 3, 3, 3]  # a resume every 6 steps
    recs = []
    with TraceWriter(tmp_path, "resumes", start_ns=1) as w:
        for i in range(3000):
            rec = eng.step(plan[i % len(plan)])
            recs.append(rec)
            w.write(rec.to_wire(), rec.ts_ns)
    first, n, other, _ = resume_acceptance([[(r.depth, r.accept) for r in recs]])
    assert n == 500 and other > 0.5
    # (a request admitted at the resume itself had no step at depth 0, and keeps its drafts)
    assert (first < 0.01) if lost else (first == pytest.approx(other, abs=0.05))
    fitted, report = fit_sim(str(tmp_path), [])
    assert any("a resume loses its drafts" in f for f in report.fitted) == lost
    assert (fitted.acceptance.stale_logit == 30.0) == lost
    # Resumes that keep their drafts on the hook's kv off switch: it resumed warm, and the
    # simulator inserts its depth-0 step; a loss says it resumed cold, and the loss stands in.
    assert fitted.engine.warm_resume == (not lost)
    if not lost:
        assert not fit_sim(str(tmp_path), [], off_draft="keep")[0].engine.warm_resume  # keep inserts nothing
    # The drafter as the other steps show it, resumes or not: its first position's mean rate.
    assert marginal_conditionals(fitted.acceptance)[0] == pytest.approx(marginal_conditionals(truth)[0], abs=0.05)


@pytest.mark.parametrize("truth", [0.0, 1.0])
def test_the_fall_with_context_is_the_one_the_steps_show(truth):
    """Simulated steps at 256, 4,000 and 12,000 tokens of prompt (depth 3) whose drafter falls
    with context by ``truth``: fitted from the published fall (1.47), the most likely fall is
    the true one, and the population stays what it was (a drafter that does not fall must not
    come out as a wide population, as AQ's records did with the fall held fixed)."""
    from env.engine import Engine
    from env.fit import accept_counts, fit_context_fall

    base = load_deployment("h200-llama8b")
    ap_true = replace(base.acceptance, ctx_logit=truth, sigma=0.4, p_zero=0.3, drift_sd=0.0)
    steps = []
    for i, prompt in enumerate((256, 4000, 12000)):
        eng = Engine(replace(base, acceptance=ap_true), f"closed:4@prompt={prompt},output=300")
        eng.reset(i)
        steps += [eng.step(3) for _ in range(1200)]
    start = replace(ap_true, ctx_logit=base.acceptance.ctx_logit)
    fitted, line = fit_context_fall(steps, start)
    assert fitted.ctx_logit == pytest.approx(truth, abs=0.25), line
    assert "most likely" in line
    ap, _ = fit_acceptance(accept_counts(steps, fitted), fitted, step_weighted=True)
    assert ap.sigma < 1.5 and 0.15 < ap.p_zero < 0.45
    # Steps all at one context cannot tell a fall from alpha: the base's stays.
    one = Engine(replace(base, acceptance=ap_true), "closed:4@prompt=6000,output=200")
    one.reset(0)
    kept, why = fit_context_fall([one.step(3) for _ in range(500)], start)
    assert kept.ctx_logit == start.ctx_logit and why == ""


def test_no_kv_rate_is_fitted_faster_than_the_gpu_copies(tmp_path):
    """``copy_tb_s`` (``controller fit --copy-tb-s``): every per-token KV coefficient comes out at
    or above one token of one layer's KV copied at that bandwidth, even where the records, all at
    short contexts, would take it lower; a bandwidth that is not positive is refused."""
    from env.errors import FitError
    from env.fit import fit_sim
    from env.latency import KV_NAMES, kv_floor_us_per_tok

    base = load_deployment("h200-llama8b")
    floor = kv_floor_us_per_tok(base.engine.kv_bytes_per_token, base.latency.layers, 0.5)  # a slow GPU
    assert floor > 3 * max(getattr(base.latency, n) for n in ("dec_kv1_us_per_tok", "split_kv1_us_per_tok"))
    fitted, _ = fit_sim(str(EXAMPLES / "h200-llama8b"), [], copy_tb_s=0.5)
    assert fitted.latency.kv_floor_us_per_tok == pytest.approx(floor)
    assert min(getattr(fitted.latency, n) for n in KV_NAMES) >= floor * (1 - 1e-6)
    free, _ = fit_sim(str(EXAMPLES / "h200-llama8b"), [], base=replace(base, latency=replace(base.latency, kv_floor_us_per_tok=0.0)))
    assert min(getattr(free.latency, n) for n in KV_NAMES) < floor
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(FitError, match="copy_tb_s"):
            fit_sim(str(EXAMPLES / "h200-llama8b"), [], copy_tb_s=bad)
