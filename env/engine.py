"""The engine model: an SGLang server doing EAGLE-3 decoding under continuous batching.

Steppable and discrete-event with an integer µs clock. One :meth:`Engine.step` call advances
to the next decode step and runs it at the depth given:

1. arrivals up to now join the waiting queue (FIFO);
2. admission: waiting requests join the running batch while there is room under
   ``max_running_requests`` and the KV budget, up to ``chunked_prefill_tokens`` of prompt per
   step (at least one request); each reserves ``prompt + output`` KV tokens (the output length
   is the request's ``max_new_tokens``, which the server knows — benchmark clients fix it),
   so the pool can never overflow. Their prompts are prefilled before the decode and the
   prefill time is part of this step's ``step_us``. Prefill emits no token here: every
   output token comes from a decode step, so tokens are conserved step by step;
3. if nothing is running, the clock jumps to the next arrival (the hook sends nothing while
   the server idles; the gap lands in the next record's ``step_us``, as on the wire);
4. the decode/verify step: its time from the latency model (× log-normal jitter), per request
   the accepted drafts from the acceptance model, each request emitting
   ``min(accept + 1, remaining)`` tokens (the record's ``accept`` is that minus one);
5. finished requests leave and free their reservation; a closed-loop client sends its next
   request at that instant.

Invariants (tested in ``tests/test_engine_invariants.py``): Σ over records of
``Σ(accept + 1)`` equals the tokens the requests received; the clock never goes back; no
request receives more than its output length; reserved and used KV never exceed the budget;
the same seed gives the same records. Nothing in a record depends on a request's true output
length or acceptance except through what happened (as on the live hook).

Per-request state lives in one float64 matrix (exact for integers below 2**53) so that a
whole step is a handful of vectorized numpy operations.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from controller.errors import ConfigError
from controller.protocol import Step
from env.latency import step_time_us
from env.params import SimParams
from env.workload import Arrivals, WorkloadSpec, parse_workload

# Columns of the per-request state matrix.
CTX, GEN, OUT, U, PEN, ZS, TARR, TFIRST, RID, PROMPT = range(10)
N_COLS = 10
_BLOCK = 4096


class SimulationDone(ConfigError):
    """``step`` was called after the workload's last request completed."""


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One completed request (times in µs on the simulator clock)."""

    rid: int
    arrival_us: int
    first_token_us: int
    finish_us: int
    prompt_tokens: int
    output_tokens: int

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first, ms (0 for one-token outputs)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_us - self.first_token_us) / (self.output_tokens - 1) / 1000.0


class Engine:
    """Discrete-event model of one SGLang replica (see module docstring).

    Args:
        params: the deployment.
        workload: a workload spec string (see :mod:`env.workload`) or a parsed spec.
        start_ns: the hook's monotonic clock at simulated time 0 (``ts_ns`` base).
    """

    def __init__(
        self, params: SimParams, workload: str | WorkloadSpec, start_ns: int = 1_000_000_000
    ) -> None:
        self.params = params
        self.spec = (
            workload
            if isinstance(workload, WorkloadSpec)
            else parse_workload(workload, params.workload.presets)
        )
        self.start_ns = start_ns
        self._cap = max(1, params.engine.max_running_requests)
        self.reset(0)

    # ------------------------------------------------------------------ lifecycle

    def reset(self, seed: int | None = 0, params: SimParams | None = None) -> None:
        """Start over: empty server, clock 0, RNG streams derived from ``seed``."""
        if params is not None:
            self.params = params
            self._cap = max(1, params.engine.max_running_requests)
        p = self.params
        ss = np.random.SeedSequence(seed)
        wl_ss, acc_ss, lat_ss, drift_ss = ss.spawn(4)
        self._rng_acc = np.random.default_rng(acc_ss)
        self._rng_lat = np.random.default_rng(lat_ss)
        self._rng_drift = np.random.default_rng(drift_ss)
        self.arrivals = Arrivals(self.spec, p.workload, p.acceptance.code_shift, np.random.default_rng(wl_ss))
        self._lat_noise = self._rng_lat.standard_normal(_BLOCK) * p.latency.jitter
        self._lat_i = 0
        self._drift_noise = self._rng_drift.standard_normal(_BLOCK)
        self._drift_i = 0
        self._base = p.acceptance.base_logits(64)
        self.S = np.zeros((self._cap, N_COLS), dtype=np.float64)
        self.n = 0
        self.waiting: deque[tuple[int, int, int, float, int]] = deque()
        self.now_us = 0
        self.last_record_us = 0
        self.seq = 0
        self.kv_reserved = 0
        self.drift = self._rng_drift.normal(0.0, p.acceptance.drift_sd) if p.acceptance.drift_sd > 0 else 0.0
        self.completed: list[RequestStats] = []
        self.tokens_emitted = 0
        self.prefill_pending = 0
        self.next_rid = 0
        self.last_model_us = 0.0
        self.last_base_us = 0.0
        self.last_busy_us = 0
        self.rejected = 0
        self._pull_arrivals()

    @property
    def done(self) -> bool:
        """True when no request is running, queued, or still to arrive."""
        return self.n == 0 and not self.waiting and self.arrivals.peek() is None

    # ------------------------------------------------------------------ admission

    def _pull_arrivals(self) -> None:
        arr = self.arrivals
        t = arr.peek()
        while t is not None and t <= self.now_us:
            t_us, prompt, out, shift = arr.pop()
            self.waiting.append((t_us, prompt, out, shift, self.next_rid))
            self.next_rid += 1
            t = arr.peek()

    def _admit(self) -> int:
        """Move waiting requests into the batch; returns prompt tokens prefilled."""
        if not self.waiting:
            return 0
        e = self.params.engine
        ap = self.params.acceptance
        budget = e.kv_budget_tokens
        chunk = e.chunked_prefill_tokens
        prefilled = 0
        S = self.S
        while self.waiting and self.n < self._cap:
            t_us, prompt, out, shift, rid = self.waiting[0]
            need = prompt + out
            if self.kv_reserved + need > budget:
                if self.n == 0 and need > budget:
                    # A request that can never fit would block the queue forever; SGLang
                    # rejects it at the door. Drop it (counted) rather than deadlock.
                    self.waiting.popleft()
                    self.rejected += 1
                    continue
                break
            if prefilled > 0 and prefilled + prompt > chunk:
                break
            self.waiting.popleft()
            if self._rng_acc.random() < ap.p_zero:
                u = ap.zero_logit
            else:
                u = ap.sigma * self._rng_acc.standard_normal()
            row = S[self.n]
            row[CTX] = prompt
            row[GEN] = 0
            row[OUT] = out
            row[U] = u + shift
            row[PEN] = 0.0
            row[ZS] = 0.0
            row[TARR] = t_us
            row[TFIRST] = -1.0
            row[RID] = rid
            row[PROMPT] = prompt
            self.n += 1
            self.kv_reserved += need
            prefilled += prompt
        return prefilled

    # ------------------------------------------------------------------ stepping

    def step(self, depth: int) -> Step:
        """Advance to the next decode step, run it at ``depth``, return its record.

        Raises:
            SimulationDone: the workload has no request left (check :attr:`done`).
        """
        if depth < 0:
            raise ConfigError(f"depth must be >= 0, got {depth}")
        self._pull_arrivals()
        prefill = self._admit()
        while self.n == 0:
            t_next = self.arrivals.peek()
            if t_next is None:
                if self.waiting:
                    prefill += self._admit()
                    if self.n:
                        break
                raise SimulationDone("the workload has no request left; check Engine.done before step()")
            self.now_us = max(self.now_us, t_next)
            self._pull_arrivals()
            prefill += self._admit()
        self.prefill_pending += prefill
        n = self.n
        S = self.S
        A = S[:n]
        lp = self.params.latency
        ap = self.params.acceptance
        ctx_sum = float(A[:, CTX].sum())
        pf = self.prefill_pending
        model_us = step_time_us(lp, n, depth, ctx_sum, pf)
        base_us = model_us if depth == 0 else step_time_us(lp, n, 0, ctx_sum, pf)
        if self._lat_i >= _BLOCK:
            self._lat_noise = self._rng_lat.standard_normal(_BLOCK) * lp.jitter
            self._lat_i = 0
        busy = max(1, int(model_us * math.exp(self._lat_noise[self._lat_i])))
        self._lat_i += 1

        rem = A[:, OUT] - A[:, GEN]
        if depth > 0:
            logits = self._base[:depth] + (A[:, U] + (self.drift - A[:, PEN]))[:, None]
            ok = self._rng_acc.random((n, depth)) * (1.0 + np.exp(-logits)) < 1.0
            acc = ok.cumprod(axis=1).sum(axis=1)
            emitted = np.minimum(acc + 1.0, rem)
            # The stale penalty fades while drafting; the zero-step run resets.
            A[:, PEN] *= math.exp(-1.0 / ap.stale_recover_steps)
            A[:, ZS] = 0.0
        else:
            emitted = np.minimum(1.0, rem)
            zs = A[:, ZS]
            zs += 1.0
            np.maximum(A[:, PEN], ap.stale_logit * (1.0 - np.exp(-zs / ap.stale_tau_steps)), out=A[:, PEN])
        A[:, GEN] += emitted
        A[:, CTX] += emitted
        tokens = int(emitted.sum())
        self.tokens_emitted += tokens

        self.now_us += busy
        now = self.now_us
        first = A[:, TFIRST] < 0.0
        if first.any():
            A[first, TFIRST] = now
        step_us = now - self.last_record_us
        self.last_record_us = now
        self._advance_drift(busy)

        accept = (emitted - 1.0).astype(np.int64).tolist() if depth > 0 else []
        kv_used = float(A[:, CTX].sum())
        finished = A[:, GEN] >= A[:, OUT]
        if finished.any():
            self._finish(finished, now)
        self._pull_arrivals()
        self.last_model_us = model_us
        self.last_base_us = base_us
        self.last_busy_us = busy
        self.prefill_pending = 0
        rec = Step(
            instance=self.params.engine.instance,
            seq=self.seq,
            depth=depth,
            bs=n,
            waiting=len(self.waiting),
            accept=accept,
            step_us=int(step_us),
            ctx_tokens=int(ctx_sum),
            kv_usage=min(1.0, kv_used / self.params.engine.kv_budget_tokens),
            prefill_tokens=int(pf),
            ts_ns=self.start_ns + now * 1000,
        )
        self.seq += 1
        return rec

    def _finish(self, finished: np.ndarray, now: int) -> None:
        n = self.n
        A = self.S[:n]
        for row in A[finished]:
            self.completed.append(
                RequestStats(
                    rid=int(row[RID]),
                    arrival_us=int(row[TARR]),
                    first_token_us=int(row[TFIRST]),
                    finish_us=now,
                    prompt_tokens=int(row[PROMPT]),
                    output_tokens=int(row[GEN]),
                )
            )
            self.kv_reserved -= int(row[PROMPT] + row[OUT])
            self.arrivals.on_complete(now)
        keep = ~finished
        k = int(keep.sum())
        self.S[:k] = A[keep]
        self.n = k

    def _advance_drift(self, dt_us: int) -> None:
        ap = self.params.acceptance
        if ap.drift_sd <= 0.0:
            return
        if self._drift_i >= _BLOCK:
            self._drift_noise = self._rng_drift.standard_normal(_BLOCK)
            self._drift_i = 0
        a = math.exp(-dt_us / (ap.drift_tau_s * 1e6))
        self.drift = (
            self.drift * a + ap.drift_sd * math.sqrt(max(0.0, 1.0 - a * a)) * self._drift_noise[self._drift_i]
        )
        self._drift_i += 1

    # ------------------------------------------------------------------ oracle access

    def expected_tokens(self, depth: int) -> float:
        """TRUE expected tokens the current batch emits in one step at ``depth`` (ground
        truth: reads true acceptance and output lengths; never an observation)."""
        n = self.n
        if n == 0:
            return 0.0
        A = self.S[:n]
        rem = A[:, OUT] - A[:, GEN]
        if depth == 0:
            return float(np.minimum(1.0, rem).sum())
        logits = self._base[:depth] + (A[:, U] + (self.drift - A[:, PEN]))[:, None]
        reach = np.cumprod(1.0 / (1.0 + np.exp(-logits)), axis=1)  # P(accept >= j), j = 1..depth
        j = np.arange(1, depth + 1)
        reach = np.where(j[None, :] <= (rem - 1.0)[:, None], reach, 0.0)
        return float(np.minimum(1.0, rem).sum() + reach.sum())

    def expected_rate(self, depth: int) -> float:
        """TRUE expected tokens/s of the next step at ``depth`` for the current batch, using
        the true per-request acceptance and the latency model (for the clairvoyant oracle)."""
        if self.n == 0:
            return 0.0
        ctx_sum = float(self.S[: self.n, CTX].sum())
        t_us = step_time_us(self.params.latency, self.n, depth, ctx_sum, self.prefill_pending)
        return self.expected_tokens(depth) / t_us * 1e6

    # ------------------------------------------------------------------ introspection

    @property
    def kv_used(self) -> int:
        """KV tokens held by the running requests."""
        return int(self.S[: self.n, CTX].sum())

    def running_state(self) -> np.ndarray:
        """A copy of the running requests' state matrix (columns: CTX, GEN, OUT, ...)."""
        return self.S[: self.n].copy()
