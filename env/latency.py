"""Step-latency model: named physical terms, fitted to profile CSVs and per-step traces.

One forward pass of the target over ``B`` sequences with ``q`` new tokens each and
``C = Σ ctx`` tokens already cached (all times in µs)::

    target(B, q, C) = t_fix + gemm(N) + tok·N + attn(q, C)          N = B·q new tokens
    gemm(N)         = (w^p + (f·N)^p)^(1/p)   weights read once per pass  vs  compute per token
    attn(B, q, C)   = a0 + sq·B + kv·C + [q > 1]·min(aq + sqq·B + kvq·C + kvs·(q − 2)·C,  fq + fqkv·C)

``w`` is the time to stream the weights (memory-bound floor), ``f`` the compute per token
(roofline slope), ``p`` how sharply one regime hands over to the other, ``tok`` the
unfused per-token work (norms, RoPE, SwiGLU), ``kv`` the KV read per cached token, ``sq`` the
per-sequence cost of the attention kernel (work split per sequence), and the
``[q > 1]`` terms the verify: the faster of a split-KV kernel (``aq``, ``sqq``, ``kvq``, ``kvs``)
and the decode kernel re-reading the KV per query row (``fq``, ``fqkv``), as the profiled
target chose per shape. The draft
head is the same shape with its own coefficients::

    draft(B, q, C) = d_fix + [fc]·d_fc + d_tok·N + d_kv·C

One engine step at depth ``k`` (SGLang EAGLE-3, chain drafts, ``topk = 1``)::

    k > 0:  oh + oh_spec + oh_req·B + Σ_{i=1..k} draft(B, 1, C) [first with fc]
            + target(B, k + 1, C) + draft(B, k + 1, C) [draft extend after verify]
    k = 0:  oh + oh_req·B + target(B, 1, C) + [extend0]·draft(B, 1, C)

``extend0`` models SGLang ≥ 0.5.17, where depth 0 still runs a width-1 verify and a draft
extend so the drafter stays warm. Prefill of ``P`` prompt tokens between two decode steps
adds ``t_fix + pf_scale·(gemm(P) + tok·P) + a0 + pf_attn·P`` (chunked, one pass; ``pf_scale``
is 1 when the per-token terms are GPU work, below 1 where calibration shows the per-token cost
of decode is mostly per-output-token work that prefill does not pay).

Every term is linear in its coefficient except ``gemm``; extrapolation past the fitted range
is therefore linear in tokens and in cached context (no polynomial blow-up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from controller._jit import maybe_njit
from env.errors import FitError

TARGET_LOSS = "linear"
SIZE_WEIGHT_EXP = 0.0
ATTN_WEIGHT = 1.0  # attention-only rows pin the KV-read slope that long-context extrapolation rides on
PROFILE_COLUMNS = ("component", "batch", "q", "ctx", "median_ms")
KNOWN_COMPONENTS = (
    "target",
    "target_gemm",
    "target_attn_fa2",
    "target_attn_split",
    "draft",
    "draft_nofc",
)


@dataclass(frozen=True)
class LatencyParams:
    """Coefficients of the step-latency model (µs; per-token terms in µs per token).

    ``rel_se`` holds a relative standard error per coefficient (same names), used by
    domain randomization; missing names mean 0.
    """

    t_fix_us: float = 1000.0
    w_us: float = 3990.0
    f_us_per_tok: float = 22.8
    p: float = 4.0
    tok_us_per_tok: float = 3.0
    a0_us: float = 300.0
    sq_us_per_seq: float = 5.0
    kv_us_per_ctx_tok: float = 0.056
    aq_us: float = 400.0
    sqq_us_per_seq: float = 5.0
    kvq_us_per_ctx_tok: float = 0.015
    kvs_us_per_ctx_tok: float = 0.0005
    fq_us: float = 200.0
    fq_kv_us_per_ctx_tok: float = 0.2
    d_fix_us: float = 270.0
    d_fc_us: float = 25.0
    d_tok_us_per_tok: float = 2.2
    d_kv_us_per_ctx_tok: float = 0.0017
    oh_us: float = 300.0
    oh_spec_us: float = 200.0
    oh_req_us: float = 2.0
    extend0: bool = True
    pf_attn_us_per_tok: float = 0.02
    pf_scale: float = 1.0
    jitter: float = 0.01
    rel_se: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> LatencyParams:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FitError(f"latency params: unknown keys {sorted(unknown)}")
        return cls(**d)

    def perturb(self, rng: np.random.Generator, scale: float = 1.0) -> LatencyParams:
        """A draw around these coefficients: each × exp(N(0, (scale·rel_se)²))."""
        if scale <= 0.0 or not self.rel_se:
            return self
        changes: dict[str, Any] = {}
        for name, se in sorted(self.rel_se.items()):
            if se > 0.0 and name not in ("p", "jitter"):
                changes[name] = float(getattr(self, name) * math.exp(rng.normal(0.0, scale * se)))
        return replace(self, **changes)


# --------------------------------------------------------------------------- evaluation


def _gemm(w_us: Any, f_us_per_tok: Any, p: Any, n_tokens: Any) -> Any:
    """The GEMM term: a smooth max (sharpness ``p``) of reading the weights once and computing
    ``n_tokens`` new tokens. Scalars or numpy arrays; :data:`_gemm_kernel` is its compiled form."""
    return (w_us**p + (f_us_per_tok * n_tokens) ** p) ** (1.0 / p)


_gemm_kernel = maybe_njit(_gemm)


def gemm_us(lp: LatencyParams, n_tokens: np.ndarray | float) -> np.ndarray | float:
    """GEMM time of a pass over ``n_tokens`` new tokens: smooth max of weight read and compute."""
    return _gemm(lp.w_us, lp.f_us_per_tok, lp.p, n_tokens)


def attn_us(lp: LatencyParams, batch, q, ctx_tokens, kernel: str = "best"):
    """Attention time of a pass (all layers): KV read per cached token, verify kernel for q > 1.

    ``kernel``: ``"split"`` (the split-KV verify kernel), ``"fa2"`` (the decode kernel, which
    re-reads the KV per query row when q > 1) or ``"best"`` (the faster, as the profiled
    target and SGLang's backend selection do).
    """
    multi = np.asarray(q) > 1
    if kernel == "fa2":
        base = lp.a0_us + lp.sq_us_per_seq * batch + lp.kv_us_per_ctx_tok * ctx_tokens
        return base + np.where(multi, lp.fq_us + lp.fq_kv_us_per_ctx_tok * ctx_tokens, 0.0)
    if kernel == "best":
        split = attn_us(lp, batch, q, ctx_tokens, "split")
        return np.minimum(split, attn_us(lp, batch, q, ctx_tokens, "fa2"))
    base = lp.a0_us + lp.sq_us_per_seq * batch + lp.kv_us_per_ctx_tok * ctx_tokens
    extra = (
        lp.aq_us
        + lp.sqq_us_per_seq * batch
        + lp.kvq_us_per_ctx_tok * ctx_tokens
        + lp.kvs_us_per_ctx_tok * (np.asarray(q) - 2) * ctx_tokens
    )
    return base + np.where(multi, extra, 0.0)


def target_us(lp: LatencyParams, batch, q, ctx_tokens):
    """One target forward: ``batch`` sequences × ``q`` new tokens, ``ctx_tokens`` cached in all."""
    n = np.asarray(batch) * np.asarray(q)
    return lp.t_fix_us + gemm_us(lp, n) + lp.tok_us_per_tok * n + attn_us(lp, batch, q, ctx_tokens)


def draft_us(lp: LatencyParams, batch, q, ctx_tokens, fc: bool | np.ndarray = False):
    """One draft-head forward (``fc``: the first draft step, which runs the 3→1 fusion)."""
    n = np.asarray(batch) * np.asarray(q)
    return (
        lp.d_fix_us
        + np.where(fc, lp.d_fc_us, 0.0)
        + lp.d_tok_us_per_tok * n
        + lp.d_kv_us_per_ctx_tok * ctx_tokens
    )


def predict_component_ms(lp: LatencyParams, component: str, batch, q, ctx) -> np.ndarray:
    """Predict a profile row's ``median_ms`` (``ctx`` per sequence, as in the CSV)."""
    batch = np.asarray(batch, dtype=float)
    q = np.asarray(q, dtype=float)
    c = batch * np.asarray(ctx, dtype=float)
    if component == "target":
        us = target_us(lp, batch, q, c)
    elif component == "target_gemm":
        us = gemm_us(lp, batch * q)
    elif component == "target_attn_fa2":
        us = attn_us(lp, batch, q, c, "fa2")
    elif component == "target_attn_split":
        us = attn_us(lp, batch, q, c, "split")
    elif component == "draft":
        us = draft_us(lp, batch, q, c, True)
    elif component == "draft_nofc":
        us = draft_us(lp, batch, q, c, False)
    else:
        raise FitError(f"unknown profile component {component!r}; known: {', '.join(KNOWN_COMPONENTS)}")
    return np.asarray(us, dtype=float) / 1000.0


# --------------------------------------------------------------------------- fitting

_TARGET_NAMES = (
    "t_fix_us",
    "w_us",
    "f_us_per_tok",
    "tok_us_per_tok",
    "a0_us",
    "sq_us_per_seq",
    "kv_us_per_ctx_tok",
    "aq_us",
    "sqq_us_per_seq",
    "kvq_us_per_ctx_tok",
    "kvs_us_per_ctx_tok",
    "fq_us",
    "fq_kv_us_per_ctx_tok",
)
_DRAFT_NAMES = ("d_fix_us", "d_fc_us", "d_tok_us_per_tok", "d_kv_us_per_ctx_tok")


def _rows(df, component: str):
    sub = df[df["component"] == component]
    return (
        sub["batch"].to_numpy(float),
        sub["q"].to_numpy(float),
        sub["ctx"].to_numpy(float),
        sub["median_ms"].to_numpy(float),
    )


def fit_profile(df, base: LatencyParams | None = None) -> tuple[LatencyParams, dict[str, float]]:
    """Fit the pass-level coefficients to profile rows by least squares on log time.

    The target's coefficients are fitted jointly to ``target`` rows and, where present, the
    ``target_gemm`` and ``target_attn_*`` decompositions (which pin the weight-read, compute
    and KV-read terms separately, so the fit extrapolates by physics rather than by curve
    shape). The attention rows use the faster of the two kernels at each shape, as the
    profiled target did. Draft coefficients are fitted to ``draft``/``draft_nofc`` rows.

    Args:
        df: a DataFrame with :data:`PROFILE_COLUMNS`.
        base: coefficients to keep for terms the rows cannot identify (overheads, prefill).

    Returns:
        The fitted params (with ``rel_se`` from the Jacobian) and the fitted-row MAPE per
        component.

    Raises:
        FitError: no target rows, or a fit that does not converge.
    """
    from scipy.optimize import least_squares

    base = base or LatencyParams()
    tb, tq, tc, tm = _rows(df, "target")
    if len(tm) < 6:
        raise FitError(f"profile: {len(tm)} 'target' rows; at least 6 are needed to fit the latency model")
    gb, gq, _, gm = _rows(df, "target_gemm")
    # Larger passes weigh more (∝ time^SIZE_WEIGHT_EXP): they are the sustained, bandwidth-
    # or compute-bound regime that extrapolation to larger batches and contexts continues.
    tw = (tm / np.median(tm)) ** SIZE_WEIGHT_EXP
    fb, fq, fc, fm = _rows(df, "target_attn_fa2")
    sb, sq, sc, sm = _rows(df, "target_attn_split")

    x0 = np.array([getattr(base, n) for n in _TARGET_NAMES] + [base.p], dtype=float)
    scale = np.maximum(np.abs(x0), 1e-4)

    def unpack(z: np.ndarray) -> LatencyParams:
        x = z * scale
        kw: dict[str, Any] = dict(zip(_TARGET_NAMES, (float(v) for v in x[:-1])))
        return replace(base, **kw, p=float(x[-1]))

    def resid(z: np.ndarray) -> np.ndarray:
        lp = unpack(z)
        parts = [tw * np.log(predict_component_ms(lp, "target", tb, tq, tc) / tm)]
        if len(gm):
            parts.append(0.5 * np.log(predict_component_ms(lp, "target_gemm", gb, gq, 0.0) / gm))
        if len(fm):
            parts.append(ATTN_WEIGHT * np.log(predict_component_ms(lp, "target_attn_fa2", fb, fq, fc) / fm))
        if len(sm):
            parts.append(ATTN_WEIGHT * np.log(predict_component_ms(lp, "target_attn_split", sb, sq, sc) / sm))
        return np.concatenate(parts)

    lo = np.zeros(len(x0))
    lo[-1] = 1.0 / scale[-1]
    hi = np.full(len(x0), np.inf)
    hi[-1] = 16.0 / scale[-1]
    sol = least_squares(
        resid,
        x0 / scale,
        bounds=(lo, hi),
        method="trf",
        x_scale="jac",
        max_nfev=4000,
        loss=TARGET_LOSS,
        f_scale=0.03,
    )
    if not np.all(np.isfinite(sol.x)):
        raise FitError("profile: latency fit did not converge (non-finite coefficients)")
    lp = unpack(sol.x)
    rel_se = _rel_se(sol, _TARGET_NAMES + ("p",), sol.x)

    db, dq, dc, dm = _rows(df, "draft")
    nb, nq, nc, nm = _rows(df, "draft_nofc")
    if len(dm) + len(nm) >= 4:
        xd0 = np.array([getattr(base, n) for n in _DRAFT_NAMES], dtype=float)
        sd = np.maximum(np.abs(xd0), 1e-5)

        def unpack_d(z: np.ndarray) -> LatencyParams:
            kw: dict[str, Any] = dict(zip(_DRAFT_NAMES, (float(v) for v in z * sd)))
            return replace(lp, **kw)

        def resid_d(z: np.ndarray) -> np.ndarray:
            p = unpack_d(z)
            return np.concatenate(
                [
                    np.log(predict_component_ms(p, "draft", db, dq, dc) / dm),
                    np.log(predict_component_ms(p, "draft_nofc", nb, nq, nc) / nm),
                ]
            )

        sold = least_squares(resid_d, xd0 / sd, bounds=(0.0, np.inf), method="trf", x_scale="jac")
        lp = unpack_d(sold.x)
        rel_se.update(_rel_se(sold, _DRAFT_NAMES, sold.x))
    lp = replace(lp, rel_se=rel_se)
    return lp, profile_mape(lp, df)


def _rel_se(sol, names: tuple[str, ...], x: np.ndarray) -> dict[str, float]:
    """Relative standard errors from the Gauss-Newton covariance σ²(JᵀJ)⁻¹."""
    j = sol.jac
    dof = max(len(sol.fun) - len(x), 1)
    s2 = float(sol.fun @ sol.fun) / dof
    try:
        cov = np.linalg.pinv(j.T @ j) * s2
    except np.linalg.LinAlgError:
        return {n: 0.0 for n in names}
    se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    out = {}
    for n, s, v in zip(names, se, x):
        # A coefficient at its bound has no meaningful SE; cap the relative spread at 50%.
        out[n] = float(min(s / abs(v), 0.5)) if abs(v) > 1e-12 else 0.0
    return out


def profile_mape(lp: LatencyParams, df) -> dict[str, float]:
    """Mean absolute percentage error of the predicted ``median_ms``, per component present."""
    out: dict[str, float] = {}
    for comp in sorted(set(df["component"])):
        if comp not in KNOWN_COMPONENTS:
            continue
        b, q, c, m = _rows(df, comp)
        pred = predict_component_ms(lp, comp, b, q, c)
        out[comp] = float(np.mean(np.abs(pred - m) / m) * 100.0)
    return out


def read_profile(path: str):
    """Read a latency-profile CSV (the format of ``reference/h200_llama8b/latency.csv``).

    Raises:
        FitError: unreadable, empty, missing columns, or non-positive/non-numeric times;
            the message names the file.
    """
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except FileNotFoundError:
        raise FitError(f"{path}: no such profile CSV") from None
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise FitError(f"{path}: not a readable CSV ({type(exc).__name__}: {str(exc)[:120]})") from None
    missing = [c for c in PROFILE_COLUMNS if c not in df.columns]
    if missing:
        raise FitError(f"{path}: missing column(s) {', '.join(missing)}; need {', '.join(PROFILE_COLUMNS)}")
    if len(df) == 0:
        raise FitError(f"{path}: no rows")
    for c in ("batch", "q", "ctx", "median_ms"):
        vals = pd.to_numeric(df[c], errors="coerce")
        bad = vals.isna() | (vals < 0) | ((vals <= 0) if c in ("median_ms", "batch", "q") else False)
        if bad.any():
            row = int(np.argmax(bad.to_numpy())) + 2  # 1-based, after the header
            raise FitError(
                f"{path}: line {row}: column {c!r} must be a positive number, got {df[c].iloc[row - 2]!r}"
            )
        df[c] = vals
    df["component"] = df["component"].astype(str)
    return df


# --------------------------------------------------------------------------- one engine step
#
# The step formula of the module docstring, written once: :func:`step_time_kernel` (plain Python
# that numba compiles). The simulator's hot path, the oracle, the goodput baseline and the fit
# to traces (:func:`step_times_us`, the same kernel over arrays) all evaluate it, so every
# consumer gets the same float for the same step. The order of its operations is part of the
# simulator's definition (episodes are reproduced bit for bit): change it knowingly.

# The coefficients the step kernels read, in the order they unpack them (``extend0`` as 0.0/1.0);
# tests/test_fit.py checks the unpacking against this tuple.
STEP_COEFFS = (
    "t_fix_us",
    "w_us",
    "f_us_per_tok",
    "p",
    "tok_us_per_tok",
    "a0_us",
    "sq_us_per_seq",
    "kv_us_per_ctx_tok",
    "aq_us",
    "sqq_us_per_seq",
    "kvq_us_per_ctx_tok",
    "kvs_us_per_ctx_tok",
    "fq_us",
    "fq_kv_us_per_ctx_tok",
    "d_fix_us",
    "d_fc_us",
    "d_tok_us_per_tok",
    "d_kv_us_per_ctx_tok",
    "oh_us",
    "oh_spec_us",
    "oh_req_us",
    "extend0",
    "pf_attn_us_per_tok",
    "pf_scale",
)
_COEFF_CACHE: dict[int, tuple[LatencyParams, np.ndarray]] = {}
_COEFF_CACHE_SIZE = 16


def step_coeffs(lp: LatencyParams) -> np.ndarray:
    """``lp``'s :data:`STEP_COEFFS` as a float64 array (the form the compiled kernels take).

    The last few arrays are cached by identity (params are frozen), so calling
    :func:`step_time_us` in a loop does not rebuild it each time.
    """
    hit = _COEFF_CACHE.get(id(lp))
    if hit is not None and hit[0] is lp:
        return hit[1]
    c = np.array([float(getattr(lp, name)) for name in STEP_COEFFS], dtype=np.float64)
    if len(_COEFF_CACHE) >= _COEFF_CACHE_SIZE:
        del _COEFF_CACHE[next(iter(_COEFF_CACHE))]
    _COEFF_CACHE[id(lp)] = (lp, c)
    return c


def step_time_us(
    lp: LatencyParams, bs: int, depth: int, ctx_tokens: float, prefill_tokens: float = 0.0
) -> float:
    """Expected wall time of one engine step (decode/verify at ``depth`` plus prefill), µs."""
    return step_time_kernel(step_coeffs(lp), bs, depth, ctx_tokens, prefill_tokens)


def prefill_us(lp: LatencyParams, prefill_tokens: float) -> float:
    """Time of prefilling ``prefill_tokens`` prompt tokens between two decode steps, µs."""
    return _with_prefill(step_coeffs(lp), 0.0, prefill_tokens)


def step_times_us(lp: LatencyParams, bs: Any, depth: Any, ctx_tokens: Any, prefill_tokens: Any) -> np.ndarray:
    """:func:`step_time_us` of every step of arrays of steps (for fitting to traces)."""
    bs, depth, ctx_tokens, prefill_tokens = (
        np.ascontiguousarray(x, dtype=np.float64) for x in (bs, depth, ctx_tokens, prefill_tokens)
    )
    out = np.empty(len(bs), dtype=np.float64)
    _step_time_array(step_coeffs(lp), bs, depth, ctx_tokens, prefill_tokens, out)
    return out


@maybe_njit
def _with_prefill(c: np.ndarray, t: float, prefill_tokens: float) -> float:
    """``t`` plus the prefill of ``prefill_tokens`` prompt tokens (none: ``t``): one chunked pass."""
    (t_fix_us, w_us, f_us_per_tok, p, tok_us_per_tok, a0_us, sq_us_per_seq, kv_us_per_ctx_tok,
     aq_us, sqq_us_per_seq, kvq_us_per_ctx_tok, kvs_us_per_ctx_tok, fq_us, fq_kv_us_per_ctx_tok,
     d_fix_us, d_fc_us, d_tok_us_per_tok, d_kv_us_per_ctx_tok, oh_us, oh_spec_us, oh_req_us,
     extend0, pf_attn_us_per_tok, pf_scale) = c  # fmt: skip
    if prefill_tokens > 0:
        pf = float(prefill_tokens)
        t += t_fix_us + pf_scale * (_gemm_kernel(w_us, f_us_per_tok, p, pf) + tok_us_per_tok * pf)
        t += a0_us + pf_attn_us_per_tok * pf
    return t


@maybe_njit
def step_time_kernel(c: np.ndarray, bs: int, depth: int, ctx_tokens: float, prefill_tokens: float) -> float:
    """One engine step at ``depth`` (module docstring), µs, over :func:`step_coeffs` ``c``.

    Compiled when numba is installed, and callable from other kernels of this module.
    """
    (t_fix_us, w_us, f_us_per_tok, p, tok_us_per_tok, a0_us, sq_us_per_seq, kv_us_per_ctx_tok,
     aq_us, sqq_us_per_seq, kvq_us_per_ctx_tok, kvs_us_per_ctx_tok, fq_us, fq_kv_us_per_ctx_tok,
     d_fix_us, d_fc_us, d_tok_us_per_tok, d_kv_us_per_ctx_tok, oh_us, oh_spec_us, oh_req_us,
     extend0, pf_attn_us_per_tok, pf_scale) = c  # fmt: skip
    t = _with_prefill(c, oh_us + oh_req_us * bs, prefill_tokens)
    attn0 = a0_us + sq_us_per_seq * bs + kv_us_per_ctx_tok * ctx_tokens  # attention, any q
    draft_pass = d_fix_us + d_kv_us_per_ctx_tok * ctx_tokens  # one draft pass, per-token work aside
    if depth > 0:
        q = depth + 1
        n = bs * q
        t += oh_spec_us
        t += depth * (draft_pass + d_tok_us_per_tok * bs) + d_fc_us  # k draft steps, the first with fc
        t += t_fix_us + _gemm_kernel(w_us, f_us_per_tok, p, n) + tok_us_per_tok * n  # the verify pass
        split = aq_us + sqq_us_per_seq * bs + (kvq_us_per_ctx_tok + kvs_us_per_ctx_tok * (q - 2)) * ctx_tokens
        t += attn0 + min(split, fq_us + fq_kv_us_per_ctx_tok * ctx_tokens)  # the faster verify kernel
        t += draft_pass + d_tok_us_per_tok * n  # draft extend over the verified tokens
    else:
        t += t_fix_us + _gemm_kernel(w_us, f_us_per_tok, p, bs) + tok_us_per_tok * bs + attn0
        if extend0 != 0.0:
            t += draft_pass + d_tok_us_per_tok * bs
    return float(t)


@maybe_njit
def step_times_kernel(
    c: np.ndarray, bs: int, depth: int, ctx_tokens: float, prefill_tokens: float
) -> tuple[float, float]:
    """:func:`step_time_kernel` at ``depth`` and at depth 0 for the same batch, in one call
    (the simulator's step needs both: the reward compares them)."""
    t = step_time_kernel(c, bs, depth, ctx_tokens, prefill_tokens)
    return t, (t if depth == 0 else step_time_kernel(c, bs, 0, ctx_tokens, prefill_tokens))


@maybe_njit
def _step_time_array(
    c: np.ndarray,
    bs: np.ndarray,
    depth: np.ndarray,
    ctx_tokens: np.ndarray,
    prefill_tokens: np.ndarray,
    out: np.ndarray,
) -> None:
    for i in range(len(out)):
        out[i] = step_time_kernel(c, bs[i], depth[i], ctx_tokens[i], prefill_tokens[i])
