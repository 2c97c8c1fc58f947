"""The engine model: an SGLang server doing EAGLE-3 decoding under continuous batching.

Steppable and discrete-event with an integer µs clock. One :meth:`Engine.step` call advances
to the next decode step and runs it at the depth given:

1. arrivals up to now join the waiting queue (FIFO), once through the server's request path
   (``EngineParams.request_latency_us``/``request_serial_us``; none by default);
2. admission: waiting requests join the running batch while there is room under
   ``max_running_requests`` and the KV budget (``spec_kv_budget_tokens``: the drafter's
   weights and KV carried), up to ``chunked_prefill_tokens`` of uncached prompt per
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

Speed: per-request state is a few contiguous arrays (hot: remaining tokens, logit offset,
stale penalty) plus one cold float64 matrix (exact for integers below 2**53) touched only on
admission and completion; acceptance is sampled by comparing logistic noise (from uniforms
drawn in blocks) minus the position logits with each request's offset. The decode step proper
(latency, acceptance, remaining tokens, stale penalty, drift) is one kernel, :func:`_decode`,
compiled by numba when installed (:mod:`controller._jit`); arrivals, admission, completion
and all random draws stay in Python, so the RNG streams are consumed exactly as without it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from controller._jit import maybe_njit
from controller.errors import ConfigError
from controller.protocol import Step
from env.latency import prefill_pairs, step_coeffs, step_time_us, step_times_kernel
from env.params import SimParams
from env.workload import Arrivals, WorkloadSpec, parse_workload

# Columns of the cold per-request state matrix (touched on admission and completion only).
U, TARR, TFIRST, RID, PROMPT, OUT = range(6)
N_COLS = 6
_BLOCK = 4096
_ACC_ROWS = 32768  # rows of pre-drawn uniforms per refill (one row per request-step)
_MAX_POS = 64  # draft positions the acceptance model covers (the deepest depth)


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
        self._lat_noise = (self._rng_lat.standard_normal(_BLOCK) * p.latency.jitter).tolist()
        self._lat_i = 0
        self._drift_noise = self._rng_drift.standard_normal(_BLOCK).tolist()
        self._drift_i = 0
        self._base = p.acceptance.base_logits(_MAX_POS)
        self._acc_k = 5  # the default deepest depth; grows on demand
        self._acc_noise = self._draw_acc_noise()
        self._acc_i = 0
        cap = self._cap
        # Per-request state in two arrays (each array argument costs a kernel call ~0.1 µs),
        # one column per request; the attributes below are views of their rows.
        self._ints = np.zeros((2, cap), dtype=np.int64)
        self._floats = np.zeros((2 + N_COLS, cap), dtype=np.float64)
        self.rem = self._ints[0]  # output tokens still to emit (>= 1 while running)
        self.zs = self._ints[1]  # consecutive steps without drafting
        self.xoff = self._floats[0]  # u + shift - stale penalty (logits)
        self.pen = self._floats[1]  # stale-drafter penalty (logits)
        self.S = self._floats[2:].T  # the cold columns U .. OUT, one row per request
        self._acc_buf = np.zeros(cap, dtype=np.int64)  # the kernel's accepted drafts per request
        self._done_rows = np.zeros((cap, N_COLS), dtype=np.float64)  # S rows of retired requests
        ap = p.acceptance
        if ap.stale_logit > 0.0:
            k = np.arange(int(20 * ap.stale_tau_steps) + 2, dtype=np.float64)
            stale_table = ap.stale_logit * (1.0 - np.exp(-k / ap.stale_tau_steps))
        else:
            stale_table = np.zeros(0, dtype=np.float64)  # no stale penalty
        self._pen_active = False
        pen_decay = math.exp(-1.0 / ap.stale_recover_steps)
        # Every constant the kernel reads, in one array (layout: _decode's docstring).
        self._lat_c = step_coeffs(p.latency)
        self._consts = np.concatenate(
            [
                [pen_decay, 1.0 / pen_decay - 1.0, ap.drift_sd, ap.drift_tau_s * 1e6, ap.ctx_ref_tokens, ap.ctx_logit],
                self._base,
                stale_table,
            ]
        )
        e = p.engine
        self._req_lat_us = int(e.request_latency_us)
        self._req_serial_us = int(e.request_serial_us)
        self._ingress_on = self._req_lat_us > 0 or self._req_serial_us > 0
        self._ingress_us = -(10**18)  # when the request path last let a request through
        self.ctx_sum = 0  # Σ sequence lengths of the running requests
        self.n = 0
        # (t_us, prompt, out, shift, rid, zero_accept): see env.workload.Arrival
        self.waiting: deque[tuple[int, int, int, float, int, bool | None]] = deque()
        self.now_us = 0
        self.last_record_us = 0
        self.seq = 0
        self.kv_reserved = 0
        self.drift = (
            float(self._rng_drift.normal(0.0, p.acceptance.drift_sd)) if p.acceptance.drift_sd > 0 else 0.0
        )
        # Hot-path constants (Python floats/lists index faster than numpy scalars).
        self._instance = p.engine.instance
        self._kv_budget = p.engine.spec_kv_budget_tokens  # the drafter's weights and KV carried
        self._drift_on = p.acceptance.drift_sd > 0.0
        self.completed: list[RequestStats] = []
        self.tokens_emitted = 0
        self.prefill_pending = 0
        self.pairs_pending = 0.0  # the pending prefills' attention pairs (env.latency.prefill_pairs)
        self.last_pairs = 0.0  # ... the last step's (its record carries only the prefilled tokens)
        self.next_rid = 0
        self.last_model_us = 0.0
        self.last_base_us = 0.0
        self.last_busy_us = 0
        self.last_tokens = 0  # tokens the last step emitted (its record's ``tokens``)
        self.rejected = 0
        self._pull_arrivals()

    @property
    def done(self) -> bool:
        """True when no request is running, queued, or still to arrive."""
        return self.n == 0 and not self.waiting and self.arrivals.peek() is None

    # ------------------------------------------------------------------ admission

    def _next_ready(self) -> int | None:
        """When the next arriving request reaches the scheduler (None: no request left).

        A request passes the server's request path first (HTTP, tokenizer; ``EngineParams``
        ``request_latency_us`` each, ``request_serial_us`` apart: one tokenizer process), so
        it joins the waiting queue then; its arrival time (for TTFT) stays the client's."""
        t = self.arrivals.peek()
        if t is None or not self._ingress_on:
            return t
        return max(t + self._req_lat_us, self._ingress_us + self._req_serial_us)

    def _pull_arrivals(self) -> None:
        arr = self.arrivals
        r = self._next_ready()
        while r is not None and r <= self.now_us:
            t_us, prompt, out, shift, zero = arr.pop()
            self._ingress_us = r
            self.waiting.append((t_us, prompt, out, shift, self.next_rid, zero))
            self.next_rid += 1
            r = self._next_ready()

    def _admit(self) -> int:
        """Move waiting requests into the batch; returns prompt tokens prefilled."""
        if not self.waiting:
            return 0
        e = self.params.engine
        ap = self.params.acceptance
        budget = self._kv_budget
        chunk = e.chunked_prefill_tokens
        hit = e.prefix_cache_hit
        prefilled = 0
        while self.waiting and self.n < self._cap:
            t_us, prompt, out, shift, rid, zero = self.waiting[0]
            need = prompt + out
            if self.kv_reserved + need > budget:
                if self.n == 0 and need > budget:
                    # A request that can never fit would block the queue forever; SGLang
                    # rejects it at the door. Drop it (counted) rather than deadlock.
                    self.waiting.popleft()
                    self.rejected += 1
                    continue
                break
            # The part of the prompt found in the radix cache is not prefilled (still in the KV).
            uncached = prompt - int(prompt * hit)
            if prefilled > 0 and prefilled + uncached > chunk:
                break
            self.waiting.popleft()
            if zero is None:  # drawn (the stream is consumed only then)
                zero = self._rng_acc.random() < ap.p_zero
            u = ap.zero_logit if zero else ap.sigma * self._rng_acc.standard_normal()
            _admit_row(self._ints, self._floats, self.n, u + shift, t_us, rid, prompt, out)
            self.ctx_sum += prompt
            self.n += 1
            self.kv_reserved += need
            prefilled += uncached
            self.pairs_pending += prefill_pairs(uncached, prompt - uncached)
        return prefilled

    # ------------------------------------------------------------------ stepping

    def _draw_acc_noise(self) -> np.ndarray:
        # Uniforms u, one per (request-step, position): position i of a request with offset x
        # is accepted iff log(u/(1-u)) - base_i < x (logistic noise), i.e. with probability
        # sigmoid(base_i + x). The kernel turns only the uniforms it reads into logistic
        # noise — a request stops at its first rejection — the same values, from the same
        # stream positions, as Generator.logistic over the whole block (which also redraws a
        # uniform of exactly 0.0, probability 2**-53 per value: the one case that differs).
        return self._rng_acc.random((_ACC_ROWS, self._acc_k))

    def step(self, depth: int) -> Step:
        """Advance to the next decode step, run it at ``depth``, return its record.

        Raises:
            SimulationDone: the workload has no request left (check :attr:`done`).
        """
        if not 0 <= depth <= _MAX_POS:  # the kernel reads one logit per draft position
            raise ConfigError(
                f"depth must be in 0..{_MAX_POS} (the acceptance model's positions), got {depth}"
            )
        n_before = self.n
        t_next = self._next_ready()
        if self.waiting or (t_next is not None and t_next <= self.now_us):
            self._pull_arrivals()
            prefill = self._admit()
        else:
            prefill = 0
        while self.n == 0:
            t_next = self._next_ready()
            if t_next is None:
                raise SimulationDone("the workload has no request left; check Engine.done before step()")
            self.now_us = max(self.now_us, t_next)
            self._pull_arrivals()
            prefill += self._admit()
        self.prefill_pending += prefill
        n = self.n
        ctx_sum = self.ctx_sum
        pf = self.prefill_pending
        # Random draws stay here, in the order and blocks the streams always had.
        if self._lat_i >= _BLOCK:
            self._lat_noise = (self._rng_lat.standard_normal(_BLOCK) * self.params.latency.jitter).tolist()
            self._lat_i = 0
        lat_eps = self._lat_noise[self._lat_i]
        self._lat_i += 1
        i0 = 0
        if depth > 0:
            if depth > self._acc_k:
                self._acc_k = min(max(depth, 2 * self._acc_k), _MAX_POS)
                self._acc_noise = self._draw_acc_noise()
                self._acc_i = 0
            i0 = self._acc_i
            if i0 + n > _ACC_ROWS:
                self._acc_noise = self._draw_acc_noise()
                i0 = 0
            self._acc_i = i0 + n
        drift_eps = 0.0
        if self._drift_on:
            if self._drift_i >= _BLOCK:
                self._drift_noise = self._rng_drift.standard_normal(_BLOCK).tolist()
                self._drift_i = 0
            drift_eps = self._drift_noise[self._drift_i]
            self._drift_i += 1

        # Two kernel calls: numba's cache of a kernel is invalidated when its own file
        # changes, not when a kernel it calls from another file does, so none calls across.
        self.last_pairs = self.pairs_pending
        model_us, base_us = step_times_kernel(self._lat_c, n, depth, ctx_sum, pf, self.last_pairs)
        busy, tokens, self.drift, self._pen_active, n_done = _decode(
            self._consts,
            self._ints,
            self._floats,
            self._acc_noise,
            self._acc_buf,
            n,
            n_before,
            self.now_us,
            depth,
            i0,
            model_us,
            lat_eps,
            drift_eps,
            self.drift,
            self._pen_active,
        )
        accept = self._acc_buf[:n].tolist() if depth > 0 else []
        kv_used = self.ctx_sum = ctx_sum + tokens
        self.tokens_emitted += tokens
        now = self.now_us = self.now_us + busy
        step_us = now - self.last_record_us
        self.last_record_us = now
        if n_done:
            self._finish(now)
        self.last_model_us = model_us
        self.last_base_us = base_us
        self.last_busy_us = busy
        self.prefill_pending = 0
        self.pairs_pending = 0.0
        self.last_tokens = tokens
        # Positional, in Step's field order (keywords cost 0.6 µs more per record):
        # instance, seq, depth, bs, waiting, accept, step_us, ctx_tokens, kv_usage,
        # prefill_tokens, ts_ns.
        rec = Step(
            self._instance,
            self.seq,
            depth,
            n,
            len(self.waiting),
            accept,
            step_us,
            ctx_sum,
            min(1.0, kv_used / self._kv_budget),
            pf,
            self.start_ns + now * 1000,
        )
        self.seq += 1
        return rec

    def _finish(self, now: int) -> None:
        """Retire the requests with no token left (``rem <= 0``) at ``now``."""
        m = _retire(self._ints, self._floats, self.n, self._done_rows)
        self.n -= m
        # _retire lists them from the highest batch index down; record them lowest first.
        for _, t_arr, t_first, rid, prompt_f, out_f in reversed(self._done_rows[:m].tolist()):
            out = int(out_f)
            prompt = int(prompt_f)
            # Positional (rid, arrival, first token, finish, prompt, output): 0.5 µs less.
            self.completed.append(RequestStats(int(rid), int(t_arr), int(t_first), now, prompt, out))
            self.kv_reserved -= prompt + out
            self.ctx_sum -= prompt + out
            self.arrivals.on_complete(now)

    # ------------------------------------------------------------------ oracle access

    def _expected_terms(self, depth: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Per running request: the token every step emits (``min(1, rem)``) and, for
        ``depth > 0``, ``P(accept ≥ j)`` for j = 1..depth (0 past the request's remaining
        output). Ground truth: true acceptance and output lengths; never an observation."""
        n = self.n
        rem = self.rem[:n].astype(np.float64)
        first = np.minimum(1.0, rem)
        if depth == 0 or n == 0:
            return first, None
        x = self.xoff[:n] + self.drift
        ap = self.params.acceptance
        if ap.ctx_logit > 0.0:
            seq_len = self.S[:n, PROMPT] + self.S[:n, OUT] - rem
            x = x - ap.ctx_logit * np.log(np.maximum(seq_len / ap.ctx_ref_tokens, 1.0))
        logits = self._base[:depth] + x[:, None]
        reach = np.cumprod(1.0 / (1.0 + np.exp(-logits)), axis=1)  # P(accept >= j), j = 1..depth
        j = np.arange(1, depth + 1)
        return first, np.where(j[None, :] <= (rem - 1.0)[:, None], reach, 0.0)

    def expected_tokens(self, depth: int) -> float:
        """TRUE expected tokens the current batch emits in one step at ``depth`` (ground
        truth: reads true acceptance and output lengths; never an observation)."""
        if self.n == 0:
            return 0.0
        first, reach = self._expected_terms(depth)
        return float(first.sum() if reach is None else first.sum() + reach.sum())

    def expected_tokens_each(self, depth: int) -> np.ndarray:
        """TRUE expected tokens of each running request in one step at ``depth`` (the terms
        :meth:`expected_tokens` sums; ground truth, never an observation)."""
        if self.n == 0:
            return np.zeros(0)
        first, reach = self._expected_terms(depth)
        return first if reach is None else first + reach.sum(axis=1)

    def expected_rate(self, depth: int) -> float:
        """TRUE expected tokens/s of the next step at ``depth`` for the current batch, using
        the true per-request acceptance and the latency model (for the clairvoyant oracle)."""
        if self.n == 0:
            return 0.0
        t_us = step_time_us(self.params.latency, self.n, depth, self.ctx_sum, self.prefill_pending, self.pairs_pending)
        return self.expected_tokens(depth) / t_us * 1e6

    # ------------------------------------------------------------------ introspection

    @property
    def kv_used(self) -> int:
        """KV tokens held by the running requests (Σ prompt + emitted)."""
        return self.ctx_sum

    def running_state(self) -> dict[str, np.ndarray]:
        """Copies of the running requests' state: prompt, output (target), emitted, remaining."""
        n = self.n
        out = self.S[:n, OUT].astype(np.int64)
        rem = self.rem[:n].copy()
        return {
            "prompt": self.S[:n, PROMPT].astype(np.int64),
            "output": out,
            "emitted": out - rem,
            "remaining": rem,
        }


@maybe_njit
def _decode(
    consts: np.ndarray,
    ints: np.ndarray,
    floats: np.ndarray,
    noise: np.ndarray,
    acc: np.ndarray,
    n: int,
    n_before: int,
    now_us: int,
    depth: int,
    i0: int,
    model_us: float,
    lat_eps: float,
    drift_eps: float,
    drift: float,
    pen_active: bool,
) -> tuple[int, int, float, bool, int]:
    """One decode/verify step of the running batch ``[0, n)`` at ``depth``, in place.

    Args:
        consts: the stale penalty's decay per drafting step, ``1/decay - 1``, the drift's sd and time constant (µs),
            the context fall's reference length (tokens) and logit per e-fold beyond it,
            the acceptance logit of each of the ``_MAX_POS`` draft positions, and the stale
            penalty after k steps without drafting (k = 0, 1, ...; none: no stale penalty).
        ints, floats: per request ``(rem, zs)`` and ``(xoff, pen, U .. OUT)``: remaining
            tokens, steps without drafting, logit offset, stale penalty, cold columns
            (updated; requests ``n_before .. n`` joined this step: their first token is at
            the step's end, ``now_us`` + busy time).
        noise: uniforms, rows ``i0 .. i0 + n`` this step's (unused at depth 0).
        acc: receives the accepted drafts per request (at depth > 0).
        model_us: the latency model's time of this step (µs).
        lat_eps: this step's log-normal latency jitter (already × ``jitter``).
        drift_eps: this step's standard normal for the drift (unused without drift).
        drift, pen_active: the drift logit and whether any stale penalty is set.

    Returns:
        The jittered busy time (µs), tokens emitted, the new drift and ``pen_active``, and
        how many requests have no token left.
    """
    rem, zs, xoff, pen = ints[0], ints[1], floats[0], floats[1]
    o_base = 6
    o_stale = o_base + _MAX_POS
    busy = max(1, int(model_us * math.exp(lat_eps)))
    tokens = n
    if depth > 0:
        ctx_ref, ctx_logit = consts[4], consts[5]
        for j in range(n):
            # Positions 1..a accepted, a + 1 rejected: logistic noise minus the position's
            # logit (left to right, as Generator.logistic computes it) against the offset.
            x = xoff[j] + drift
            if ctx_logit > 0.0:  # the drafter tracks long sequences worse
                seq_len = floats[2 + PROMPT, j] + floats[2 + OUT, j] - rem[j]
                if seq_len > ctx_ref:
                    x -= ctx_logit * math.log(seq_len / ctx_ref)
            a = 0
            while a < depth:
                u = noise[i0 + j, a]
                if math.log(u / (1.0 - u)) - consts[o_base + a] >= x:
                    break
                a += 1
            if a > rem[j] - 1:  # never past the request's last token
                a = int(rem[j] - 1)
            acc[j] = a
            rem[j] -= a + 1
            tokens += a
        if pen_active:
            # The stale penalty fades while drafting; the zero-step run resets.
            decay, grow = consts[0], consts[1]
            top = 0.0
            for j in range(n):
                p = pen[j] * decay
                pen[j] = p
                xoff[j] += p * grow
                zs[j] = 0
                if j == 0 or p > top:
                    top = p
            if top < 1e-3:
                for j in range(n):
                    xoff[j] += pen[j]
                    pen[j] = 0.0
                pen_active = False
    else:
        for j in range(n):
            rem[j] -= 1
        last = len(consts) - 1 - o_stale
        if last >= 0:
            for j in range(n):
                z = zs[j] + 1
                if z > last:
                    z = last
                zs[j] = z
                new_pen = max(pen[j], consts[o_stale + z])
                xoff[j] -= new_pen - pen[j]
                pen[j] = new_pen
            pen_active = True
    sd = consts[2]
    if sd > 0.0:
        a_dt = math.exp(-busy / consts[3])
        drift = drift * a_dt + sd * math.sqrt(max(0.0, 1.0 - a_dt * a_dt)) * drift_eps
    for j in range(n_before, n):
        floats[2 + TFIRST, j] = now_us + busy
    n_done = 0
    for j in range(n):
        if rem[j] <= 0:
            n_done += 1
    return int(busy), int(tokens), float(drift), bool(pen_active), n_done


@maybe_njit
def _retire(ints: np.ndarray, floats: np.ndarray, n: int, done: np.ndarray) -> int:
    """Swap-remove the requests of ``[0, n)`` with no token left; return how many.

    ``ints``/``floats`` as for :func:`_decode`. The finished requests' cold columns
    (``U .. OUT``) go to the rows ``done[0..m)``, highest batch index first. Scanning down,
    the last request that moves into a freed slot was already scanned, so it is never a
    finished one: a few copies instead of compacting (batch order is not part of the model).
    """
    m = 0
    for i in range(n - 1, -1, -1):
        if ints[0, i] <= 0:
            done[m, :] = floats[2:, i]
            m += 1
            n -= 1
            if i != n:
                ints[:, i] = ints[:, n]
                floats[:, i] = floats[:, n]
    return m


@maybe_njit
def _admit_row(
    ints: np.ndarray, floats: np.ndarray, i: int, x: float, t_us: int, rid: int, prompt: int, out: int
) -> None:
    """Set request ``i``'s state on admission (``ints``/``floats`` as for :func:`_decode`)."""
    ints[0, i] = out
    ints[1, i] = 0
    floats[0, i] = x
    floats[1, i] = 0.0
    floats[2 + U, i] = x
    floats[2 + TARR, i] = t_us
    floats[2 + TFIRST, i] = -1.0
    floats[2 + RID, i] = rid
    floats[2 + PROMPT, i] = prompt
    floats[2 + OUT, i] = out
