"""``fit_sim``: fit the simulator's components to traces and latency profiles, with a report.

What is fitted from what (every fallback is written into the report's ``notes``):

- **latency**, from profile CSVs (``fit_profile``: the pass-level terms) and from traces
  (the per-step overheads ``oh_us``, ``oh_spec_us``, ``oh_req_us`` and one scale per cost
  class of pass terms — per pass, per token, per cached token, draft per pass, draft per
  token, prefill — and the GEMM regime sharpness ``p``, by robust least squares on log
  ``step_us``). With a profile, traces fit only the overheads (the profile measured the pass
  terms, and ``--holdout`` predictions come from them). Without a profile the pass shape
  starts from the bundled ``h200-llama8b`` fit and the traces rescale its cost classes.
- **admissions**: what a step that admits requests costs beyond its prefill pass
  (:func:`fit_admission`, a constant and a term per running request, less a share of the step
  it joins, which hides part of it), from pairs of records.
- **acceptance**, from the ``accept`` lists (maximum likelihood, :func:`fit_acceptance`).
  Traces without speculative steps keep the published defaults (``reference/acceptance.md``).
- **workload**, from traces where they say enough: prompt lengths from ``prefill_tokens``,
  mean output length from tokens emitted per admission; KV budget from ``ctx_tokens`` /
  ``kv_usage``; the running limit at least the largest batch seen.

Held-out evaluation: 20% of profile rows (fixed seed) and the last 20% of each instance's
steps are held out of a first fit and scored (step-latency MAPE; total-variation distance
between the recorded and the fitted accept-length distributions); the parameters returned are
then refitted on everything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from controller.errors import TraceError
from controller.protocol import Step
from env.acceptance import (
    AcceptanceParams,
    accept_length_pmf,
    calibrate_to_conditionals,
    fit_acceptance,
    with_resume_loss,
)
from env.errors import FitError
from env.latency import (
    KV_NAMES,
    OFF_EXTEND,
    LatencyParams,
    fit_profile,
    kv_floor_us_per_tok,
    profile_mape,
    read_profile,
    step_times_us,
)
from env.params import EngineParams, SimParams
from env.workload import WorkloadParams

HOLDOUT_FRAC = 0.2
CTX_SPREAD = 1.5
"""How far the drafted steps' cached tokens per sequence must spread (90th over 10th percentile)
for :func:`fit_step_latency` to fit ``verify_ctx_us_per_tok``."""
# Groups of pass terms that traces can scale independently (each a physical cost class).
_GROUPS = {
    "fixed": ("t_fix_us", "w_us", "dec_fix_us", "split_fix_us", "mq_fix_us"),  # per pass: launches, weight reads
    "per_token": ("f_us_per_tok", "tok_us_per_tok", "dec_seq_us", "split_seq_us", "mq_seq_us"),  # per token / seq
    "per_ctx": KV_NAMES,  # per cached token
    "draft_fixed": ("d_fix_us", "d_fc_us", "d_w_us"),
    "draft_per_token": ("d_f_us_per_tok", "d_tok_us_per_tok"),
    "prefill": ("pf_scale", "pf_attn_us_per_tok"),
}


@dataclass
class FitReport:
    """What the fit used and how well it predicts data held out of it."""

    profiles: list[str] = field(default_factory=list)
    traces: str | None = None
    n_profile_rows: int = 0
    n_steps: int = 0
    profile_mape_fit: dict[str, float] = field(default_factory=dict)
    profile_mape_holdout: dict[str, float] = field(default_factory=dict)
    step_mape_holdout: float | None = None
    step_mape_fit: float | None = None
    accept_entries: int = 0
    accept_tv_holdout: float | None = None
    accept_tv_fit: float | None = None
    fitted: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __str__(self) -> str:
        lines = ["fit report"]
        if self.profiles:
            lines.append(f"  profiles: {', '.join(self.profiles)} ({self.n_profile_rows} rows)")
        if self.traces:
            lines.append(f"  traces: {self.traces} ({self.n_steps} step records)")
        if self.profile_mape_holdout:
            lines.append(f"  {'component':<20}{'MAPE fit %':>12}{'MAPE held-out %':>18}")
            for comp in sorted(self.profile_mape_fit):
                ho = self.profile_mape_holdout.get(comp)
                ho_s = f"{ho:>18.2f}" if ho is not None else f"{'-':>18}"
                lines.append(f"  {comp:<20}{self.profile_mape_fit[comp]:>12.2f}{ho_s}")
        if self.step_mape_holdout is not None:
            lines.append(
                f"  step latency (traces): MAPE fit {self.step_mape_fit:.2f}%, held-out {self.step_mape_holdout:.2f}%"
            )
        if self.accept_tv_holdout is not None:
            lines.append(
                f"  acceptance: {self.accept_entries} entries; accept-length TV distance fit "
                f"{self.accept_tv_fit:.4f}, held-out {self.accept_tv_holdout:.4f}"
            )
        if self.fitted:
            lines.append(f"  fitted: {', '.join(self.fitted)}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- traces


def load_steps(traces_dir: str) -> dict[str, list[Step]]:
    """Step records of a trace folder, by instance; FitError naming the folder if none."""
    from controller.traces import step_records

    try:
        recs = step_records(traces_dir)
    except TraceError as exc:
        raise FitError(f"traces: {exc}") from None
    recs = {k: v for k, v in recs.items() if v}
    if not recs:
        raise FitError(f"traces {traces_dir!r}: no valid step records in any file")
    return recs


def accept_counts(steps: list[Step], ap: AcceptanceParams | None = None) -> dict:
    """Histograms of accept values 0..depth over all entries: by depth, or — when ``ap`` has a
    fall with context — by ``(depth, shift)``, the context shift of the step's mean sequence
    length rounded to 0.05 logit, so the fit does not read long-context steps as a worse drafter."""
    ctx_on = ap is not None and ap.ctx_logit > 0.0
    out: dict = {}
    for s in steps:
        if s.depth > 0 and s.accept:
            key: Any = s.depth
            if ctx_on and ap is not None:
                key = (s.depth, round(ap.ctx_shift(s.ctx_tokens / max(s.bs, 1)) / 0.05) * 0.05)
            h = out.setdefault(key, np.zeros(s.depth + 1))
            h += np.bincount(np.asarray(s.accept, dtype=np.int64), minlength=s.depth + 1)[: s.depth + 1]
    return out


CTX_FALL_GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
"""The falls with context (``ctx_logit``, logits per e-fold of context past ``ctx_ref_tokens``)
that :func:`fit_context_fall` compares, with the base's own."""


def fit_context_fall(steps: list[Step], ap: AcceptanceParams) -> tuple[AcceptanceParams, str]:
    """``ap`` with the fall with context (``ctx_logit``) the traces support, and a line for the
    fit report ("" when the traces cannot tell it: unchanged).

    The base's fall (the published one: accepted length 2.30 at 2k tokens, 1.08 at 20k) is a
    property of a drafter, and a drafter that tracks long sequences as well as short ones
    exists (the H100 testbed's: its drafts accept per token, whatever the context). Kept fixed,
    the base's fall makes the fit read every long-context step as a worse request and widen the
    population to match (call AQ's records: logit sigma 9.8 and no zero part, where the short
    steps alone give 0.35 and a third at zero, the testbed's three families). Where the drafted
    entries' contexts spread past ``ctx_ref_tokens`` (:func:`_spread` of their context over it,
    floored at 1; else a fall is one shift that ``alpha`` absorbs), each fall of :data:`CTX_FALL_GRID` (and the base's) is fitted
    (:func:`fit_acceptance`) and the most likely one kept; ``ctx_ref_tokens`` stays the base's.
    """
    drafted = [s for s in steps if s.depth > 0 and s.accept]
    per_seq = np.array([s.ctx_tokens / max(s.bs, 1) for s in drafted])
    if ap.ctx_ref_tokens >= 1e9 or len(drafted) < 50 or not _spread(np.maximum(per_seq / ap.ctx_ref_tokens, 1.0)):
        return ap, ""
    nll: dict[float, float] = {}
    for fall in sorted(set(CTX_FALL_GRID) | {ap.ctx_logit}):
        cand = replace(ap, ctx_logit=fall)
        _, rep = fit_acceptance(accept_counts(drafted, cand), cand, step_weighted=True)
        nll[fall] = rep["nll"]
    best = min(nll, key=lambda f: nll[f])
    line = (
        f"acceptance's fall with context ctx_logit {best:g} past {ap.ctx_ref_tokens:.0f} tokens (most likely of "
        + ", ".join(f"{f:g}" for f in nll)
        + f"; the base's {ap.ctx_logit:g})"
    )
    return replace(ap, ctx_logit=best), line


def _tv(ap: AcceptanceParams, counts: dict) -> float | None:
    by_depth: dict[int, list[tuple[float, np.ndarray]]] = {}
    for key, c in counts.items():
        d, shift = key if isinstance(key, tuple) else (key, 0.0)
        if c.sum() > 0:
            by_depth.setdefault(int(d), []).append((float(shift), c))
    tvs, weights = [], []
    for d, parts in by_depth.items():
        got = np.sum([c for _, c in parts], axis=0)
        want = np.sum([accept_length_pmf(ap, d, shift, True) * c.sum() for shift, c in parts], axis=0)
        tvs.append(0.5 * float(np.abs(want / want.sum() - got / got.sum()).sum()))
        weights.append(float(got.sum()))
    return float(np.average(tvs, weights=weights)) if tvs else None


def _split(recs: dict[str, list[Step]]) -> tuple[dict[str, list[Step]], dict[str, list[Step]]]:
    """Each instance's first steps to fit on and its last ``HOLDOUT_FRAC`` to score, per file."""
    cut = {name: int(len(steps) * (1.0 - HOLDOUT_FRAC)) for name, steps in recs.items()}
    return {n: s[: cut[n]] for n, s in recs.items()}, {n: s[cut[n] :] for n, s in recs.items()}


def _flat(recs: dict[str, list[Step]]) -> list[Step]:
    return [s for steps in recs.values() for s in steps]


RESUME_LOST_BELOW = 0.25
"""Resumed steps whose first draft token is accepted at under this share of the other drafted
steps' rate read as a lost step (:func:`resume_acceptance`)."""
MIN_RESUMES = 10


def resume_acceptance(runs: Iterable[Sequence[tuple[int, Sequence[int]]]]) -> tuple[float, int, float, int]:
    """First-draft acceptance around resumes, over ``runs`` of steps as ``(depth, accept)`` in
    order (one run per instance or per point): the share of requests that accepted their first
    draft token on the drafted steps right after a depth-0 step (a resume) and the number of
    those steps, then the same over the other drafted steps."""
    first: list[int] = []
    other: list[int] = []
    n_first = n_other = 0
    for run in runs:
        for (prev, _), (depth, accept) in zip(run, run[1:], strict=False):
            if depth > 0:
                resumed = prev == 0
                (first if resumed else other).extend(min(a, 1) for a in accept)
                n_first += resumed
                n_other += not resumed
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")  # noqa: E731
    return mean(first), n_first, mean(other), n_other


def _without_resumes(recs: dict[str, list[Step]]) -> dict[str, list[Step]]:
    """``recs`` less each drafted step that follows a depth-0 step (their accept lists are the
    resume's loss, not the drafter's quality)."""
    return {
        name: [s for i, s in enumerate(steps) if not (i and s.depth > 0 and steps[i - 1].depth == 0)]
        for name, steps in recs.items()
    }


def _step_arrays(steps: list[Step]) -> tuple[np.ndarray, ...]:
    # The first record of a file, and records after an idle gap, measure more than one step;
    # keep steps whose step_us is plausible for a decode (the robust loss handles the rest).
    bs = np.array([s.bs for s in steps], dtype=float)
    depth = np.array([s.depth for s in steps], dtype=float)
    ctx = np.array([s.ctx_tokens for s in steps], dtype=float)
    pf = np.array([s.prefill_tokens for s in steps], dtype=float)
    us = np.array([s.step_us for s in steps], dtype=float)
    keep = (us > 0) & (np.arange(len(steps)) > 0)
    return bs[keep], depth[keep], ctx[keep], pf[keep], us[keep]


def _predict_steps(lp: LatencyParams, bs, depth, ctx, pf) -> np.ndarray:
    return step_times_us(lp, bs, depth, ctx, pf)


def scale_classes(
    lp: LatencyParams, classes: tuple[tuple[str, tuple[str, ...]], ...], log_scales: Any, terms: dict[str, float]
) -> LatencyParams:
    """``lp`` with every coefficient of ``classes[i]`` (a name and its coefficients) scaled by
    ``exp(log_scales[i])`` and the absolute ``terms`` set: the parameter map of the fits to
    traces (:func:`fit_step_latency`, ``env.deployments.build.fit_to_server``)."""
    changes: dict[str, Any] = {}
    for (_, names), lz in zip(classes, log_scales):
        for n in names:
            changes[n] = getattr(lp, n) * float(np.exp(lz))
    changes.update(terms)
    return replace(lp, **changes)


def _spread(values: np.ndarray) -> bool:
    """Whether the steps' values (cached tokens per sequence, batch sizes) spread enough to fit a
    term per unit of them (the 90th percentile at least :data:`CTX_SPREAD` times the 10th, over
    at least 10 steps)."""
    if len(values) < 10:
        return False
    lo, hi = np.percentile(values, [10, 90])
    return bool(hi >= CTX_SPREAD * lo)


def kv_floor_log_scale(lp: LatencyParams, names: tuple[str, ...]) -> float | None:
    """The least log scale of the KV coefficients ``names`` that keeps the smallest of them (of
    those above 0) at or above ``lp.kv_floor_us_per_tok``: no kernel streams the KV faster than
    the device copies memory. None without a declared floor or such a coefficient."""
    least = min((getattr(lp, n) for n in names if getattr(lp, n) > 0.0), default=0.0)
    if lp.kv_floor_us_per_tok <= 0.0 or least <= 0.0:
        return None
    return math.log(lp.kv_floor_us_per_tok / least)


def fit_step_latency(
    lp: LatencyParams, steps: list[Step], overheads_only: bool = False, verify_seq: bool | None = None
) -> LatencyParams:
    """Fit one scale per cost class of pass terms and the per-step overheads to traced step times.

    The overheads are ``oh_us``, ``oh_spec_us`` (when the traces speculate), ``oh_req_us`` and,
    when ``lp.off_path`` is ``"verify"`` and the traces hold depth-0 steps, the extra cost of
    SGLang's width-1 verify at depth 0 (``v0_fix_us``, ``v0_seq_us``). The declared hardware
    terms (``p``, the wave size) stay as given.

    ``overheads_only``: keep the pass terms as given — when a profile measured them — and fit
    only what a profile cannot see: the per-step overheads.

    ``verify_seq``: whether to fit ``verify_seq_us``, the verify pass's own cost per request
    (SGLang's triton backend verifies through the extend-attention kernel: a 128-row query tile
    per request and head, whatever the depth). None (default): where the drafted steps' batch
    sizes spread (the 90th percentile at least :data:`CTX_SPREAD` times the 10th), which tells a
    cost per request from one per step; else it stays as given. On call AQ's steps (batch 1-64)
    it comes out near 50 µs, where the base has 143 fitted at one context.

    ``verify_ctx_us_per_tok``, that kernel's loop over each request's prefix (per cached token
    per sequence, :mod:`env.latency`), is fitted where the traces' drafted steps tell it from
    ``oh_spec_us``: their cached tokens per sequence spread (the 90th percentile at least
    :data:`CTX_SPREAD` times the 10th); else it stays as given. ``dec_walk_us_per_tok``, the
    decode kernel's walk through one sequence's cached tokens, likewise where all the steps'
    cached tokens per sequence spread.
    """
    from scipy.optimize import least_squares

    bs, depth, ctx, pf, us = _step_arrays(steps)
    if len(us) < 10:
        raise FitError(f"traces: only {len(us)} usable step records; need at least 10 to fit step latency")
    ctx_spread = _spread(ctx[depth > 0] / np.maximum(bs[depth > 0], 1.0))
    if verify_seq is None:
        verify_seq = _spread(bs[depth > 0])
    walk_spread = _spread(ctx / np.maximum(bs, 1.0))
    # (name, unit scale of the free variable, whether the traces identify it)
    over = [
        ("oh_us", 1000.0, True),
        ("oh_spec_us", 1000.0, bool(np.any(depth > 0))),
        ("oh_req_us", 1.0, True),
        ("v0_fix_us", 1000.0, lp.off_path == "verify" and bool(np.any(depth == 0))),
        ("v0_seq_us", 10.0, lp.off_path == "verify" and bool(np.any(depth == 0))),
        ("verify_seq_us", 10.0, verify_seq and bool(np.any(depth > 0))),
        ("verify_ctx_us_per_tok", 1.0, ctx_spread),
        ("dec_walk_us_per_tok", 0.01, walk_spread),
    ]
    groups = tuple(_GROUPS.items())
    if lp.f_floor_us_per_tok > 0.0 and lp.f_us_per_tok > 0.0:
        # The GEMM's compute per token scales on its own, never below the device's peak: where
        # every step's GEMM is bound by the weight read the steps hardly constrain it (call AQ's
        # fit took it to 0.5 µs, 29 PFLOP/s), and a prefill priced with it is short 24x.
        groups = tuple((name, tuple(n for n in names if n != "f_us_per_tok")) for name, names in groups)
        groups += (("compute", ("f_us_per_tok",)),)
    ng = len(groups)

    def make(z: np.ndarray) -> LatencyParams:
        terms = {name: float(v * unit) for (name, unit, active), v in zip(over, z[ng:]) if active}
        # pinned: the pass terms exactly as given (the solver's bounds leave them 1e-9 loose)
        return scale_classes(lp, groups, np.zeros(ng) if overheads_only else z[:ng], terms)

    def resid(z: np.ndarray) -> np.ndarray:
        # Bounded: a wild trial point must not turn into inf/NaN (which stalls the SVD).
        return np.clip(np.log(np.maximum(_predict_steps(make(z), bs, depth, ctx, pf), 1.0) / us), -20.0, 20.0)

    z0 = np.concatenate([np.zeros(ng), [getattr(lp, name) / unit for name, unit, _ in over]])
    if walk_spread and lp.dec_walk_us_per_tok <= 0.0:
        # The walk enters as a smooth max, flat at 0: start it at one unit so the solver moves it.
        z0[ng + [name for name, _, _ in over].index("dec_walk_us_per_tok")] = 1.0
    # Subsample for speed: a few thousand steps pin these few parameters.
    if len(us) > 3000:
        idx = np.linspace(0, len(us) - 1, 3000).astype(int)
        bs, depth, ctx, pf, us = bs[idx], depth[idx], ctx[idx], pf[idx], us[idx]
    lo = np.concatenate([np.full(ng, -5.0), np.zeros(len(over))])
    hi = np.concatenate([np.full(ng, 5.0), np.full(len(over), 1e4)])
    if groups[-1][0] == "compute":
        lo[ng - 1] = math.log(lp.f_floor_us_per_tok / lp.f_us_per_tok)
    floor = kv_floor_log_scale(lp, KV_NAMES)
    if floor is not None:
        # Traces whose long steps run at small batches, where one sequence's walk sets the pace,
        # hardly constrain the stream (call AQ's fit took it to 6.6e-4 µs on an H100, half of
        # what its bandwidth allows).
        i = [name for name, _ in groups].index("per_ctx")
        lo[i] = min(floor, hi[i])
    for i, (_, _, active) in enumerate(over):
        if not active:  # what the traces cannot see stays as given (tight bounds)
            lo[ng + i], hi[ng + i] = z0[ng + i] - 1e-9, z0[ng + i] + 1e-9
            z0[ng + i] = max(z0[ng + i], 0.0)
    if overheads_only:  # pin the pass scales at 1
        lo[:ng], hi[:ng] = -1e-9, 1e-9
    z0 = np.clip(z0, lo, hi)
    sol = least_squares(resid, z0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, max_nfev=100, x_scale="jac")
    return make(sol.x)


ADMIT_MIN = 10
"""Admissions (records with ``prefill_tokens``) a trace folder needs before their cost is fitted."""


def fit_admission(lp: LatencyParams, recs: dict[str, list[Step]]) -> tuple[LatencyParams, int]:
    """``admit_us``, ``admit_seq_us`` and ``admit_hide``: what a step that admits requests costs
    beyond the model's prefill pass, ``max(0, admit_us + admit_seq_us · bs − admit_hide · T)``
    with ``T`` the step it joins (:mod:`env.latency`); and how many admissions it read.

    Each admission is read as a pair of records: the one that counts its prefilled tokens and
    the one before it. Under SGLang's overlap scheduler the prefill batch runs between two
    decode results, so part of its time lands in the record before (on the H100 testbed that
    record took 40-55 ms where a decode took 9). The pair's time less the model's two steps is
    the admission's excess; a robust fit through the excesses, every term at least 0. The
    scheduler prepares an admission while the GPU runs the step, so the excess falls as the
    step grows (H100 testbed: 9-16 ms beside 7-8 ms depth-0 steps, 1-2 ms beside 25 ms depth-3
    steps); ``admit_hide`` is fitted only where the admissions' steps differ enough to tell it
    from ``admit_us`` (the 90th percentile at least 1.5x the 10th), else it stays 0. The first
    record of a file, and pairs whose earlier record also admitted, are left out. Fewer than
    :data:`ADMIT_MIN` admissions: ``lp`` unchanged (0 admissions read).
    """
    from scipy.optimize import least_squares

    base = replace(lp, admit_us=0.0, admit_seq_us=0.0, admit_hide=0.0)
    rows: list[tuple[int, int, float, float, int, int, float, float]] = []
    for steps in recs.values():
        for i in range(2, len(steps)):
            s, prev = steps[i], steps[i - 1]
            if s.prefill_tokens > 0 and prev.prefill_tokens == 0 and s.step_us > 0 and prev.step_us > 0:
                rows.append((s.bs, s.depth, float(s.ctx_tokens), float(s.prefill_tokens),
                             prev.bs, prev.depth, float(prev.ctx_tokens), float(s.step_us + prev.step_us)))  # fmt: skip
    if len(rows) < ADMIT_MIN:
        return lp, 0
    a = np.array(rows, dtype=float)
    step = step_times_us(base, a[:, 0], a[:, 1], a[:, 2], np.zeros(len(a)))  # the step it joins
    pred = step_times_us(base, a[:, 0], a[:, 1], a[:, 2], a[:, 3]) + step_times_us(
        base, a[:, 4], a[:, 5], a[:, 6], np.zeros(len(a))
    )
    excess, bs = a[:, 7] - pred, a[:, 0]
    scale = max(float(np.median(np.abs(excess))), 100.0)
    lo, hi = np.percentile(step, [10, 90])
    hide = bool(hi >= 1.5 * lo)

    def resid(z: np.ndarray) -> np.ndarray:
        cost = z[0] * 1000.0 + z[1] * bs
        if hide:
            cost = np.maximum(cost - z[2] * step, 0.0)
        return (cost - excess) / scale

    z0 = np.array([max(float(np.median(excess)), 0.0) / 1000.0, 0.0, 0.0])
    sol = least_squares(resid, z0, bounds=([0.0, 0.0, 0.0], [1e4, 1e4, 5.0]), loss="soft_l1", f_scale=1.0)
    fitted = replace(lp, admit_us=float(sol.x[0] * 1000.0), admit_seq_us=float(sol.x[1]))
    return replace(fitted, admit_hide=float(sol.x[2]) if hide else 0.0), len(rows)


def sim_ttft_us(params: SimParams, workload: str) -> float:
    """Mean time to first token (µs) of a simulated closed-loop ``workload`` run at depth 0."""
    from env.engine import Engine

    eng = Engine(params, workload)
    eng.reset(0)
    while not eng.done:
        eng.step(0)
    return float(np.mean([r.first_token_us - r.arrival_us for r in eng.completed]))


def fit_request_path(
    params: SimParams, ttft_ms: dict[int, float], workload: Any, prefix_hit: Any = None
) -> SimParams:
    """``request_latency_us`` and ``request_serial_us`` from a client's measured time to first
    token at depth 0: the server's request path before the scheduler (HTTP, tokenizer), which
    no step record sees.

    ``ttft_ms`` maps concurrencies to the measured mean TTFT; ``workload(c)`` is the simulator's
    spec of that benchmark. The latency is the measured TTFT at the smallest C less the
    simulator's (a prefill and one step); the serial time per request is what is left at the
    largest C, over the mean place in a wave of C requests queueing through the one tokenizer
    (C / 2). Both at least 0; with one C only the latency is fitted. The serial estimate holds
    where the prompts are mostly cached (a benchmark that warms them, as the bench scripts'): where
    a wave's joint prefill dominates, staggering the arrivals can shorten the TTFT at C, and the
    estimate reads low or 0. ``prefix_hit(c)``, if given, is the radix cache's hit in the
    benchmark at C (a benchmark may warm some points' prompts and not others); the fitted
    parameters keep ``params``' own.
    """

    def at(p: SimParams, c: int) -> SimParams:
        return p if prefix_hit is None else replace(p, engine=replace(p.engine, prefix_cache_hit=prefix_hit(c)))

    lo, hi = min(ttft_ms), max(ttft_ms)
    bare = replace(params, engine=replace(params.engine, request_latency_us=0, request_serial_us=0))
    lat_us = max(0, int(round(ttft_ms[lo] * 1000 - sim_ttft_us(at(bare, lo), workload(lo)))))
    out = replace(params, engine=replace(bare.engine, request_latency_us=lat_us))
    if hi > lo:
        serial_us = max(0, int(round((ttft_ms[hi] * 1000 - sim_ttft_us(at(out, hi), workload(hi))) / (hi / 2))))
        out = replace(out, engine=replace(out.engine, request_serial_us=serial_us))
    return out


def step_mape(lp: LatencyParams, steps: list[Step]) -> float:
    """MAPE (%) of the latency model's step time against traced ``step_us``."""
    bs, depth, ctx, pf, us = _step_arrays(steps)
    if len(us) == 0:
        return float("nan")
    pred = _predict_steps(lp, bs, depth, ctx, pf)
    return float(np.mean(np.abs(pred - us) / us) * 100.0)


def _fit_workload(steps: list[Step], base: WorkloadParams, report: FitReport) -> WorkloadParams:
    pf = np.array([s.prefill_tokens for s in steps if s.prefill_tokens > 0], dtype=float)
    if len(pf) < 5:
        report.notes.append(
            "workload: fewer than 5 records with prefill; length distributions kept from the base"
        )
        return base
    tokens = float(sum(s.tokens for s in steps))
    prompt_med = float(np.median(pf))
    out_mean = tokens / len(pf)
    sigma = float(np.std(np.log(pf))) if len(pf) > 1 else base.prompt_sigma
    report.fitted.append("workload.prompt (from prefill_tokens), workload.output mean (tokens per admission)")
    report.notes.append(
        "workload: a record's prefill_tokens may sum several admissions, so prompt lengths are upper estimates"
    )
    # Log-normal with the base's spread: median = mean · exp(−σ²/2).
    out_med = out_mean * math.exp(-(base.output_sigma**2) / 2.0)
    return replace(
        base,
        prompt_median_tokens=prompt_med,
        prompt_sigma=max(min(sigma, 2.0), 0.05),
        output_median_tokens=float(max(out_med, base.output_min_tokens)),
    )


def _fit_engine(steps: list[Step], base: EngineParams, report: FitReport) -> EngineParams:
    bs_max = max(s.bs for s in steps)
    ratios = [s.ctx_tokens / s.kv_usage for s in steps if s.kv_usage > 0.02 and s.ctx_tokens > 0]
    # The traces' pool is the speculating server's (the drafter's weights and KV already
    # carried): store the drafter-free budget that gives it (EngineParams.spec_kv_budget_tokens).
    budget = base.plain_budget_for(int(np.median(ratios))) if ratios else base.kv_budget_tokens
    if not ratios:
        report.notes.append("engine: no record with kv_usage > 2%; KV budget kept from the base")
    else:
        report.fitted.append("engine.kv_budget_tokens (ctx_tokens / kv_usage, the drafter's memory added back)")
    instance = steps[0].instance
    return replace(
        base,
        max_running_requests=max(base.max_running_requests, bs_max),
        kv_budget_tokens=budget,
        instance=instance,
    )


# --------------------------------------------------------------------------- entry point


def fit_sim(
    traces_dir: str | None,
    profiles: list[str],
    base: SimParams | None = None,
    off_path: str | None = None,
    off_draft: str | None = None,
    pin_passes: bool = False,
    copy_tb_s: float | None = None,
) -> tuple[SimParams, FitReport]:
    """Fit a simulator to a trace folder and/or latency-profile CSVs.

    Args:
        traces_dir: a folder of ``runs/*.msgpack`` traces, or None.
        profiles: profile CSVs in the format of ``reference/h200_llama8b/latency.csv``.
        base: parameters for what the data cannot identify (default: the bundled
            ``h200-llama8b`` deployment when it can be loaded, else the built-in defaults).
        off_path: how the traced server ran depth 0 (``"plain"``: the off switch;
            ``"verify"``: SGLang's own width-1 verify, whose extra cost the traces then fit);
            None keeps the base's.
        off_draft: what the traced server's drafter did at depth 0 (``--spec-off-draft``: a
            key of :data:`env.latency.OFF_EXTEND`), so its depth-0 steps are read as the target
            plus that share of the drafter's extend; None keeps the base's (the bundled
            deployments price ``kv``, the hook's default).
        pin_passes: keep ``base``'s pass terms and fit only the traces' per-step overheads and
            admissions, as after a profile: ``base`` is another server's fit on the same GPU and
            model. For a server whose records cannot separate the passes from the overheads,
            e.g. the plain server's (one depth, no drafter), whose steps run the same target
            passes as the speculative server's depth 0 around other scheduler work.
        copy_tb_s: the traced GPU's memory copy bandwidth (TB/s): no KV coefficient is fitted
            below one token of one layer's KV (the engine's bytes per token over the layers)
            copied at it (:func:`kv_floor_us_per_tok`). None keeps the base's declared floor
            (the bundled H200 deployments: 4.24 TB/s, measured).

    Returns:
        The fitted :class:`SimParams` and a printable :class:`FitReport`.

    Raises:
        FitError: no input, or input that cannot be used; the message names the file and
            the problem (empty folder, corrupt or truncated file, missing columns, too few
            usable records).
    """
    import pandas as pd

    if not traces_dir and not profiles:
        raise FitError("nothing to fit: give a trace folder and/or at least one profile CSV")
    if base is None:
        try:
            from env.deployments import load_deployment

            base = load_deployment("h200-llama8b")
        except Exception:  # noqa: BLE001 — the bundled file is optional here; defaults are documented
            base = SimParams(acceptance=calibrate_to_conditionals([0.73, 0.71, 0.68]))
    report = FitReport(profiles=list(profiles), traces=traces_dir)
    lp = base.latency if off_path is None else replace(base.latency, off_path=off_path)
    if copy_tb_s is not None:
        if not copy_tb_s > 0.0:
            raise FitError(f"copy_tb_s must be a positive bandwidth in TB/s, got {copy_tb_s!r}")
        lp = replace(lp, kv_floor_us_per_tok=kv_floor_us_per_tok(base.engine.kv_bytes_per_token, lp.layers, copy_tb_s))
    if off_draft is not None:
        if off_draft not in OFF_EXTEND:
            raise FitError(f"off_draft must be one of {', '.join(OFF_EXTEND)}, got {off_draft!r}")
        lp = replace(lp, off_extend=OFF_EXTEND[off_draft])

    if profiles:
        frames = [read_profile(p) for p in profiles]
        df = pd.concat(frames, ignore_index=True)
        report.n_profile_rows = len(df)
        rng = np.random.default_rng(12345)
        hold = rng.random(len(df)) < HOLDOUT_FRAC
        lp_ho, _ = fit_profile(df[~hold], lp)
        report.profile_mape_holdout = profile_mape(lp_ho, df[hold])
        lp, report.profile_mape_fit = fit_profile(df, lp)
        report.fitted.append("latency pass terms (profiles)")
    elif pin_passes:
        report.notes.append("latency: pass terms as the base fit's (pinned); overheads and admissions from the traces")
    else:
        report.notes.append(
            "latency: no profile; pass-term shape from the base deployment, scaled to the traces"
        )

    ap = base.acceptance
    wp = base.workload
    ep = base.engine
    if traces_dir:
        recs = load_steps(traces_dir)
        all_steps = _flat(recs)
        report.n_steps = len(all_steps)
        fit_recs, hold_recs = _split(recs)
        fit_steps, hold_steps = _flat(fit_recs), _flat(hold_recs)
        pinned = bool(profiles) or pin_passes  # the pass terms are measured or given: traces add the overheads
        lp_ho = fit_step_latency(lp, fit_steps, overheads_only=pinned)
        lp_ho, _ = fit_admission(lp_ho, fit_recs)
        report.step_mape_holdout = step_mape(lp_ho, hold_steps)
        lp = fit_step_latency(lp, all_steps, overheads_only=pinned)
        lp, n_admit = fit_admission(lp, recs)
        if n_admit:
            report.fitted.append(
                f"admission cost {lp.admit_us / 1000:.1f} ms + {lp.admit_seq_us:.0f} us per running request "
                f"- {lp.admit_hide:.2f} x the step it joins, at least 0 "
                f"({n_admit} admissions; a record with prefill and the one before it)"
            )
        report.step_mape_fit = step_mape(lp, all_steps)
        report.fitted.append(
            ("latency per-step overheads (traces)" if pinned else "latency overheads and cost-class scales (traces)")
            + ("; SGLang's depth-0 verify cost v0_fix_us, v0_seq_us" if lp.off_path == "verify" else "")
        )

        acc_recs = recs
        first, n_resumed, other, _ = resume_acceptance([[(s.depth, s.accept) for s in run] for run in recs.values()])
        lost = n_resumed >= MIN_RESUMES and first < RESUME_LOST_BELOW * other
        if lost:
            # The resumes' zeros are the off switch's, not the drafter's: model them as such,
            # and fit the drafter's acceptance on the other steps.
            ap = with_resume_loss(ap)
            acc_recs = _without_resumes(recs)
            report.fitted.append(
                f"a resume loses its drafts: the first draft token accepted on {first:.2f} of the requests "
                f"of {n_resumed} drafted steps right after depth 0, against {other:.2f} on the others"
            )
        # The hook's kv off switch (the plain depth 0) resumes warm unless it lost its resumes'
        # drafts (resumed cold: SPECDEPTH_OFF_RESUME=cold or a hook from before 2026-12-06): one
        # more depth-0 step. SGLang's own depth 0 and keep run the whole extend: nothing inserted.
        ep = replace(ep, warm_resume=not lost and (off_draft or "kv") == "kv" and lp.off_path == "plain")
        if ep.warm_resume:
            report.notes.append(
                f"the off switch resumes warm (one more depth-0 step before drafting): the hook's default, and no "
                f"resume loss in the traces ({n_resumed} drafted steps right after depth 0)"
            )
        ap, fall = fit_context_fall(_flat(acc_recs), ap)
        if fall:
            report.fitted.append(fall)
        fit_acc, hold_acc = _split(acc_recs)
        counts_fit, counts_hold = accept_counts(_flat(fit_acc), ap), accept_counts(_flat(hold_acc), ap)
        counts_all = accept_counts(_flat(acc_recs), ap)
        n_entries = int(sum(c.sum() for c in counts_all.values()))
        report.accept_entries = n_entries
        if n_entries < 50:
            report.notes.append(
                f"acceptance: {n_entries} accept entries at depth > 0 (traces without speculation?); "
                + ("kept the base fit's" if pin_passes else "kept the published defaults (reference/acceptance.md)")
            )
        else:
            if sum(c.sum() for c in counts_fit.values()) >= 50:
                ap_ho, _ = fit_acceptance(counts_fit, ap, step_weighted=True)
                report.accept_tv_holdout = _tv(ap_ho, counts_hold)
            ap, _ = fit_acceptance(counts_all, ap, step_weighted=True)
            report.accept_tv_fit = _tv(ap, counts_all)
            report.fitted.append("acceptance alpha, beta, sigma, p_zero (ML over accept lists)")
        wp = _fit_workload(all_steps, wp, report)
        ep = _fit_engine(all_steps, ep, report)
    params = replace(
        base, latency=lp, acceptance=ap, workload=wp, engine=ep, name="fitted",
        notes=f"fitted by controller fit from traces={traces_dir!r}, profiles={list(profiles)!r}",
    )  # fmt: skip
    return params, report


def predict_profile(params: SimParams, holdout_csv: str):
    """Predict ``median_ms`` for every row of a profile CSV; returns (DataFrame with
    ``predicted_ms`` added, MAPE per component)."""
    from env.latency import KNOWN_COMPONENTS, predict_component_ms

    df = read_profile(holdout_csv)
    pred = np.full(len(df), np.nan)
    for comp in set(df["component"]):
        mask = (df["component"] == comp).to_numpy()
        if comp in KNOWN_COMPONENTS:
            sub = df[mask]
            pred[mask] = predict_component_ms(params.latency, comp, sub["batch"], sub["q"], sub["ctx"])
    out = df.copy()
    out["predicted_ms"] = pred
    mape: dict[str, float] = {}
    for comp, sub in out.groupby("component"):
        if sub["predicted_ms"].notna().all():
            mape[str(comp)] = float(
                (abs(sub["predicted_ms"] - sub["median_ms"]) / sub["median_ms"]).mean() * 100
            )
    return out, mape


# --------------------------------------------------------------------------- extrapolation

EXTRAPOLATION_SPLITS = {
    "long context (fit ctx <= 2048, predict ctx > 2048)": ("ctx", 2048),
    "large batch (fit batch <= 32, predict batch > 32)": ("batch", 32),
}
"""Held-out splits of a profile: fit on rows with the column ≤ the limit, predict the rest."""
PART_ORDER = (
    "target decode", "target verify", "draft", "draft_nofc", "target_gemm", "target_attn_split", "target_attn_fa2",
)  # fmt: skip


def extrapolation_report(df) -> list[dict[str, Any]]:
    """Fit the latency model on each split of :data:`EXTRAPOLATION_SPLITS` and score the rows the
    fit never saw: per part (target decode, target verify, draft, draft_nofc, and the attention
    and GEMM decompositions) the row count, MAPE (%) and the worst row.

    Returns:
        One dict per (split, part): ``split``, ``part``, ``rows``, ``mape_pct``,
        ``worst_pct`` (signed), ``worst_row`` (``B=… q=… ctx=…``).
    """
    from env.latency import profile_errors

    out: list[dict[str, Any]] = []
    for split, (col, limit) in EXTRAPOLATION_SPLITS.items():
        seen = df[col] <= limit
        lp, _ = fit_profile(df[seen])
        errs = profile_errors(lp, df[~seen])
        for part in PART_ORDER:
            sub = errs[errs["part"] == part]
            if sub.empty:
                continue
            worst = sub.loc[sub["err_pct"].abs().idxmax()]
            out.append(
                {
                    "split": split,
                    "part": str(part),
                    "rows": int(len(sub)),
                    "mape_pct": float(sub["err_pct"].abs().mean()),
                    "worst_pct": float(worst["err_pct"]),
                    "worst_row": f"B={int(worst['batch'])} q={int(worst['q'])} ctx={int(worst['ctx'])}",
                }
            )
    return out


# --------------------------------------------------------------------------- against real traces

DEFAULT_BS_BINS = ((1, 4), (5, 11), (12, 19), (20, 27), (28, 35), (36, 55), (56, 71))
"""Batch-size bins of :func:`trace_step_table` (inclusive); the real H200 traces run C = 1, 4,
16 and 64, so each C's steps (its ramp-up and drain spread them) fall in one or two bins."""


def decode_step_arrays(steps: list[Step]) -> tuple[np.ndarray, ...]:
    """``bs, depth, ctx, us`` of the prefill-free decode steps of ``steps`` (the first record
    of each list measures more than one step and is left out)."""
    bs, depth, ctx, pf, us = _step_arrays(steps)
    keep = pf == 0
    return bs[keep], depth[keep], ctx[keep], us[keep]


def trace_step_table(
    lp: LatencyParams,
    steps: list[Step],
    bins: tuple[tuple[int, int], ...] = DEFAULT_BS_BINS,
    ctx_bins: tuple[tuple[int, int], ...] = ((0, 1 << 40),),
) -> dict[str, Any]:
    """The latency model's step time against traced ``step_us``, per (depth, context bin,
    batch-size bin).

    Only prefill-free decode steps (:func:`decode_step_arrays`): a prefill's cost is a term of
    its own and its chunk sizes differ between runs. Medians (not means), because a record after
    an idle gap or a host stall measures more than the step. ``ctx_bins``: cached tokens per
    sequence, inclusive (default: one bin).

    Returns:
        ``rows``: one dict per (depth, context bin, batch bin) with steps — ``depth``,
        ``ctx_lo``, ``ctx_hi``, ``bs_lo``, ``bs_hi``, ``n``, ``real_ms`` (median traced),
        ``pred_ms`` (median predicted), ``ratio`` (median of the per-step predicted / real),
        ``mape_pct`` (the row's steps); ``worst``: the row whose ratio is farthest from 1;
        ``mape_pct`` over all the steps, ``mape_k0_pct`` over the k = 0 ones and
        ``mape_spec_pct`` over the k > 0 ones.
    """
    bs, depth, ctx, us = decode_step_arrays(steps)
    pred = step_times_us(lp, bs, depth, ctx, np.zeros_like(bs))
    ratio = pred / us
    err = np.abs(ratio - 1.0) * 100.0
    per_seq = ctx / np.maximum(bs, 1.0)
    rows = []
    for k in sorted({int(d) for d in depth}):
        for c_lo, c_hi in ctx_bins:
            for lo, hi in bins:
                m = (depth == k) & (per_seq >= c_lo) & (per_seq <= c_hi) & (bs >= lo) & (bs <= hi)
                if not m.any():
                    continue
                rows.append(
                    {
                        "depth": k,
                        "ctx_lo": c_lo,
                        "ctx_hi": c_hi,
                        "bs_lo": lo,
                        "bs_hi": hi,
                        "n": int(m.sum()),
                        "real_ms": float(np.median(us[m]) / 1000.0),
                        "pred_ms": float(np.median(pred[m]) / 1000.0),
                        "ratio": float(np.median(ratio[m])),
                        "mape_pct": float(err[m].mean()),
                    }
                )

    def mape(m: np.ndarray) -> float:
        return float(err[m].mean()) if m.any() else float("nan")

    return {
        "rows": rows,
        "worst": max(rows, key=lambda r: abs(math.log(r["ratio"]))) if rows else None,
        "n": int(len(us)),
        "mape_pct": mape(np.ones(len(err), dtype=bool)),
        "mape_k0_pct": mape(depth == 0),
        "mape_spec_pct": mape(depth > 0),
    }
