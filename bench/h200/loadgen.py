"""Closed-loop load generator for an SGLang server: throughput, TTFT and TPOT at concurrency C.

Each of ``C`` workers sends its next request as soon as the previous one finished, so about C
requests are always in flight. Requests are token-id prompts drawn from a seeded RNG, so every
policy sees the same prompts and greedy outputs can be compared token for token. Streaming is
on, so the time to the first chunk is the TTFT; TPOT = (end - first chunk) / (tokens - 1).

Runs under the device image's python3 (stdlib + aiohttp only).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed  # noqa: E402


@dataclass(frozen=True)
class LoadSpec:
    """One measurement: ``n_requests`` requests at concurrency ``concurrency``."""

    concurrency: int
    n_requests: int
    input_tokens: int = 256
    output_tokens: int = 128
    seed: int = 0
    mix: str = ""  # testbed families, comma-separated, drawn per request ("": any token, as before)
    # > 0: each request's output length log-normal around output_tokens (the simulator's
    # ``output=N~S``: median N, sigma S, within 8..2048 tokens); 0: every request N tokens.
    output_sigma: float = 0.0


@dataclass
class RequestResult:
    idx: int
    ok: bool
    error: str = ""
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    out_tokens: int = 0
    tpot_ms: float = 0.0
    verify_ct: int = 0
    accept_len: float = 0.0
    histogram: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def prompts(spec: LoadSpec) -> list[list[int]]:
    """The request prompts of ``spec``: random token ids, reproducible from ``spec.seed``.

    With a ``mix``, each request's family is drawn from it and its tokens from that family's
    range (``testbed.py``); :func:`families` gives the draws.
    """
    rng = random.Random(spec.seed)
    return [testbed.prompt(rng, fam, spec.input_tokens) for fam in families(spec)]


OUTPUT_BOUNDS = (8, 2048)  # env.workload.WorkloadParams' output_min_tokens, output_max_tokens


def output_lengths(spec: LoadSpec) -> list[int]:
    """Each request's output length: ``output_tokens``, or with ``output_sigma`` a draw
    ``median·exp(sigma·N(0, 1))`` within :data:`OUTPUT_BOUNDS`, as ``env.workload`` draws for
    ``output=N~S`` (stdlib here: this runs before the carried packages are unpacked; a test
    checks the two draw one distribution). The same for every policy at a given seed."""
    if spec.output_sigma <= 0:
        return [spec.output_tokens] * spec.n_requests
    rng = random.Random(spec.seed + 104_729)
    lo, hi = OUTPUT_BOUNDS
    return [
        int(min(max(spec.output_tokens * math.exp(spec.output_sigma * rng.gauss(0.0, 1.0)), lo), hi))
        for _ in range(spec.n_requests)
    ]


def families(spec: LoadSpec) -> list[str]:
    """Each request's testbed family (``""`` without a mix)."""
    names = [f for f in spec.mix.split(",") if f]
    rng = random.Random(spec.seed + 7_919)
    return [rng.choice(names) if names else "" for _ in range(spec.n_requests)]


def steady_throughput(
    timelines: list[list[tuple[float, int]]], sent: list[float], concurrency: int
) -> tuple[float, float] | None:
    """Output tokens per second while all ``concurrency`` clients are busy: ``(tok/s, seconds)``.

    A closed-loop point of N requests spends its end draining: once the last request is sent,
    fewer than C are in flight, and with mixed acceptance or drawn lengths the slowest requests
    set the wall time (with 2C requests the drain was 40-76% of a point's time on the H100
    testbed). The window here runs from the moment each of the first C requests has its first
    token to the moment the last request is sent. ``timelines[i]``: request i's streamed chunks
    as (seconds since the point began, tokens so far); ``sent[i]``: when it was sent, in the
    same clock. None when the window is empty (too few requests for C)."""
    if len(sent) <= concurrency or len(timelines) != len(sent):
        return None
    first = sorted(range(len(sent)), key=lambda i: sent[i])[:concurrency]
    if any(not timelines[i] for i in first):
        return None
    t_a = max(timelines[i][0][0] for i in first)
    t_b = max(sent)
    if t_b <= t_a:
        return None

    def tokens_at(chunks: list[tuple[float, int]], t: float) -> int:
        n = 0
        for when, so_far in chunks:
            if when > t:
                break
            n = so_far
        return n

    made = sum(tokens_at(c, t_b) - tokens_at(c, t_a) for c in timelines)
    return made / (t_b - t_a), t_b - t_a


async def _one(
    session: Any, url: str, idx: int, ids: list[int], out_tokens: int, chunks: list[tuple[float, int]] | None = None,
    origin: float = 0.0,
) -> RequestResult:
    """One streamed request; ``chunks`` (when given) collects (seconds since ``origin``, tokens so far)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    t0 = time.perf_counter()
    first = 0.0
    last: dict[str, Any] | None = None
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                return RequestResult(idx, False, f"http {resp.status}: {(await resp.text())[:200]}")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    line, buf = buf.split(b"\n\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    if not first:
                        first = time.perf_counter()
                    last = json.loads(payload)
                    if chunks is not None:
                        got = (last.get("meta_info") or {}).get("completion_tokens")
                        if isinstance(got, int):
                            chunks.append((time.perf_counter() - origin, got))
    except Exception as exc:  # a dropped connection is a failed request, not a crash of the bench
        return RequestResult(idx, False, f"{type(exc).__name__}: {exc}"[:300])
    t1 = time.perf_counter()
    if last is None or "error" in last:
        return RequestResult(idx, False, f"no result: {str(last)[:200]}")
    meta = last.get("meta_info", {})
    n = int(meta.get("completion_tokens", len(last.get("output_ids", []))))
    ttft = (first - t0) * 1e3
    e2e = (t1 - t0) * 1e3
    return RequestResult(
        idx=idx,
        ok=n == out_tokens,
        error="" if n == out_tokens else f"{n} of {out_tokens} tokens",
        ttft_ms=ttft,
        e2e_ms=e2e,
        out_tokens=n,
        tpot_ms=(e2e - ttft) / max(1, n - 1),
        verify_ct=int(meta.get("spec_verify_ct", 0)),
        accept_len=float(meta.get("spec_accept_length", 0.0)),
        histogram=list(meta.get("spec_correct_drafts_histogram") or []),
        output_ids=list(last.get("output_ids", [])),
    )


# SGLang's HTTP server (uvicorn) closes a keep-alive connection idle for 5 s
# (SGLANG_TIMEOUT_KEEP_ALIVE); aiohttp keeps idle ones for 15 s by default, so a request could go
# out on a connection the server was closing and fail with "Server disconnected" (1 of 770
# requests in each of two open-loop runs on calls AB and AD). Idle ones are dropped first here.
KEEPALIVE_S = 2.0


def connector(limit: int) -> Any:
    """The client's connection pool: ``limit`` connections at most (0: no limit)."""
    import aiohttp

    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S)


async def _run(url: str, spec: LoadSpec, timeout_s: float) -> tuple[list[RequestResult], float, tuple[float, float] | None]:
    import aiohttp

    lengths = output_lengths(spec)
    work = list(enumerate(prompts(spec)))
    results: list[RequestResult] = []
    timelines: list[list[tuple[float, int]]] = [[] for _ in work]
    sent = [0.0] * len(work)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector(spec.concurrency + 4)) as session:
        t0 = time.perf_counter()

        async def worker() -> None:
            while work:
                idx, ids = work.pop(0)
                sent[idx] = time.perf_counter() - t0
                results.append(await _one(session, url, idx, ids, lengths[idx], timelines[idx], t0))

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        wall = time.perf_counter() - t0
    results.sort(key=lambda r: r.idx)
    return results, wall, steady_throughput(timelines, sent, spec.concurrency)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def run_load(url: str, spec: LoadSpec, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ``spec`` against the server at ``url``; returns a summary and the per-request rows.

    Returns:
        dict with ``throughput_tok_s`` (output tokens / wall time), ``steady_tok_s`` and
        ``steady_s`` (:func:`steady_throughput`), ``tpot_mean_ms``,
        ``tpot_p99_ms``, ``ttft_mean_ms``, ``accept_len_mean`` (tokens per verify, bonus
        included), ``failed`` (requests that errored or came back short), ``wall_s`` and
        ``requests`` (per-request dicts, output ids included).
    """
    results, wall, steady = asyncio.run(_run(url, spec, timeout_s))
    ok = [r for r in results if r.ok]
    tpots = [r.tpot_ms for r in ok]
    verify = sum(r.verify_ct for r in ok)
    hist: list[int] = []
    for r in ok:
        for i, c in enumerate(r.histogram):
            if i >= len(hist):
                hist.extend([0] * (i + 1 - len(hist)))
            hist[i] += c
    return {
        **asdict(spec),
        "throughput_tok_s": sum(r.out_tokens for r in results) / wall if wall > 0 else 0.0,
        # while all C clients were busy (steady_throughput); None with too few requests
        "steady_tok_s": steady[0] if steady else None,
        "steady_s": steady[1] if steady else None,
        "tpot_mean_ms": statistics.fmean(tpots) if tpots else float("nan"),
        "tpot_p50_ms": _pct(tpots, 0.5),
        "tpot_p99_ms": _pct(tpots, 0.99),
        "ttft_mean_ms": statistics.fmean([r.ttft_ms for r in ok]) if ok else float("nan"),
        "accept_len_mean": (sum(r.out_tokens for r in ok) / verify) if verify else 0.0,
        "accepted_drafts_histogram": hist,
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall,
        "requests": [asdict(r) for r in results],
    }


def start_load(url: str, spec: LoadSpec, timeout_s: float = 300.0) -> Callable[[], dict[str, Any]]:
    """:func:`run_load` on a thread, for work done while a load runs (a profile, a stack sample,
    a controller killed mid-load). Returns ``join``: waits for the load and gives its summary
    (``{}`` if it raised)."""
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.update(m=run_load(url, spec, timeout_s=timeout_s)))
    th.start()

    def join() -> dict[str, Any]:
        th.join()
        return box.get("m", {})

    return join
