"""The open-loop shifting trace: Poisson arrivals whose rate and task mix change over the run.

Every policy gets the same trace (deterministic from ``seed``, ``duration_s`` and
``peak_rps``): the same arrival times, families, prompts and output lengths, so greedy outputs
compare request by request. Over normalized time ``u = t / duration_s``:

* **rate** (requests/s) follows :data:`RATE_KNOTS` (fractions of ``peak_rps``, linear between
  knots): a trickle, a ramp to overload, and back down to a trickle. At the default 80/s with
  160 output tokens a request on average, the peak asks for 12.8k tokens/s: above the 8.7-9.1k
  a plain server gave at C=128 in the off-switch calls (bench/results/realgpu/offswitch), so a
  backlog builds in SGLang's queue and drains as the rate falls;
* **mix** shifts chat -> code -> docs: ``w_chat = clip(1.5 - 3u)``, ``w_docs = clip(3u - 1.5)``,
  ``w_code = 1 - w_chat - w_docs``: chat alone until ``u = 1/6``, code alone at ``u = 1/2``
  (the overload), docs alone from ``u = 5/6``, linear blends in between.

So no static depth fits the whole run: at the start a trickle of chat (high acceptance, small
batches: deep drafts pay), in the middle an overload of code (large batches: shallow drafts
or none), at the end a trickle of docs (acceptance 6.5%: drafting wastes work at any load).

Arrivals come from thinning a homogeneous Poisson process of rate ``peak_rps`` (Lewis-Shedler),
with one ``random.Random`` stream for times and families and one per request for its prompt.

Stdlib only (runs under the device image's python3; ``run_open`` needs aiohttp there).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed  # noqa: E402
from loadgen import RequestResult, _one, _pct, connector  # noqa: E402

# (u, fraction of peak_rps): trickle, ramp to overload, hold, back down, trickle.
RATE_KNOTS: tuple[tuple[float, float], ...] = (
    (0.00, 0.02),
    (0.15, 0.02),
    (0.40, 1.00),
    (0.55, 1.00),
    (0.75, 0.10),
    (0.85, 0.02),
    (1.00, 0.02),
)
FAMILY_ORDER = ("chat", "code", "docs")


@dataclass(frozen=True)
class OpenSpec:
    """One open-loop trace. ``duration_s`` is the arrival window; the run lasts until the last
    request finishes (the overload's backlog drains after it)."""

    duration_s: float = 180.0
    peak_rps: float = 80.0
    input_tokens: int = 256
    min_output_tokens: int = 64
    max_output_tokens: int = 256
    seed: int = 0


@dataclass(frozen=True)
class Arrival:
    idx: int
    t_s: float
    family: str
    output_tokens: int


def rate(u: float, peak_rps: float) -> float:
    """Requests/s at normalized time ``u`` in [0, 1] (linear between :data:`RATE_KNOTS`)."""
    u = min(max(u, 0.0), 1.0)
    for (u0, f0), (u1, f1) in zip(RATE_KNOTS, RATE_KNOTS[1:]):
        if u <= u1:
            return peak_rps * (f0 + (f1 - f0) * (u - u0) / (u1 - u0))  # knots strictly increase in u
    return peak_rps * RATE_KNOTS[-1][1]


def mix(u: float) -> dict[str, float]:
    """Family weights at normalized time ``u`` (module docstring); they sum to 1."""
    u = min(max(u, 0.0), 1.0)
    chat = min(1.0, max(0.0, 1.5 - 3.0 * u))
    docs = min(1.0, max(0.0, 3.0 * u - 1.5))
    return {"chat": chat, "code": 1.0 - chat - docs, "docs": docs}


def arrivals(spec: OpenSpec) -> list[Arrival]:
    """The trace's requests in arrival order (deterministic from ``spec``)."""
    rng = random.Random(spec.seed)
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(spec.peak_rps)
        if t >= spec.duration_s:
            return out
        u = t / spec.duration_s
        if rng.random() * spec.peak_rps > rate(u, spec.peak_rps):
            continue
        w = mix(u)
        fam = rng.choices(FAMILY_ORDER, weights=[w[f] for f in FAMILY_ORDER])[0]
        n_out = rng.randint(spec.min_output_tokens, spec.max_output_tokens)
        out.append(Arrival(len(out), round(t, 6), fam, n_out))


def prompt(spec: OpenSpec, a: Arrival) -> list[int]:
    """Request ``a``'s prompt: ``input_tokens`` tokens of its family (own RNG stream per request)."""
    return testbed.prompt(random.Random(spec.seed * 1_000_003 + a.idx), a.family, spec.input_tokens)


def describe(spec: OpenSpec, bins: int = 10) -> list[dict[str, Any]]:
    """Per time bin: arrivals, their rate, and the share of each family (for the report)."""
    arr = arrivals(spec)
    width = spec.duration_s / bins
    rows = []
    for b in range(bins):
        inside = [a for a in arr if b * width <= a.t_s < (b + 1) * width]
        fams = {f: sum(a.family == f for a in inside) for f in FAMILY_ORDER}
        rows.append({"t0_s": round(b * width, 1), "requests": len(inside), "rps": round(len(inside) / width, 2),
                     **{f: round(n / max(1, len(inside)), 3) for f, n in fams.items()}})  # fmt: skip
    return rows


def _raise_fd_limit() -> None:
    """One connection per request in flight: an overload's backlog can pass the usual soft
    limit of 1024 open files, so take the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


async def _run(url: str, spec: OpenSpec, timeout_s: float) -> tuple[list[RequestResult], float]:
    import aiohttp

    _raise_fd_limit()
    arr = arrivals(spec)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # open loop: every arrival is sent when it is due (no limit on connections)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector(0)) as session:
        t0 = time.perf_counter()

        async def one(a: Arrival) -> RequestResult:
            delay = a.t_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await _one(session, url, a.idx, prompt(spec, a), a.output_tokens)

        results = await asyncio.gather(*(one(a) for a in arr))
        wall = time.perf_counter() - t0
    return sorted(results, key=lambda r: r.idx), wall


def run_open(url: str, spec: OpenSpec, timeout_s: float = 900.0) -> dict[str, Any]:
    """Send the trace to the server at ``url``; a summary shaped like ``loadgen.run_load``'s.

    ``throughput_tok_s`` is output tokens over the wall time from the first arrival to the last
    completion; ``tpot_mean_ms`` is the mean over requests of (end - first token) / (tokens - 1).
    ``concurrency`` is 0 (open loop).
    """
    results, wall = asyncio.run(_run(url, spec, timeout_s))
    ok = [r for r in results if r.ok]
    tpots = [r.tpot_ms for r in ok]
    verify = sum(r.verify_ct for r in ok)
    return {
        **asdict(spec),
        "concurrency": 0,
        "n_requests": len(results),
        "throughput_tok_s": sum(r.out_tokens for r in results) / wall if wall > 0 else 0.0,
        "tpot_mean_ms": statistics.fmean(tpots) if tpots else float("nan"),
        "tpot_p50_ms": _pct(tpots, 0.5),
        "tpot_p99_ms": _pct(tpots, 0.99),
        "ttft_mean_ms": statistics.fmean([r.ttft_ms for r in ok]) if ok else float("nan"),
        "ttft_p99_ms": _pct([r.ttft_ms for r in ok], 0.99),
        "accept_len_mean": (sum(r.out_tokens for r in ok) / verify) if verify else 0.0,
        "accepted_drafts_histogram": [],
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall,
        "requests": [asdict(r) for r in results],
    }
