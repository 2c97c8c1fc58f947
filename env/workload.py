"""Workloads: arrivals and request lengths, named by a spec string.

Spec grammar: ``BASE[@key=value,...]``

=================================  ==========================================================
BASE                               meaning
=================================  ==========================================================
``closed:C``                       closed loop: C clients, each sends its next request the
                                   moment the previous one completes (the seed's benchmark)
``poisson:RATE``                   open loop, Poisson arrivals at RATE requests/s
``burst:LO,HI,PERIOD_S[,DUTY]``    on/off Poisson: HI req/s for DUTY (default 0.2) of every
                                   PERIOD_S seconds, LO req/s otherwise
``ramp:R0,R1,DURATION_S``          Poisson with the rate ramping linearly R0 → R1 over
                                   DURATION_S, then held at R1
``wave:LO,HI,PERIOD_S``            Poisson with the rate swinging LO → HI → LO every PERIOD_S
                                   (raised cosine, starting at LO): a trickle to overload and
                                   back
``phase:PERIOD_S:BASE``            BASE's arrivals; requests arriving in odd half-periods are
                                   code-like (acceptance shifted by ``code_shift``, or by
                                   ``odd_shift``), even ones chat-like: an acceptance phase
                                   shift every PERIOD_S/2 (and a length shift with ``odd_long``)
``replay:PATH``                    arrivals replayed: a CSV with ``arrival_s,prompt_tokens``
                                   (and optionally ``output_tokens``, and ``zero_accept`` as
                                   for ``requests=``), or a trace folder, where every record
                                   with ``prefill_tokens > 0`` becomes arrivals of that many
                                   prompt tokens at its ``ts_ns``
``preset:NAME``                    a spec stored in the deployment (``workload.presets``)
=================================  ==========================================================

Options after ``@`` (comma-separated ``key=value``):

=============================  ================================================================
option                         meaning
=============================  ================================================================
``prompt=N`` / ``output=N``    fix the lengths (tokens) instead of drawing them from the
                               deployment's distributions; ``prompt=LO-HI``: log-uniform;
                               ``output=N~S``: log-normal, median N, sigma S (within the
                               deployment's output bounds; ``bench/h200/loadgen.py`` draws so)
``accept_shift=X``             add X logits to every request's acceptance
``n=N``                        stop arrivals after N requests (the episode then ends when they
                               complete)
``long=F:LO-HI``               a fraction F of requests has a long prompt, log-uniform in
                               LO..HI tokens (a mix of short requests and long documents)
``mix=TASK:F+TASK:F...``       the task of each request, drawn with these fractions (the rest
                               ``chat``): its acceptance is shifted by :data:`TASK_SHIFTS`
``odd_shift=X``                with ``phase:``, the acceptance shift of odd half-periods
                               (default: the deployment's ``code_shift``)
``odd_long=F:LO-HI``           with ``phase:``, ``long`` for requests arriving in odd
                               half-periods (even ones keep ``long``, or none)
``requests=PATH``              the requests themselves, in the order they are sent: a CSV with
                               ``prompt_tokens,output_tokens`` and optionally ``zero_accept``
                               (1: a request the drafter cannot help, the fitted acceptance's
                               zero part; 0: the other part; absent: drawn, as without it);
                               arrivals stop after its last row (a benchmark's exact requests,
                               ``bench/h200/realgpu_sim.py``)
=============================  ================================================================

Example: ``closed:1@prompt=128,output=256,accept_shift=1.0``;
``phase:20:closed:32@accept_shift=-3,odd_shift=4`` alternates between a drafter that accepts
almost nothing (−3 logits) and one better than the fit (+1) every 10 s.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from controller.errors import ConfigError
from env.errors import FitError

# Per-task acceptance offsets (logits) for ``mix=``, calibrated with the acceptance model
# (``env.acceptance.mean_accept_length``) on both bundled deployments to the published EAGLE-3
# figures (``reference/acceptance.md``): code and math accept more than chat — the EAGLE-3
# model card's accepted lengths at T=1, k=7 are MT-bench 2.77, HumanEval 3.49, GSM8K 3.34 —
# and long documents are drafted badly (5–8% acceptance, vLLM issue #52258).
# ``tests/test_suite.py`` checks the calibration.
TASK_SHIFTS: dict[str, float] = {"chat": 0.0, "code": 0.55, "math": 0.44, "longdoc": -3.7}


@dataclass(frozen=True)
class WorkloadParams:
    """Request-length distributions (log-normal, clipped) and named workload presets."""

    prompt_median_tokens: float = 512.0
    prompt_sigma: float = 0.8
    prompt_min_tokens: int = 16
    prompt_max_tokens: int = 8192
    output_median_tokens: float = 256.0
    output_sigma: float = 0.7
    output_min_tokens: int = 8
    output_max_tokens: int = 2048
    presets: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> WorkloadParams:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FitError(f"workload params: unknown keys {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed workload spec (see module docstring)."""

    kind: str
    args: tuple[float, ...] = ()
    path: str = ""
    phase_period_s: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    accept_shift: float = 0.0
    n_requests: int | None = None
    text: str = ""
    prompt_range: tuple[int, int] | None = None
    long_frac: float = 0.0
    long_range: tuple[int, int] = (4096, 16384)
    odd_long_frac: float | None = None
    odd_long_range: tuple[int, int] = (4096, 16384)
    task_mix: tuple[tuple[str, float], ...] = ()
    odd_shift: float | None = None
    output_sigma: float | None = None
    requests_path: str = ""


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi)
    if not 0 < a <= b:
        raise ValueError
    return a, b


def _frac_range(text: str) -> tuple[float, tuple[int, int]]:
    f, _, rng = text.partition(":")
    frac = float(f)
    if not 0.0 <= frac <= 1.0:
        raise ValueError
    return frac, _range(rng) if rng else (4096, 16384)


def _task_mix(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in text.split("+"):
        name, _, f = part.partition(":")
        if name not in TASK_SHIFTS:
            raise ConfigError(f"mix: unknown task {name!r} (known: {', '.join(TASK_SHIFTS)})")
        frac = float(f)
        if frac < 0:
            raise ValueError
        out.append((name, frac))
    if sum(f for _, f in out) > 1.0 + 1e-9:
        raise ValueError
    return tuple(out)


def parse_workload(spec: str, presets: dict[str, str] | None = None) -> WorkloadSpec:
    """Parse a workload spec string; raises :class:`ConfigError` naming what is wrong."""
    text = spec.strip()
    base, _, opts = text.partition("@")
    kw: dict[str, Any] = {}
    if opts:
        for item in opts.split(","):
            key, eq, val = item.partition("=")
            key = key.strip()
            try:
                if not eq:
                    raise ValueError
                if key == "prompt" and "-" in val:
                    kw["prompt_range"] = _range(val)
                elif key == "long":
                    kw["long_frac"], kw["long_range"] = _frac_range(val)
                elif key == "odd_long":
                    kw["odd_long_frac"], kw["odd_long_range"] = _frac_range(val)
                elif key == "mix":
                    kw["task_mix"] = _task_mix(val)
                elif key == "odd_shift":
                    kw["odd_shift"] = float(val)
                elif key == "output" and "~" in val:
                    median, _, sigma = val.partition("~")
                    kw["output_tokens"], kw["output_sigma"] = int(median), float(sigma)
                    if kw["output_tokens"] <= 0 or not kw["output_sigma"] >= 0:
                        raise ValueError
                elif key in ("prompt", "output", "n"):
                    num = int(val)
                    if num <= 0:
                        raise ValueError
                    kw[{"prompt": "prompt_tokens", "output": "output_tokens", "n": "n_requests"}[key]] = num
                elif key == "accept_shift":
                    kw["accept_shift"] = float(val)
                elif key == "requests":
                    if not val:
                        raise ValueError
                    kw["requests_path"] = val
                else:
                    raise ConfigError(
                        f"workload {spec!r}: unknown option {key!r} (prompt, output, accept_shift, n, "
                        "long, mix, odd_shift, odd_long, requests)"
                    )
            except ValueError:
                raise ConfigError(
                    f"workload {spec!r}: option {item!r} needs a positive number (a range LO-HI, "
                    "a log-normal N~S, a fraction F:LO-HI, TASK:F+TASK:F, or a PATH)"
                ) from None
    kind, _, rest = base.partition(":")
    if kind == "preset":
        if not presets or rest not in presets:
            known = ", ".join(sorted(presets or {})) or "none"
            raise ConfigError(f"workload {spec!r}: unknown preset {rest!r} (this deployment has: {known})")
        inner = parse_workload(presets[rest], None)
        return WorkloadSpec(**{**inner.__dict__, **kw, "text": text})
    if kind == "phase":
        period, _, inner_text = rest.partition(":")
        try:
            period_s = float(period)
            if period_s <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"workload {spec!r}: phase needs PERIOD_S > 0, as in phase:60:closed:32"
            ) from None
        inner = parse_workload(inner_text, presets)
        return WorkloadSpec(**{**inner.__dict__, **kw, "phase_period_s": period_s, "text": text})
    if kind == "replay":
        if not rest:
            raise ConfigError(f"workload {spec!r}: replay needs a PATH")
        return WorkloadSpec(kind="replay", path=rest, text=text, **kw)  # type: ignore[arg-type]
    nargs = {"closed": (1, 1), "poisson": (1, 1), "burst": (3, 4), "ramp": (3, 3), "wave": (3, 3)}
    if kind not in nargs:
        raise ConfigError(
            f"workload {spec!r}: unknown kind {kind!r}; use closed:C, poisson:RATE, burst:LO,HI,PERIOD_S[,DUTY], "
            "ramp:R0,R1,DURATION_S, wave:LO,HI,PERIOD_S, phase:PERIOD_S:BASE, replay:PATH or preset:NAME"
        )
    try:
        args = tuple(float(x) for x in rest.split(",")) if rest else ()
    except ValueError:
        raise ConfigError(f"workload {spec!r}: arguments must be numbers") from None
    lo, hi = nargs[kind]
    if not lo <= len(args) <= hi or any(a < 0 or not math.isfinite(a) for a in args):
        raise ConfigError(f"workload {spec!r}: {kind} takes {lo}..{hi} non-negative numbers")
    if kind == "closed" and (args[0] < 1 or args[0] != int(args[0])):
        raise ConfigError(f"workload {spec!r}: closed:C needs an integer C >= 1")
    if kind in ("burst", "ramp", "wave") and args[2] <= 0:
        raise ConfigError(f"workload {spec!r}: the period/duration must be > 0")
    return WorkloadSpec(kind=kind, args=args, text=text, **kw)  # type: ignore[arg-type]


# One request as it arrives: (t_us, prompt_tokens, output_tokens, accept_shift, zero_accept);
# zero_accept None: the engine draws the request's acceptance part itself.
Arrival = tuple[int, int, int, float, "bool | None"]


class Arrivals:
    """Generates the request stream of one workload, from its own RNG stream.

    Open-loop arrivals are produced lazily in time order by :meth:`peek`/:meth:`pop`;
    closed-loop arrivals are triggered by completions (:meth:`on_complete`).
    """

    def __init__(
        self, spec: WorkloadSpec, wp: WorkloadParams, code_shift: float, rng: np.random.Generator
    ) -> None:
        self.spec = spec
        self.wp = wp
        self.code_shift = code_shift
        self.rng = rng
        self.issued = 0
        self.closed = int(spec.args[0]) if spec.kind == "closed" else 0
        self._next_t: int | None = None
        self._replay: list[tuple[int, int, int | None, bool | None]] = []
        self._replay_i = 0
        self._pending: list[Arrival] = []  # closed-loop arrivals due
        if spec.kind == "replay":
            self._replay = load_replay(spec.path)
        # requests=PATH: each issued request's lengths (and acceptance part) from its row.
        self._requests = load_requests(spec.requests_path) if spec.requests_path else []
        self.limit = spec.n_requests
        if self._requests:
            self.limit = len(self._requests) if self.limit is None else min(self.limit, len(self._requests))
        if self.closed:
            for _ in range(self.closed):
                self._issue_closed(0)
        else:
            self._advance(0)

    # -- lengths ---------------------------------------------------------------
    def _odd(self, t_us: int) -> bool:
        """Whether ``t_us`` falls in an odd half-period of a ``phase:`` workload."""
        if self.spec.phase_period_s <= 0:
            return False
        return int(t_us // (self.spec.phase_period_s * 5e5)) % 2 == 1

    def _lengths(self, t_us: int = 0) -> tuple[int, int]:
        if self._requests:
            prompt, out, _ = self._requests[self.issued]
            return prompt, out
        wp, s = self.wp, self.spec
        frac, rng_lh = s.long_frac, s.long_range
        if s.odd_long_frac is not None and self._odd(t_us):
            frac, rng_lh = s.odd_long_frac, s.odd_long_range
        # Extra draws only for the options that need them: specs without them consume the
        # stream exactly as before.
        long = frac > 0.0 and self.rng.random() < frac
        if long:
            lo, hi = rng_lh
            prompt = int(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))
        elif s.prompt_range is not None:
            lo, hi = s.prompt_range
            prompt = int(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))
        elif s.prompt_tokens is not None:
            prompt = s.prompt_tokens
        else:
            draw = wp.prompt_median_tokens * math.exp(wp.prompt_sigma * self.rng.standard_normal())
            prompt = int(min(max(draw, wp.prompt_min_tokens), wp.prompt_max_tokens))
        if s.output_tokens is not None and s.output_sigma is None:
            out = s.output_tokens
        else:
            median = wp.output_median_tokens if s.output_tokens is None else s.output_tokens
            sigma = wp.output_sigma if s.output_sigma is None else s.output_sigma
            draw = median * math.exp(sigma * self.rng.standard_normal())
            out = int(min(max(draw, wp.output_min_tokens), wp.output_max_tokens))
        return prompt, out

    def shift_at(self, t_us: int, prompt: int = 0) -> float:
        """Acceptance offset (logits) of a request arriving at ``t_us`` with ``prompt`` tokens."""
        s = self.spec
        shift = s.accept_shift
        if s.phase_period_s > 0:
            half_us = s.phase_period_s * 5e5
            if int(t_us // half_us) % 2 == 1:
                shift += self.code_shift if s.odd_shift is None else s.odd_shift
        if s.task_mix:
            u = self.rng.random()
            for name, frac in s.task_mix:
                if u < frac:
                    shift += TASK_SHIFTS[name]
                    break
                u -= frac
        return shift

    def _zero(self) -> bool | None:
        """The acceptance part of the request about to be issued, if ``requests=`` fixes it."""
        return self._requests[self.issued][2] if self._requests else None

    def _exhausted(self) -> bool:
        return self.limit is not None and self.issued >= self.limit

    # -- open loop ---------------------------------------------------------------
    def _rate(self, t_s: float) -> float:
        k, a = self.spec.kind, self.spec.args
        if k == "poisson":
            return a[0]
        if k == "burst":
            duty = a[3] if len(a) > 3 else 0.2
            return a[1] if (t_s % a[2]) < duty * a[2] else a[0]
        if k == "ramp":
            return a[0] + (a[1] - a[0]) * min(t_s / a[2], 1.0)
        if k == "wave":
            return a[0] + (a[1] - a[0]) * 0.5 * (1.0 - math.cos(2.0 * math.pi * t_s / a[2]))
        return 0.0

    def _advance(self, now_us: int) -> None:
        """Draw the next open-loop arrival after ``now_us`` (thinning for time-varying rates)."""
        if self._exhausted():
            self._next_t = None
            return
        if self.spec.kind == "replay":
            if self._replay_i < len(self._replay):
                self._next_t = self._replay[self._replay_i][0]
            else:
                self._next_t = None
            return
        a = self.spec.args
        rmax = max(a[:2]) if self.spec.kind in ("burst", "ramp", "wave") else a[0]
        if rmax <= 0:
            self._next_t = None
            return
        t = now_us / 1e6
        while True:
            t += self.rng.exponential(1.0 / rmax)
            if self.rng.random() * rmax <= self._rate(t):
                break
        self._next_t = max(int(t * 1e6), now_us)

    def peek(self) -> int | None:
        """Time (µs) of the next arrival, or None if no more will come on their own."""
        if self._pending:
            return self._pending[0][0]
        return self._next_t

    def pop(self) -> Arrival:
        """The next arrival: (t_us, prompt_tokens, output_tokens, accept_shift, zero_accept)."""
        if self._pending:
            return self._pending.pop(0)
        t = self._next_t
        assert t is not None
        zero = self._zero()
        if self.spec.kind == "replay":
            _, prompt, out, replay_zero = self._replay[self._replay_i]
            self._replay_i += 1
            if out is None or self.spec.output_tokens is not None:
                out = self._lengths(t)[1]
            zero = zero if replay_zero is None else replay_zero
        else:
            prompt, out = self._lengths(t)
        self.issued += 1
        shift = self.shift_at(t, prompt)
        self._advance(t)
        return t, prompt, out, shift, zero

    # -- closed loop ---------------------------------------------------------------
    def _issue_closed(self, t_us: int) -> None:
        if self._exhausted():
            return
        prompt, out = self._lengths(t_us)
        zero = self._zero()
        self.issued += 1
        self._pending.append((t_us, prompt, out, self.shift_at(t_us, prompt), zero))

    def on_complete(self, t_us: int) -> None:
        """A request completed at ``t_us``: in a closed loop its client sends the next one."""
        if self.closed:
            self._issue_closed(t_us)


def _read_csv(what: str, path: str, need: tuple[str, ...], columns: str) -> Any:
    """``path`` as a pandas frame with at least the columns ``need`` and one row.

    Raises:
        ConfigError: unreadable, a missing column (``columns`` says which are expected), or no
            rows; names ``what`` and the path.
    """
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path}: cannot read ({type(exc).__name__})") from None
    for col in need:
        if col not in df.columns:
            raise ConfigError(f"{what} {path}: missing column {col!r} (need {columns})")
    if len(df) == 0:
        raise ConfigError(f"{what} {path}: no rows")
    return df


def _zero_accept(row: Any, has_column: bool) -> bool | None:
    """A CSV row's acceptance part (``requests=`` and ``replay:``): True for ``zero_accept`` 1
    (a request the drafter cannot help, the fitted acceptance's zero part), False for 0 (the
    other part), None where it is blank or there is no such column (the engine draws it).

    Raises:
        ValueError: any other value.
    """
    z = row.zero_accept if has_column else None
    zero = None if z is None or (isinstance(z, float) and math.isnan(z)) else float(z)
    if zero not in (None, 0.0, 1.0):
        raise ValueError
    return None if zero is None else zero == 1.0


def load_requests(path: str) -> list[tuple[int, int, bool | None]]:
    """The requests of ``requests=PATH``, in order: [(prompt_tokens, output_tokens,
    zero_accept|None)].

    Raises:
        ConfigError: unreadable file, missing columns, bad values, or no rows; names the path.
    """
    df = _read_csv("requests", path, ("prompt_tokens", "output_tokens"), "prompt_tokens, output_tokens[, zero_accept]")
    has_zero = "zero_accept" in df.columns
    rows: list[tuple[int, int, bool | None]] = []
    for i, r in enumerate(df.itertuples(index=False)):
        try:
            prompt, out = int(r.prompt_tokens), int(r.output_tokens)  # type: ignore[attr-defined]
            zero = _zero_accept(r, has_zero)
            if prompt < 1 or out < 1:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(
                f"requests {path}: row {i + 1} needs prompt_tokens, output_tokens >= 1 and zero_accept 0, 1 or blank"
            ) from None
        rows.append((prompt, out, zero))
    return rows


def load_replay(path: str) -> list[tuple[int, int, int | None, bool | None]]:
    """Arrivals to replay: [(t_us from the first arrival, prompt_tokens, output_tokens|None,
    zero_accept|None)] (a trace folder's: no output length or acceptance part).

    Raises:
        ConfigError: unreadable file, missing columns, bad values, or no arrivals; names the path.
    """
    if os.path.isdir(path):
        from controller.traces import step_records

        recs = step_records(path)
        out: list[tuple[int, int, int | None, bool | None]] = []
        for steps in recs.values():
            for s in steps:
                if s.prefill_tokens > 0:
                    out.append((s.ts_ns // 1000, s.prefill_tokens, None, None))
        if not out:
            raise ConfigError(f"replay {path}: no step records with prefill_tokens > 0 to replay")
        out.sort()
        t0 = out[0][0]
        return [(t - t0, p, o, z) for t, p, o, z in out]
    columns = "arrival_s, prompt_tokens[, output_tokens, zero_accept]"
    df = _read_csv("replay", path, ("arrival_s", "prompt_tokens"), columns)
    df = df.sort_values("arrival_s")
    has_out, has_zero = "output_tokens" in df.columns, "zero_accept" in df.columns
    rows = []
    for r in df.itertuples():
        try:
            t_s, prompt = float(r.arrival_s), max(int(r.prompt_tokens), 1)  # type: ignore[attr-defined]
            out_tok = int(r.output_tokens) if has_out else None  # type: ignore[attr-defined]
            zero = _zero_accept(r, has_zero)
        except (TypeError, ValueError):
            raise ConfigError(
                f"replay {path}: row {int(r.Index) + 1} needs numbers arrival_s, prompt_tokens"
                "[, output_tokens] and zero_accept 0, 1 or blank"
            ) from None
        rows.append((t_s, prompt, out_tok, zero))
    t0_s = rows[0][0]
    return [(int((t_s - t0_s) * 1e6), p, o, z) for t_s, p, o, z in rows]
