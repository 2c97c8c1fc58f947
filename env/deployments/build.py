"""Rebuild the bundled deployments: ``python -m env.deployments.build [--reference DIR]``.

``DIR`` holds ``h200_llama8b/latency.csv`` (by default ``env/profiles``, the shipped copy of
the shared reference data's measurement; a ``../shared/reference`` folder works too) and the
real H200 traces ``env/example_traces/h200-real-*`` (shipped). Every
number below is fitted to a file, read off a published figure, or derived from a shape by
arithmetic that the JSON's ``notes`` spell out.

- ``h200-llama8b``: the latency model's pass shapes fitted to the H200 profile (all rows), then
  fitted to the real SGLang server (:func:`fit_to_server`: its traced k > 0 steps and the off
  switch's depth-0 TPOT); depth 0 as the off switch; acceptance calibrated to the published
  Llama-3.1-8B + EAGLE-3 figures.
- ``h200-llama8b-longctx``: the same GPU and model serving 8k-32k-token prompts with the
  H200's whole KV pool, which binds (about 45 such requests fit).
- ``h200-70b``: a Llama-3.1-70B-shaped target (FP8 weights, to fit one H200) whose GEMM and
  attention terms are the 8B fit scaled by the roofline (bytes and FLOPs of the shape).
- ``seed``: the seed document's deployment (model and GPUs unnamed), solved from its five
  published figures (docs/simulator.md): a decode step of 10.8 ms at batch 1 (92.6 tok/s), a
  per-token cost that makes batches compute-bound (the ≈773 tok/s plateau), and an EAGLE-3
  step (3 chained drafts + a 4-token verify + draft extend) costing 2.5× a decode at batch 1 —
  which with the benchmark's accept length 2.10 gives 77.5 tok/s and with the fixed prompt's
  2.60 gives 96.1.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from env.acceptance import (
    AcceptanceParams,
    calibrate_context,
    calibrate_to_conditionals,
    harmonic_accept_length,
    mean_accept_length,
)
from env.latency import (
    H200_8B_KV_FLOOR_US_PER_TOK,
    KV_NAMES,
    OFF_EXTEND,
    LatencyParams,
    fit_profile,
    prefill_pairs,
    prefill_us,
    read_profile,
    step_time_us,
)
from env.params import EngineParams, SimParams
from env.workload import WorkloadParams

_HERE = Path(__file__).resolve().parent
DEFAULT_REFERENCE = _HERE.parent / "profiles"

# Llama-3.1-8B + EAGLE-3 on the H200 (reference/h200_llama8b/device.json; the off-switch runs'
# server logs, bench/results/realgpu/offswitch/README.md).
KV_BYTES_8B = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16 = 131072
DRAFT_KV_BYTES = 1 * 8 * 128 * 2 * 2  # the draft head's one layer: 4096 (3.1% of the target's)
DRAFT_WEIGHT_BYTES_8B = 1.04e9  # measured in the server log (SGLang 0.5.17)
# SGLang's own depth 0 (a width-1 verify + the draft extend) over a plain server, tok/s, triton,
# closed loop, prompt 256, output 128 (offswitch README, call 1): C -> ratio.
VERIFY0_RATIO = {1: 0.723, 4: 0.707, 16: 0.588, 64: 0.407, 128: 0.398}
OFFSWITCH_CTX_PER_SEQ = 256 + 64  # the prompt and half the 128-token output, on average
# Accepted length (bonus included) falling with context: 2.30 at 2k tokens, 1.08 at 20k, as
# users report it (reference/acceptance.md); read as a 3-token chain, SGLang's default.
CTX_POINTS = ((2000.0, 2.30), (20000.0, 1.08))
# Code and math accept more than chat: 3.4-3.5 tokens at k = 7 (EAGLE-3 model card).
CODE_ACCEPT_LEN_K7 = 3.45


def _solve_shift(ap: AcceptanceParams, depth: int, target_len: float) -> float:
    """Logit shift s whose harmonic-mean accept length (what throughput sees) is target_len."""
    lo, hi = -6.0, 6.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if harmonic_accept_length(ap, depth, mid) < target_len:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def h200_acceptance() -> AcceptanceParams:
    """MT-Bench conditionals 0.73/0.71/0.68 at k = 3, code at 3.45 tokens (k = 7), and the fall
    with context (2.30 at 2k, 1.08 at 20k)."""
    ap = calibrate_to_conditionals([0.73, 0.71, 0.68], AcceptanceParams())
    lo, hi = 0.0, 4.0  # code_shift: the logit offset whose mean accept length at k = 7 is 3.45
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_accept_length(ap, 7, mid) < CODE_ACCEPT_LEN_K7 else (lo, mid)
    ap = replace(ap, code_shift=round(0.5 * (lo + hi), 4))
    return calibrate_context(ap, 3, CTX_POINTS)


def _verify0_from_ratios(lp: LatencyParams) -> LatencyParams:
    """``v0_fix_us``/``v0_seq_us`` such that SGLang's depth 0 runs at the measured fraction of a
    plain server (:data:`VERIFY0_RATIO`), least squares on the log ratio over the five C."""
    plain = replace(lp, off_path="plain", off_extend=False)
    cs = np.array(sorted(VERIFY0_RATIO), dtype=float)
    t_plain = np.array([step_time_us(plain, int(c), 0, c * OFFSWITCH_CTX_PER_SEQ) for c in cs])
    base = replace(lp, off_path="verify", v0_fix_us=0.0, v0_seq_us=0.0)
    t_base = np.array([step_time_us(base, int(c), 0, c * OFFSWITCH_CTX_PER_SEQ) for c in cs])
    want = t_plain / np.array([VERIFY0_RATIO[int(c)] for c in cs])  # the verify step's time
    # want - t_base = v0_fix + v0_seq * C: linear, weighted to fit ratios (relative error).
    a = np.stack([np.ones_like(cs), cs], axis=1) / want[:, None]
    (fix, seq), *_ = np.linalg.lstsq(a, (want - t_base) / want, rcond=None)
    return replace(lp, v0_fix_us=round(max(float(fix), 0.0), 1), v0_seq_us=round(max(float(seq), 0.0), 2))


# The real H200 server (SGLang 0.5.17, triton, EAGLE-3, an 8B-shaped target; recorded by the hook):
# its speculative steps (k > 0) are what the deployment's k > 0 steps are fitted to.
REAL_TRACES = tuple(_HERE.parent / "example_traces" / f"h200-real-{lvl}" for lvl in ("rand", "same", "noisy"))
# The off switch at depth 0, the drafter's extend kept (triton, after the draft-extend width fix):
# mean TPOT (ms) at C of bench/results/realgpu/offswitch/call2-triton.csv (static:0 rows of both
# repetitions and the switch test's scripted-static:0 rows). Closed loop, prompt 256, output 128,
# every request of a wave admitted together: a request's TPOT is the decode steps at batch C it
# ran in (its wave's prefill is its TTFT); the same call's depth-3 TPOT (9.65 ms at C = 16,
# 21.38 at 64) is within 2% of the traced prefill-free depth-3 step (9.62, 21.74), so TPOT is
# read as the step time, at 256 + 64 cached tokens per sequence.
OFFSWITCH_TPOT_MS = {1: 5.025, 4: 5.111, 16: 5.592, 64: 7.893, 128: 11.562}
# Bytes of the 8B's weights over the probed copy bandwidth (4.24 TB/s): no pass reads them faster.
W_FLOOR_US_8B = 15.01e9 / 4.24e12 * 1e6
# FLOPs per token of the 8B (2 x 8.03e9) at the H200's dense bf16 peak (989 TFLOP/s): no token
# is computed faster.
F_FLOOR_US_8B = 2 * 8.03e9 / 989e12 * 1e6
# One cold 32,768-token prompt's prefill on the H100 testbed (SGLang 0.5.17, triton, chunks of
# 8,192): call AQ's eight such prompts at C = 8 were prefilled one after another, at a mean time
# to first token of 11.857 s = (1 + ... + 8) / 8 = 4.5 prefills (static:0's point,
# bench/results/realgpu/h100/longctx/points-aq.json). A prefill this long is compute-bound and the
# H200 has the H100's compute, so it prices the H200's prompts' attention too (pf_pair_us). Held
# out (calls AS and AT, the same README): seven uncached 32k prompts in a row took 2.65 s each,
# and lone prompts of 2k-32k, priced with the prefix their records show cached, within -12%..+3%.
PREFILL_32K_US = 11.857e6 / 4.5
# The pass terms the fit to the server scales, one factor per class (the profile's shape kept
# within a class). Not scaled: the per-cached-token terms (every traced step holds about 320
# tokens per sequence, so the traces cannot tell them from the per-sequence ones; the profile's
# KV rates stand) and prefill (its chunks are not in the fitted steps).
SERVER_CLASSES = (
    ("launch", ("t_fix_us", "split_fix_us", "mq_fix_us")),
    ("weights", ("w_us",)),
    ("per_token", ("f_us_per_tok", "tok_us_per_tok", "split_seq_us", "mq_seq_us")),
    ("draft_fixed", ("d_fix_us", "d_fc_us", "d_w_us")),
    ("draft_per_token", ("d_f_us_per_tok", "d_tok_us_per_tok")),
)
# Fitted in absolute terms (µs): the per-step overheads, SGLang's verify cost per request, and
# the decode kernel's per-layer terms (the triton decode kernel, not the profile's).
SERVER_TERMS = (
    ("oh_us", 1000.0),
    ("oh_spec_us", 1000.0),
    ("oh_req_us", 10.0),
    ("verify_seq_us", 100.0),
    ("dec_fix_us", 10.0),
    ("dec_seq_us", 1.0),
)
PLAIN_WEIGHT = 10.0  # each off-switch point against the ~4000 traced steps (log residuals)


def server_steps(traces: tuple[Path, ...] = REAL_TRACES) -> tuple[np.ndarray, ...]:
    """``bs, depth, ctx, us`` of the real traces' prefill-free speculative (k > 0) steps.

    Their depth-0 steps ran SGLang's own depth 0 (a width-1 verify), not the off switch the
    deployment runs, so they are left out (``bench/deployment_vs_traces.py`` shows them).
    """
    bs, depth, ctx, us = decode_steps(traces)
    k = depth > 0
    return bs[k], depth[k], ctx[k], us[k]


def decode_steps(traces: tuple[Path, ...]) -> tuple[np.ndarray, ...]:
    """``bs, depth, ctx, us`` of every prefill-free decode step of the trace folders ``traces``."""
    from env.fit import decode_step_arrays, load_steps

    return decode_step_arrays([s for d in traces for v in load_steps(str(d)).values() for s in v])


def _fit_steps(
    lp: LatencyParams,
    classes: tuple[tuple[str, tuple[str, ...]], ...],
    terms: tuple[tuple[str, float], ...],
    sets: list[tuple[np.ndarray, ...]],
    z0: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
) -> LatencyParams:
    """``lp`` with one scale per class of ``classes`` and the absolute ``terms`` (name, unit of
    the free variable) fitted by one least squares on log step time (soft-L1, as
    ``env.fit.fit_step_latency``): over ``sets`` of prefill-free steps (``bs, depth, ctx, us``),
    each set weighing the same in the sum however many steps it holds, and over the off switch's
    depth-0 TPOT at C = 1..128 (:data:`OFFSWITCH_TPOT_MS`, the drafter's extend kept as it ran,
    each point weighted :data:`PLAIN_WEIGHT`). The variables start at ``z0`` within ``lo``-``hi``
    (the classes' log scales first)."""
    from scipy.optimize import least_squares

    from env.fit import scale_classes
    from env.latency import step_times_us

    bs, depth, ctx, us = (np.concatenate([part[i] for part in sets]) for i in range(4))
    weight = np.concatenate([np.full(len(part[3]), np.sqrt(len(us) / (len(sets) * len(part[3])))) for part in sets])
    pc = np.array(sorted(OFFSWITCH_TPOT_MS), dtype=float)
    pus = np.array([OFFSWITCH_TPOT_MS[int(c)] for c in pc]) * 1000.0
    pz = np.zeros_like(pc)
    ng = len(classes)

    def make(z: np.ndarray) -> LatencyParams:
        return scale_classes(lp, classes, z[:ng], {n: float(v * unit) for (n, unit), v in zip(terms, z[ng:])})

    def resid(z: np.ndarray) -> np.ndarray:
        m = make(z)
        spec = weight * np.log(np.maximum(step_times_us(m, bs, depth, ctx, np.zeros_like(bs)), 1.0) / us)
        keep = replace(m, off_extend=OFF_EXTEND["keep"])  # as call 2's depth 0 ran
        plain = np.log(np.maximum(step_times_us(keep, pc, pz, pc * OFFSWITCH_CTX_PER_SEQ, pz), 1.0) / pus)
        return np.clip(np.concatenate([spec, PLAIN_WEIGHT * plain]), -20.0, 20.0)

    z0 = np.clip(z0, lo, hi)
    sol = least_squares(resid, z0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, max_nfev=200, x_scale="jac")
    return make(sol.x)


def fit_to_server(lp: LatencyParams, traces: tuple[Path, ...] = REAL_TRACES, n_steps: int = 4000) -> LatencyParams:
    """Fit the pass classes and the server terms to the real server, from the profile's shape.

    :func:`_fit_steps` over the traced speculative steps (``n_steps`` of them, evenly spaced)
    and the off switch's depth-0 TPOT at C = 1..128. The k > 0
    steps alone cannot split the constant per step between the passes every step runs and the
    speculative overhead; the plain points can. ``w_us`` is held at or above
    :data:`W_FLOOR_US_8B`, ``f_us_per_tok`` at or above :data:`F_FLOOR_US_8B`. The result keeps ``lp``'s depth-0 path (the off switch, extend kept).
    """
    bs, depth, ctx, us = server_steps(traces)
    idx = np.linspace(0, len(us) - 1, min(n_steps, len(us))).astype(int)
    lp = replace(lp, off_path="plain", off_extend=True)
    ng = len(SERVER_CLASSES)
    z0 = np.concatenate([np.zeros(ng), [0.3, 1.0, 0.2, 1.0, lp.dec_fix_us / 10.0, 0.0]])
    lo = np.concatenate([np.full(ng, -5.0), np.zeros(len(SERVER_TERMS))])
    hi = np.concatenate([np.full(ng, 5.0), np.full(len(SERVER_TERMS), 1e4)])
    classes = [name for name, _ in SERVER_CLASSES]
    lo[classes.index("weights")] = np.log(W_FLOOR_US_8B / lp.w_us)
    lo[classes.index("per_token")] = np.log(F_FLOOR_US_8B / lp.f_us_per_tok)
    out = _fit_steps(lp, SERVER_CLASSES, SERVER_TERMS, [(bs[idx], depth[idx], ctx[idx], us[idx])], z0, lo, hi)
    rounded: dict[str, Any] = {n: round(float(getattr(out, n)), 4) for n, _ in SERVER_TERMS}
    return replace(out, **rounded)


# The same server on the testbed with prompts of 8k-32k tokens (calls AV and AW): the only H200
# steps whose contexts spread, so the only ones that tell the long-context terms apart.
LONG_TRACES = (_HERE.parent / "example_traces" / "h200-real-longctx",)
# Fitted to the long-context steps, in absolute terms (µs), or as one scale of the first wave's KV
# rates: those steps run at batch 1-16, one wave, so they tell nothing of the later waves' rates.
LONG_TERMS = (
    ("verify_seq_us", 100.0), ("verify_ctx_us_per_tok", 1.0), ("dec_walk_us_per_tok", 0.01), ("oh_spec_us", 1000.0),
)  # fmt: skip
LONG_CLASSES = (("kv1", tuple(n for n in KV_NAMES if "_kv1_" in n)),)


def fit_long_context(
    lp: LatencyParams, traces: tuple[Path, ...] = REAL_TRACES, long: tuple[Path, ...] = LONG_TRACES
) -> LatencyParams:
    """``lp`` (priced as the off switch ``kv``) with the terms only long contexts show fitted:
    SGLang's verify cost per request and its extend kernel's loop over each request's prefix
    (``verify_seq_us``, ``verify_ctx_us_per_tok``), the decode kernel's walk through one
    sequence's tokens (``dec_walk_us_per_tok``) and one scale of the first wave's KV rates, at or
    above ``lp.kv_floor_us_per_tok``; and the speculative step's overhead ``oh_spec_us`` again, which
    :func:`fit_to_server` had fitted with the loop's share at 320 tokens in it.

    :func:`_fit_steps` over every prefill-free step of ``long`` (closed loops at 256 to
    32,768-token prompts) and the k > 0 steps of ``traces`` (those :func:`fit_to_server` fitted,
    320 tokens a sequence), each set weighted alike, and the off switch's depth-0 TPOT: the loop
    and the per-request cost must be told apart at every context, or the loop's share at 320
    tokens would be counted twice. Every other term stays as ``lp`` has it.
    """
    from env.fit import kv_floor_log_scale

    floor = kv_floor_log_scale(lp, LONG_CLASSES[0][1])
    lo = np.array([-5.0 if floor is None else floor, 0.0, 0.0, 0.0, 0.0])
    hi = np.array([5.0, 1e4, 1e4, 1e4, 1e4])
    z0 = np.array([0.0, lp.verify_seq_us / 100.0, 1.0, 1.0, lp.oh_spec_us / 1000.0])
    # Every step of ``long``, depth 0 included: those servers ran the off switch, the deployment's own.
    out = _fit_steps(lp, LONG_CLASSES, LONG_TERMS, [decode_steps(long), server_steps(traces)], z0, lo, hi)
    rounded: dict[str, Any] = {n: round(float(getattr(out, n)), 6) for n in (*KV_NAMES, *(t for t, _ in LONG_TERMS))}
    return replace(out, **rounded)


def h200_latency(reference: Path, traces: tuple[Path, ...] = REAL_TRACES) -> LatencyParams:
    """The profile's pass shapes, fitted to the real server (:func:`fit_to_server`); SGLang's own
    depth 0 (``off_path`` verify) from the off switch's throughput ratios; depth 0 priced as the
    hook's default off switch (``kv``)."""
    df = read_profile(str(reference / "h200_llama8b" / "latency.csv"))
    base = LatencyParams(
        oh_us=300.0, oh_spec_us=1000.0, oh_req_us=2.0, off_path="plain", off_extend=True, jitter=0.01
    )
    lp, _ = fit_profile(df, base)
    # Fitted to the server that ran depth 0 with the drafter's extend kept; priced for the
    # hook's default since, which stores only the drafter's keys and values (kv).
    lp = replace(fit_to_server(lp, traces), off_extend=OFF_EXTEND["kv"], kv_floor_us_per_tok=H200_8B_KV_FLOOR_US_PER_TOK)
    lp = _verify0_from_ratios(fit_long_context(lp, traces))
    return with_prefill_attention(replace(lp, f_floor_us_per_tok=F_FLOOR_US_8B))


def with_prefill_attention(lp: LatencyParams, prompt: int = 32768, measured_us: float = PREFILL_32K_US) -> LatencyParams:
    """``lp`` with ``pf_pair_us`` set so that one cold ``prompt`` prefills in ``measured_us``:
    what the pass terms do not price of it is its attention, quadratic in its length."""
    rest = measured_us - prefill_us(replace(lp, pf_pair_us=0.0), prompt)
    return replace(lp, pf_pair_us=max(rest, 0.0) / (lp.layers * prefill_pairs(prompt)))


def _h200_engine(instance: str, budget: int, running: int = 256) -> EngineParams:
    return EngineParams(
        max_running_requests=running,
        kv_budget_tokens=budget,
        chunked_prefill_tokens=8192,
        instance=instance,
        kv_bytes_per_token=float(KV_BYTES_8B),
        draft_kv_bytes_per_token=float(DRAFT_KV_BYTES),
        draft_weight_bytes=DRAFT_WEIGHT_BYTES_8B,
    )


_H200_NOTES = (
    "Latency: the pass shapes of reference/h200_llama8b/latency.csv (plain PyTorch, CUDA graphs; attention per "
    "kernel with a first-wave/later-wave KV rate, wave_seqs = 132 SMs / 8 KV heads), fitted to the real server "
    "(SGLang 0.5.17, triton, EAGLE-3, an 8B-shaped target on one H200): one scale per pass class (launches, "
    "weight read held at or above 15 GB / 4.24 TB/s, per token with the GEMM at or below the 989 TFLOP/s peak, draft fixed, draft per token), the overheads "
    "oh_us, oh_spec_us, oh_req_us, SGLang's verify cost per request verify_seq_us and the decode kernel's "
    "dec_fix_us/dec_seq_us, by one least squares over the prefill-free k > 0 steps of "
    "env/example_traces/h200-real-{rand,same,noisy} and the off switch's depth-0 TPOT at C = 1/4/16/64/128 "
    "(5.03/5.11/5.59/7.89/11.56 ms, bench/results/realgpu/offswitch call 2, read as the step time at batch C). "
    "Then the terms only long contexts show, by a second least squares (fit_long_context) over every "
    "prefill-free step of env/example_traces/h200-real-longctx (the same server on the testbed, prompts of "
    "256 to 32,768 tokens, off switch kv; calls AV and AW) and the k > 0 steps above, each set weighted alike: "
    "SGLang's verify cost per request verify_seq_us, its extend kernel's loop over each request's prefix "
    "verify_ctx_us_per_tok (one loop per wave of ext_wave_seqs = 132 SMs / 32 query heads requests), the decode "
    "kernel's walk through one sequence's tokens dec_walk_us_per_tok, oh_spec_us again, and one scale of the profile's first-wave KV rates, "
    "at or above one token of one layer's KV copied at 4.24 TB/s (kv_floor_us_per_tok, which fits to traces keep). "
    "Depth 0 = the off switch (off_path plain), fitted with the "
    "drafter's extend kept and priced as the hook's default, kv: off_extend 0.1 of that extend "
    "(env.latency.OFF_EXTEND); v0_fix_us/v0_seq_us (SGLang's own depth 0, off_path verify) solved so that path runs at "
    "0.72/0.71/0.59/0.41/0.40 x a plain server at C = 1/4/16/64/128 (bench/results/realgpu/offswitch, call 1). "
    "Prefill: the profile's terms, not fitted to the server, and a prompt's attention quadratic in its length "
    "(pf_pair_us) set so that one cold 32k-token prompt prefills in 2.63 s, as on the H100 testbed (call AQ's "
    "time to first token); fits to traces keep f_us_per_tok at or above the 989 TFLOP/s peak (f_floor_us_per_tok). "
    "KV: 128 KB/token target, the drafter's 4 KB/token and 1.04 GB of weights carried (spec_kv_budget_tokens). "
    "Acceptance: the published Llama-3.1-8B + EAGLE-3 MT-Bench conditionals 0.73/0.71/0.68, code_shift for "
    "3.45 tokens at k = 7 (code/math), falling with context to 2.30 tokens at 2k and 1.08 at 20k (k = 3) "
    "(reference/acceptance.md)."
)


def build_h200(reference: Path) -> SimParams:
    return SimParams(
        latency=h200_latency(reference),
        acceptance=h200_acceptance(),
        workload=WorkloadParams(
            presets={"chat": "closed:32", "code": "closed:32@accept_shift=0.8", "bursty": "burst:2,40,30,0.2"}
        ),
        engine=_h200_engine("h200-llama8b", 800_000),
        name="h200-llama8b",
        notes=_H200_NOTES,
    )


# The H200's KV pool for the 8B target under SGLang: 141 GB x 0.88 (mem fraction) - 15.0 GB of
# weights - about 4 GB of activations and CUDA graphs = 105 GB = 800k tokens of 128 KB.
H200_POOL_TOKENS_8B = 800_000


def build_h200_longctx(reference: Path, h200: SimParams | None = None) -> SimParams:
    h200 = h200 or build_h200(reference)
    return replace(
        h200,
        workload=WorkloadParams(
            prompt_median_tokens=16000.0,
            prompt_sigma=0.45,
            prompt_min_tokens=8192,
            prompt_max_tokens=32768,
            output_median_tokens=400.0,
            output_sigma=0.6,
            output_min_tokens=16,
            output_max_tokens=2048,
            presets={"rag": "closed:48", "bursty": "burst:4,64,30,0.3", "docs": "poisson:2"},
        ),
        engine=_h200_engine("h200-llama8b-longctx", H200_POOL_TOKENS_8B),
        name="h200-llama8b-longctx",
        notes=(
            "The h200-llama8b GPU, model and latency fit serving long contexts: prompts log-normal around 16k "
            "tokens (8k-32k), outputs around 400. KV budget the H200's pool for this target (141 GB x 0.88 - "
            "15 GB weights - ~4 GB activations/graphs = 105 GB = 800k tokens of 128 KB), less the drafter's "
            "memory (spec_kv_budget_tokens: 4 KB/token and 1.04 GB): about 45 such requests fit, so the "
            "budget binds before the 256-request limit. At these lengths attention dominates the step and "
            "acceptance falls with context (the h200-llama8b acceptance model: 2.30 tokens at 2k, 1.08 at 20k). "
            "The long-context terms are the h200-llama8b fit's to the same server at 8k-32k tokens a sequence "
            "(env/example_traces/h200-real-longctx): a drafted step there costs 4-12x a depth-0 one, SGLang's "
            "extend kernel looping over each request's prefix, one loop per wave of 4 requests; "
            "a prompt's prefill attention is quadratic in its length (pf_pair_us, from one cold 32k prompt's "
            "2.63 s on the H100 testbed, call AQ: about 0.5 s of attention per 16k prompt)."
        ),
    )


# Llama-3.1-70B: hidden 8192, 80 layers, 64 query / 8 KV heads, head dim 128, MLP 28672, vocab
# 128256: 70.6e9 parameters. Llama-3.1-8B: 8.03e9 (the profiled target, 15.0 GB in bf16).
PARAMS_8B, PARAMS_70B = 8.03e9, 70.6e9
WEIGHT_BYTES_8B, WEIGHT_BYTES_70B = 15.01e9, 70.6e9  # bf16 as profiled; FP8 for 70B (one byte)
KV_BYTES_70B = 80 * 8 * 128 * 2 * 2  # 327680: 2.5 x the 8B's per token
DRAFT_WEIGHT_BYTES_70B = 2.64e9  # one 8192-wide layer + 3x8192->8192 fc + 32000-token head, bf16
DRAFT_SCALE_70B = 2.64e9 / 0.85e9  # draft weight bytes (and FLOPs) over the 8B draft head's


def build_h200_70b(reference: Path, h200: SimParams | None = None) -> SimParams:
    h200 = h200 or build_h200(reference)
    lp = h200.latency
    # Roofline scaling of the 8B fit (the 8B's achieved fractions of bandwidth and FLOP rate kept):
    # weight read ∝ weight bytes; compute per token ∝ FLOPs per token / peak (FP8 runs at twice the
    # bf16 rate, so the 70B's 8.8x FLOPs cost 4.4x); per-token elementwise work and per-pass
    # launches ∝ layers x hidden and layers; attention per layer unchanged (the same 8 KV heads of
    # 128, 4 KB per token per layer, the same wave of 132 / 8 sequences) over 80 layers.
    layer_ratio = 80 / 32
    width_ratio = layer_ratio * 8192 / 4096
    lat = replace(
        lp,
        w_us=lp.w_us * WEIGHT_BYTES_70B / WEIGHT_BYTES_8B,
        f_us_per_tok=lp.f_us_per_tok * (PARAMS_70B / PARAMS_8B) / 2.0,
        tok_us_per_tok=lp.tok_us_per_tok * width_ratio,
        t_fix_us=lp.t_fix_us * layer_ratio,
        layers=80.0,
        d_w_us=lp.d_w_us * DRAFT_SCALE_70B,
        d_f_us_per_tok=lp.d_f_us_per_tok * DRAFT_SCALE_70B,
        d_fc_us=lp.d_fc_us * 4.0,  # the fc is 4x the 8B's (8192^2 vs 4096^2 per input)
        d_tok_us_per_tok=lp.d_tok_us_per_tok * 2.0,
        # SGLang's verify runs a query tile per (request, query head, layer): 64 heads x 80 layers.
        verify_seq_us=lp.verify_seq_us * layer_ratio * 64 / 32,
        # ... and its loop over each request's prefix per layer, 132 SMs / 64 query heads side by side.
        verify_ctx_us_per_tok=lp.verify_ctx_us_per_tok * layer_ratio,
        ext_wave_seqs=132 / 64,
        # A prompt's attention per token pair and layer: its FLOPs go with the query heads (64 / 32).
        pf_pair_us=lp.pf_pair_us * 64 / 32,
        f_floor_us_per_tok=2 * PARAMS_70B / (2 * 989e12) * 1e6,  # FP8 at twice the bf16 peak
        rel_se=lp.rel_se,
    )
    # KV pool: 141 GB x 0.9 - 70.6 GB of FP8 weights - ~5 GB activations/graphs = 51 GB of 320 KB.
    budget = int(51e9 // KV_BYTES_70B)
    return replace(
        h200,
        latency=lat,
        engine=EngineParams(
            max_running_requests=256,
            kv_budget_tokens=budget,
            chunked_prefill_tokens=8192,
            instance="h200-70b",
            kv_bytes_per_token=float(KV_BYTES_70B),
            draft_kv_bytes_per_token=float(DRAFT_KV_BYTES),
            draft_weight_bytes=DRAFT_WEIGHT_BYTES_70B,
        ),
        name="h200-70b",
        notes=(
            "A Llama-3.1-70B-shaped target (80 layers, hidden 8192, 64/8 heads; FP8 weights, 70.6 GB, to fit "
            "one H200) with a one-layer EAGLE-3 head (2.64 GB bf16), derived from the h200-llama8b fit by "
            "roofline scaling, not measured: w_us x weight bytes (70.6/15.0 GB), f_us_per_tok x FLOPs per "
            "token (8.8x) / 2 (FP8 at twice the bf16 rate, the 8B's achieved fraction kept), tok_us_per_tok x "
            "layers x hidden (5x), t_fix_us x layers (2.5x), attention per layer unchanged (the same 8 KV "
            "heads of 128: 4 KB per token per layer) over 80 layers; draft terms x its bytes (3.1x), fc x 4; "
            "SGLang's verify cost per request x query heads x layers (5x), its extend kernel's loop over a "
            "request's prefix x layers (2.5x) in waves of 132 SMs / 64 query heads; a prompt's attention per token pair "
            "x query heads (2x) over 80 layers. "
            f"Decode turns compute-bound near {lat.w_us / lat.f_us_per_tok:.0f} tokens per pass (8B: "
            f"{lp.w_us / lp.f_us_per_tok:.0f}). KV pool 141 GB x 0.9 - 70.6 - ~5 GB = "
            f"51 GB = {budget} tokens of 320 KB, less the drafter's memory. Overheads, depth-0 paths and "
            "acceptance as h200-llama8b (acceptance of a 70B's EAGLE-3 head assumed equal to the 8B's)."
        ),
    )


def build_seed() -> SimParams:
    # The seed's model is unnamed: one "layer" whose per-token KV cost is the whole model's, no
    # wave effect (first and later waves at the same rate), no draft-head GEMM or KV term.
    lp = LatencyParams(
        t_fix_us=0.0,
        w_us=9700.0,
        f_us_per_tok=1230.0,
        p=2.0,
        tok_us_per_tok=0.0,
        layers=1.0,
        dec_fix_us=0.0,
        dec_seq_us=0.0,
        dec_kv1_us_per_tok=0.01,
        dec_kv_us_per_tok=0.01,
        split_fix_us=0.0,
        split_seq_us=0.0,
        split_kv1_us_per_tok=0.01,
        split_kv_us_per_tok=0.01,
        split_q_rel=0.0,
        mq_fix_us=0.0,
        mq_seq_us=0.0,
        mq_kv1_us_per_tok=0.01,
        mq_kv_us_per_tok=0.01,
        d_fix_us=2500.0,
        d_fc_us=0.0,
        d_w_us=0.0,
        d_f_us_per_tok=0.0,
        d_tok_us_per_tok=140.0,
        d_layers=0.0,
        oh_us=1000.0,
        oh_spec_us=4200.0,
        oh_req_us=0.0,
        off_path="plain",
        off_extend=False,
        pf_attn_us_per_tok=0.0,
        pf_scale=0.02,
        jitter=0.02,
        rel_se={
            "w_us": 0.03,
            "f_us_per_tok": 0.05,
            "d_fix_us": 0.1,
            "d_tok_us_per_tok": 0.1,
            "oh_spec_us": 0.1,
        },
    )
    ap0 = replace(
        calibrate_to_conditionals([0.73, 0.71, 0.68], AcceptanceParams()), drift_sd=0.1, code_shift=0.8
    )
    # The benchmark's prompts: accept length 2.10 at the seed's 3-token chain; the single-stream
    # run's fixed prompt: 2.60 (the published MT-Bench figure for a 3-token chain).
    ap = replace(ap0, alpha=ap0.alpha + _solve_shift(ap0, 3, 2.10))
    fixed_shift = _solve_shift(ap, 3, 2.60)
    return SimParams(
        latency=lp,
        acceptance=ap,
        workload=WorkloadParams(
            prompt_median_tokens=256.0,
            prompt_sigma=0.3,
            output_median_tokens=256.0,
            output_sigma=0.3,
            presets={
                "single_stream": f"closed:1@prompt=256,output=256,accept_shift={fixed_shift:.4f}",
                "benchmark_c1": "closed:1",
            },
        ),
        engine=EngineParams(
            max_running_requests=64, kv_budget_tokens=200_000, chunked_prefill_tokens=8192, instance="seed"
        ),
        name="seed",
        notes=(
            "Calibrated to reference/seed_benchmark.md (SGLang v0.5.9, EAGLE-3 topk=1 3-token chain, spec-v2 "
            "overlap path; model and GPUs not named). Depth 0 = the server without speculation (off_path plain, "
            "no draft extend). Coefficients solved from the published figures, not fitted to traces. The "
            "drafter's memory is not declared (the model is unnamed; at 64 running requests of ~512 tokens "
            "the 200k-token budget never binds). No fall of acceptance with context (the benchmark's prompts "
            "are short)."
        ),
    )


def build_all(reference: Path) -> dict[str, SimParams]:
    h200 = build_h200(reference)
    return {
        "h200-llama8b": h200,
        "h200-llama8b-longctx": build_h200_longctx(reference, h200),
        "h200-70b": build_h200_70b(reference, h200),
        "seed": build_seed(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", default=str(DEFAULT_REFERENCE))
    args = ap.parse_args(argv)
    for name, params in build_all(Path(args.reference)).items():
        params.to_json(_HERE / f"{name}.json")
        print(f"wrote {_HERE / (name + '.json')}")


if __name__ == "__main__":
    main()
