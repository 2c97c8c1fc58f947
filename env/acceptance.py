"""Acceptance model: per request and per draft position, heterogeneous, drifting, stale-aware.

The conditional probability that draft position ``i`` (1-based) is accepted, given positions
``1..i−1`` were, for request ``r`` at time ``t``::

    logit p_i(r, t) = alpha + beta·(i − 1) + u_r + g(t) + shift_r − stale_r(t) − ctx_r(t)

- ``alpha``, ``beta``: the per-position base and its slow decay (published 0.73, 0.71, 0.68
  conditional for Llama-3.1-8B + EAGLE-3 on MT-Bench, i.e. a decay of ≈ −0.12 logit/position);
- ``u_r ~ N(0, sigma²)``: how well the drafter tracks this request (heterogeneity); with
  probability ``p_zero`` a request is a near-non-accepter (``u_r = zero_logit``), as on the
  bimodal translation workloads;
- ``g(t)``: a shared Ornstein-Uhlenbeck drift with stationary s.d. ``drift_sd`` and time
  constant ``drift_tau_s``;
- ``shift_r``: the workload's offset for the request (code-like phases accept more);
- ``stale_r``: the stale-drafter penalty, ``stale_logit·(1 − exp(−s/stale_tau_steps))`` after
  ``s`` consecutive steps at depth 0, decaying by ``exp(−1/stale_recover_steps)`` per
  speculative step once drafting resumes;
- ``ctx_r``: the fall with context, ``ctx_logit·ln(L_r / ctx_ref_tokens)`` once the request's
  sequence length ``L_r`` (prompt + emitted) passes ``ctx_ref_tokens`` (0 below). A drafter
  trained on short sequences predicts long ones worse: users report an accepted length of 2.30
  at 2k tokens of context falling to 1.08 at 20k, and 5-8% acceptance on long documents
  (``reference/acceptance.md``); :func:`calibrate_context` solves the two parameters from
  two such points.

``alpha`` is the *conditional* logit of a typical request; the marginal figures the papers
report average the sigmoid over ``u_r``, which :func:`marginal_conditionals` computes.

Fitting (:func:`fit_acceptance`) is maximum likelihood over the ``accept`` lists of step
records: each entry ``a`` at depth ``d`` has probability
``∫ Π_{i≤a} p_i(u) · (1 − p_{a+1}(u))^[a<d] dN(u)`` (Gauss-Hermite over ``u``). Entries are
treated as independent (the wire does not identify requests), which identifies ``sigma``
from the shape of the accept-length distribution rather than from per-request histories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from env.errors import FitError

MAX_POSITIONS = 16


@dataclass(frozen=True)
class AcceptanceParams:
    """Parameters of the acceptance model (logit units; see module docstring)."""

    alpha: float = 1.16
    beta: float = -0.12
    sigma: float = 0.6
    p_zero: float = 0.03
    zero_logit: float = -4.0
    drift_sd: float = 0.25
    drift_tau_s: float = 60.0
    stale_logit: float = 0.15
    stale_tau_steps: float = 50.0
    stale_recover_steps: float = 20.0
    code_shift: float = 0.8
    ctx_ref_tokens: float = 1.0e9
    ctx_logit: float = 0.0
    rel_se: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> AcceptanceParams:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FitError(f"acceptance params: unknown keys {sorted(unknown)}")
        return cls(**d)

    def ctx_shift(self, ctx_tokens: float) -> float:
        """The logit shift of a request whose sequence holds ``ctx_tokens`` (≤ 0)."""
        if self.ctx_logit <= 0.0 or ctx_tokens <= self.ctx_ref_tokens:
            return 0.0
        return -self.ctx_logit * math.log(ctx_tokens / self.ctx_ref_tokens)

    def base_logits(self, k: int = MAX_POSITIONS) -> np.ndarray:
        """Per-position base logits, positions 1..k."""
        return self.alpha + self.beta * np.arange(k, dtype=float)

    def perturb(self, rng: np.random.Generator, scale: float = 1.0) -> AcceptanceParams:
        """A draw around these parameters: additive in logits by the stored standard errors
        (or a default spread of 0.15 logit for ``alpha``), multiplicative for scales."""
        if scale <= 0.0:
            return self
        se = self.rel_se or {}
        return replace(
            self,
            alpha=self.alpha + rng.normal(0.0, scale * se.get("alpha", 0.15)),
            beta=self.beta + rng.normal(0.0, scale * se.get("beta", 0.03)),
            sigma=self.sigma * math.exp(rng.normal(0.0, scale * se.get("sigma", 0.2))),
            drift_sd=self.drift_sd * math.exp(rng.normal(0.0, scale * 0.3)),
            stale_logit=self.stale_logit * math.exp(rng.normal(0.0, scale * 0.5)),
        )


def _gh(n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.polynomial.hermite_e.hermegauss(n)
    return x, w / w.sum()


def marginal_conditionals(ap: AcceptanceParams, k: int = 3) -> np.ndarray:
    """Population conditional acceptance per position 1..k (as published figures report it)."""
    x, w = _gh()
    u = np.concatenate([ap.sigma * x, [ap.zero_logit]])
    wu = np.concatenate([w * (1.0 - ap.p_zero), [ap.p_zero]])
    logits = ap.base_logits(k)[None, :] + u[:, None]
    p = 1.0 / (1.0 + np.exp(-logits))
    reach = np.cumprod(np.concatenate([np.ones((len(u), 1)), p[:, :-1]], axis=1), axis=1)
    return (wu @ (reach * p)) / (wu @ reach)


def accept_length_pmf(
    ap: AcceptanceParams, depth: int, shift: float = 0.0, step_weighted: bool = False
) -> np.ndarray:
    """P(accept = a), a = 0..depth, for a request drawn from the population, every request's
    logit moved by ``shift`` (workload and context shifts apply to every request in the engine,
    near-non-accepters included).

    ``step_weighted``: the distribution of *recorded entries* rather than of requests. A
    request stays in the batch for ``output/E_r`` steps, so entries over-represent poorly
    accepting requests by a factor ∝ 1/E_r; traces record entries.
    """
    x, w = _gh()
    u = np.concatenate([ap.sigma * x, [ap.zero_logit]]) + shift
    wu = np.concatenate([w * (1.0 - ap.p_zero), [ap.p_zero]])
    pmf_u = _pmf_given_u(ap.base_logits(depth), u)
    if step_weighted:
        wu = wu / (1.0 + pmf_u @ np.arange(depth + 1))
        wu = wu / wu.sum()
    return wu @ pmf_u


def _pmf_given_u(base: np.ndarray, u: np.ndarray) -> np.ndarray:
    """P(accept = a | u) for a = 0..d: shape (len(u), d + 1)."""
    d = len(base)
    p = 1.0 / (1.0 + np.exp(-(base[None, :] + u[:, None])))
    surv = np.cumprod(p, axis=1)  # P(accept >= i), i = 1..d
    full = np.concatenate([np.ones((len(u), 1)), surv], axis=1)  # P(accept >= a), a = 0..d
    pmf = full.copy()
    pmf[:, :d] -= full[:, 1:]
    return pmf


def mean_accept_length(ap: AcceptanceParams, depth: int, shift: float = 0.0) -> float:
    """Mean tokens per request-step at ``depth``, the bonus token included."""
    pmf = accept_length_pmf(ap, depth, shift)
    return 1.0 + float(pmf @ np.arange(depth + 1))


def harmonic_accept_length(ap: AcceptanceParams, depth: int, shift: float = 0.0) -> float:
    """Harmonic mean over requests of their mean tokens per step at ``depth``.

    What sequential throughput sees: a request's output takes ``len/E_r`` steps, so poorly
    accepting requests weigh more in time than in count.
    """
    x, w = _gh()
    u = np.concatenate([ap.sigma * x + shift, [ap.zero_logit + shift]])
    wu = np.concatenate([w * (1.0 - ap.p_zero), [ap.p_zero]])
    pmf = _pmf_given_u(ap.base_logits(depth), u)
    e_r = 1.0 + pmf @ np.arange(depth + 1)
    return float(1.0 / (wu @ (1.0 / e_r)))


def fit_acceptance(
    counts: dict[int, np.ndarray], base: AcceptanceParams | None = None, step_weighted: bool = False
) -> tuple[AcceptanceParams, dict[str, float]]:
    """Maximum-likelihood ``alpha``, ``beta``, ``sigma`` and ``p_zero`` from accept-length histograms.

    ``p_zero`` (the share of requests the drafter does not track at all, ``u_r = zero_logit``)
    lets the fit express a bimodal population — a third of the requests accepting nothing and
    the rest accepting well (TensorRT-LLM's translation workloads, the `noisy` drafter of the
    H200 runs) — which one normal ``u_r`` can only approximate by a huge ``sigma``.

    Args:
        counts: depth (or ``(depth, shift)``: entries whose requests had a known logit
            shift, e.g. the fall with context) → array of length depth + 1 with the number of
            entries that accepted 0..depth drafts.
        base: parameters kept for what the histograms cannot identify (drift, staleness).
        step_weighted: the counts are entries of step records (each request contributes one
            entry per step it ran, ∝ 1/E_r), not one draw per request; see
            :func:`accept_length_pmf`.

    Returns:
        The fitted params (``rel_se`` from the observed information) and a report with the
        number of entries, the mean negative log-likelihood per entry (``nll``) and the
        total-variation distance between the fitted and the observed accept-length
        distributions, per depth and averaged.

    Raises:
        FitError: fewer than 50 entries at depths > 0.
    """
    from scipy.optimize import minimize

    base = base or AcceptanceParams()
    items = []  # (depth, context logit shift of the entries, histogram)
    for key, c in sorted(counts.items()):
        d, shift = key if isinstance(key, tuple) else (key, 0.0)
        if d > 0 and np.sum(c) > 0:
            items.append((int(d), float(shift), np.asarray(c, dtype=float)))
    n_total = float(sum(c.sum() for _, _, c in items))
    if n_total < 50:
        raise FitError(
            f"acceptance: only {int(n_total)} accept entries at depth > 0; need at least 50 to fit"
        )
    x, w = _gh()

    def unpack(theta: np.ndarray) -> AcceptanceParams:
        p_zero = 1.0 / (1.0 + math.exp(-theta[3]))
        return replace(base, alpha=theta[0], beta=theta[1], sigma=math.exp(theta[2]), p_zero=p_zero)

    def nll(theta: np.ndarray) -> float:
        ap = unpack(theta)
        total = 0.0
        for d, shift, c in items:
            pmf = accept_length_pmf(ap, d, shift, step_weighted)
            total -= float(c @ np.log(np.maximum(pmf, 1e-300)))
        return total / n_total

    pz = min(max(base.p_zero, 1e-4), 1.0 - 1e-4)
    best = None
    # Two starts: the base's population and a bimodal one (Nelder-Mead finds the nearer mode).
    for start in ((base.alpha, base.beta, max(base.sigma, 0.05), pz), (base.alpha + 1.5, base.beta, 0.5, 0.3)):
        theta0 = np.array([start[0], start[1], math.log(start[2]), math.log(start[3] / (1.0 - start[3]))])
        res = minimize(nll, theta0, method="Nelder-Mead", options={"xatol": 1e-5, "fatol": 1e-9, "maxiter": 6000})
        if best is None or res.fun < best.fun:
            best = res
    assert best is not None
    th = best.x
    fitted = unpack(th)
    ap = replace(base, alpha=float(th[0]), beta=float(th[1]), sigma=float(fitted.sigma), p_zero=float(fitted.p_zero))
    # Observed information by finite differences → standard errors.
    h = 1e-3
    hess = np.zeros((3, 3))
    for i in range(3):
        for j in range(3):
            e_i, e_j = np.eye(4)[i] * h, np.eye(4)[j] * h
            hess[i, j] = (
                nll(th + e_i + e_j) - nll(th + e_i - e_j) - nll(th - e_i + e_j) + nll(th - e_i - e_j)
            ) / (4 * h * h)
    try:
        cov = np.linalg.inv(hess * n_total)
        se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    except np.linalg.LinAlgError:
        se = np.array([0.15, 0.03, 0.2])
    # alpha and sigma trade off (both move the mean); cap the spreads so domain randomization
    # stays within the plausible range when the histograms identify them only weakly.
    caps = (0.3, 0.1, 0.5)
    ap = replace(ap, rel_se={n: float(min(s, c)) for n, s, c in zip(("alpha", "beta", "sigma"), se, caps)})
    report: dict[str, float] = {"entries": n_total, "nll": float(best.fun)}
    tvs, weights = [], []
    for d in sorted({d for d, _, _ in items}):
        got = np.sum([c for dd, _, c in items if dd == d], axis=0)
        want = np.sum([accept_length_pmf(ap, d, s, step_weighted) * c.sum() for dd, s, c in items if dd == d], axis=0)
        tv = 0.5 * float(np.abs(want / want.sum() - got / got.sum()).sum())
        report[f"tv_depth{d}"] = tv
        tvs.append(tv)
        weights.append(float(got.sum()))
    report["tv_mean"] = float(np.average(tvs, weights=weights))
    return ap, report


_RESUME_LOSS = (30.0, 0.01, 0.05)  # stale_logit, stale_tau_steps, stale_recover_steps


def with_resume_loss(ap: AcceptanceParams) -> AcceptanceParams:
    """``ap`` with a stale-drafter penalty that loses the first drafted step after depth 0: after
    one step at depth 0 no draft survives it (30 logits), and one drafted step takes it away.
    The hook's ``kv`` off switch resumed cold is such a drafter: while off it stores only the
    drafter's keys and values, and its first proposal after a resume comes from SGLang's zeroed
    stub (on the H100 testbed no first draft token of 125 resumed steps was accepted; ``env.fit``
    fits it). Resumed warm, as the hook now does, nothing is lost (:func:`without_resume_loss`)."""
    logit, tau, recover = _RESUME_LOSS
    return replace(ap, stale_logit=logit, stale_tau_steps=tau, stale_recover_steps=recover)


def without_resume_loss(ap: AcceptanceParams) -> AcceptanceParams:
    """``ap`` with :func:`with_resume_loss`'s penalty taken out again (the default stale-drafter
    penalty in its place); any other ``ap`` as it is."""
    if (ap.stale_logit, ap.stale_tau_steps, ap.stale_recover_steps) != _RESUME_LOSS:
        return ap
    d = AcceptanceParams()
    return replace(ap, stale_logit=d.stale_logit, stale_tau_steps=d.stale_tau_steps, stale_recover_steps=d.stale_recover_steps)


def with_zero_share(ap: AcceptanceParams, p_zero: float, depths: tuple[int, ...] = (1, 2, 3, 4, 5)) -> AcceptanceParams:
    """The population the fit ``ap`` describes, re-expressed with ``p_zero`` near-non-accepters.

    Step records pool their requests' accept counts without saying which request is which, so a
    fit identifies the step-weighted accept-length distributions, and along a ridge of nearly
    equal likelihood a smaller ``p_zero`` trades against a lower ``alpha`` and a rising
    ``beta`` (on the H100 testbed: ``p_zero`` 0.29, ``alpha`` 0.78, ``beta`` +0.075, where a
    third of the requests are documents and the others accept a flat 0.72-0.75 a position). A
    replay that knows which requests are near-non-accepters (``requests=`` with
    ``zero_accept``) must take the member of that ridge with their share, or it gives every
    other request the lower ``alpha``. This keeps ``sigma`` and chooses ``alpha``, ``beta`` and
    ``zero_logit`` so that the step-weighted distributions at ``depths`` stay ``ap``'s (least
    Kullback-Leibler divergence).
    """
    from scipy.optimize import minimize

    if not 0.0 <= p_zero < 1.0:
        raise FitError(f"acceptance: p_zero must be in [0, 1), got {p_zero}")
    want = {d: accept_length_pmf(ap, d, 0.0, step_weighted=True) for d in depths}

    def kl(th: np.ndarray) -> float:
        moved = replace(ap, alpha=th[0], beta=th[1], zero_logit=th[2], p_zero=p_zero)
        return sum(
            float(w @ (np.log(np.maximum(w, 1e-300)) - np.log(np.maximum(accept_length_pmf(moved, d, 0.0, True), 1e-300))))
            for d, w in want.items()
        )

    res = minimize(kl, np.array([ap.alpha, ap.beta, ap.zero_logit]), method="Nelder-Mead",
                   options={"xatol": 1e-6, "fatol": 1e-12, "maxiter": 4000})  # fmt: skip
    return replace(ap, alpha=float(res.x[0]), beta=float(res.x[1]), zero_logit=float(res.x[2]), p_zero=float(p_zero))


def calibrate_context(
    ap: AcceptanceParams, depth: int, points: tuple[tuple[float, float], tuple[float, float]]
) -> AcceptanceParams:
    """Choose ``ctx_ref_tokens`` and ``ctx_logit`` so the population's mean accepted length
    (bonus included) at ``depth`` is ``points[i][1]`` at ``points[i][0]`` tokens of context."""
    from scipy.optimize import brentq

    (l1, a1), (l2, a2) = points

    def shift_for(target: float) -> float:
        return brentq(lambda s: mean_accept_length(ap, depth, s) - target, -12.0, 6.0)

    s1, s2 = shift_for(a1), shift_for(a2)  # both ≤ 0 when the points lie below the base
    slope = (s1 - s2) / math.log(l2 / l1)
    if slope <= 0.0:
        raise FitError(f"acceptance: points {points} do not fall with context")
    ref = l1 * math.exp(s1 / slope) if s1 < 0.0 else l1
    return replace(ap, ctx_logit=float(slope), ctx_ref_tokens=float(ref))


def calibrate_to_conditionals(target: list[float], base: AcceptanceParams | None = None) -> AcceptanceParams:
    """Choose ``alpha``, ``beta`` so the population conditionals match published figures,
    keeping ``sigma``/``p_zero`` (the defaults come from ``reference/acceptance.md``)."""
    from scipy.optimize import least_squares

    base = base or AcceptanceParams()
    tgt = np.asarray(target, dtype=float)

    def resid(th: np.ndarray) -> np.ndarray:
        ap = replace(base, alpha=th[0], beta=th[1])
        return marginal_conditionals(ap, len(tgt)) - tgt

    sol = least_squares(resid, np.array([base.alpha, base.beta]))
    return replace(base, alpha=float(sol.x[0]), beta=float(sol.x[1]))
