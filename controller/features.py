"""The Featurizer: a stream of one instance's ``step`` records → a fixed-size observation.

The same class runs in the live controller (one per instance) and in the simulator, which
produces observations only through it; that is what makes a policy trained offline see the
world the way it will see it in production. Everything here is computed from the records
alone — nothing the live hook cannot observe (no true output lengths, no true acceptance
rates) can enter an observation.

Cost: O(|depths| + max depth) per record plus one pass over ``accept`` (C-level
``list.count``), independent of history. Deterministic: the same records give the same
observations, bit for bit.

Observation (float32), with D = the allowed depths and K = max(D):

=========================  ==================================================================
feature                    meaning
=========================  ==================================================================
``bs``                     log1p(bs) / log1p(256)
``waiting``                log1p(waiting) / log1p(256)
``queue_frac``             waiting / (bs + waiting)
``ctx_per_req``            log1p(ctx_tokens / bs) / log1p(32768)
``kv_usage``               as sent
``prefill``                log1p(EMA of prefill_tokens per step) / log1p(8192)
``step_ms``                log1p(EMA of step_us / 1000) / log1p(1000)
``bs_trend``               fast − slow EMA of the ``bs`` feature
``accept_trend``           fast − slow EMA of mean accepted fraction (accept / depth)
``spec_staleness``         1 − exp(−steps since the last step with depth > 0 / 50)
``depth=k`` (k ∈ D)        one-hot of the depth the last step ran with
``p_accept_i`` (i ≤ K)     recent conditional acceptance of draft position i (given i−1 were
                           accepted), a decayed count with a weak prior
``tokens_k`` (k ∈ D)       expected tokens per request-step at depth k, / (k + 1)
``lat_ratio_k`` (k ∈ D)    log(step time at depth k / at depth 0) for the current batch-size
                           bucket (nearest bucket with both, else 0), clipped to ±2
``lat_stale_k`` (k ∈ D)    1 − exp(−steps since depth k was last observed / 200)
``goodput_k`` (k ∈ D)      log(tokens_k·(k+1) / latency ratio), expected tokens per second
                           relative to depth 0, clipped to ±2
=========================  ==================================================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from controller.protocol import Step

FEATURIZER_VERSION = 1

# Batch-size buckets for the latency table: floor(log2(bs)), so 1, 2-3, 4-7, ..., ≥512.
N_BS_BUCKETS = 10
PRIOR_ACCEPT = 0.6  # weak prior for a position never tried, between chat and code figures
PRIOR_WEIGHT = 2.0  # in "request-positions": a few real observations dominate it
ACCEPT_DECAY = 0.9  # per record: about the last 10 steps of a batch count
FAST, SLOW = 0.3, 0.03
LAT_ALPHA = 0.2

_LOG_257 = math.log1p(256.0)
_LOG_CTX = math.log1p(32768.0)
_LOG_PREFILL = math.log1p(8192.0)
_LOG_MS = math.log1p(1000.0)


def bs_bucket(bs: int) -> int:
    """Index of the latency-table bucket of a batch size."""
    return min(max(bs, 1).bit_length() - 1, N_BS_BUCKETS - 1)


class Featurizer:
    """Turns one instance's ``step`` records into observations (see module docstring).

    Args:
        depths: the allowed draft depths, strictly increasing (0 = no speculation).

    Attributes:
        version: :data:`FEATURIZER_VERSION`; a policy trained on another version is refused.
        obs_dim: length of every observation.
        feature_names: one name per observation entry.
    """

    version = FEATURIZER_VERSION

    def __init__(self, depths: Sequence[int]) -> None:
        depths = tuple(int(d) for d in depths)
        if not depths or any(a >= b for a, b in zip(depths, depths[1:])) or depths[0] < 0:
            raise ValueError(f"depths must be non-empty, non-negative, strictly increasing: {depths}")
        self.depths = depths
        self.max_depth = depths[-1]
        self._depth_index = {d: i for i, d in enumerate(depths)}
        n = len(depths)
        k = self.max_depth
        self.feature_names: list[str] = [
            "bs", "waiting", "queue_frac", "ctx_per_req", "kv_usage", "prefill", "step_ms",
            "bs_trend", "accept_trend", "spec_staleness",
        ]
        self.feature_names += [f"depth={d}" for d in depths]
        self.feature_names += [f"p_accept_{i}" for i in range(1, k + 1)]
        self.feature_names += [f"tokens_{d}" for d in depths]
        self.feature_names += [f"lat_ratio_{d}" for d in depths]
        self.feature_names += [f"lat_stale_{d}" for d in depths]
        self.feature_names += [f"goodput_{d}" for d in depths]
        self.obs_dim = len(self.feature_names)
        self._n = n
        self.reset()

    def reset(self) -> None:
        """Forget everything: a new instance, or a new episode."""
        k = self.max_depth
        self.steps = 0
        self._acc = [0.0] * (k + 1)  # decayed count of requests that accepted position i
        self._tried = [0.0] * (k + 1)  # decayed count of requests that reached position i
        self._lat = [[0.0] * self._n for _ in range(N_BS_BUCKETS)]  # EMA step_us; 0 = unknown
        self._last_seen = [-(10**9)] * self._n
        self._last_spec = -(10**9)
        self._step_ms = 0.0
        self._prefill = 0.0
        self._bs_fast = self._bs_slow = 0.0
        self._acc_fast = self._acc_slow = 0.0
        self._last: Step | None = None
        self._obs = np.zeros(self.obs_dim, dtype=np.float32)

    # ------------------------------------------------------------------ estimates

    def accept_prob(self, position: int) -> float:
        """Recent conditional acceptance of draft position ``position`` (1-based)."""
        return (self._acc[position] + PRIOR_ACCEPT * PRIOR_WEIGHT) / (self._tried[position] + PRIOR_WEIGHT)

    def expected_tokens(self, depth: int) -> float:
        """Expected tokens one request emits in a step at ``depth``: 1 + Σ_i Π_{j≤i} p_j."""
        total, run = 1.0, 1.0
        for i in range(1, depth + 1):
            run *= self.accept_prob(i)
            total += run
        return total

    def latency_us(self, depth: int, bs: int) -> float:
        """Recent step time at ``depth`` in the batch-size bucket of ``bs``; 0.0 if never seen."""
        return self._lat[bs_bucket(bs)][self._depth_index[depth]]

    def latency_ratio(self, depth: int, bs: int) -> float | None:
        """Step time at ``depth`` / at depth 0 (or the smallest depth), from the nearest
        batch-size bucket where both were observed; None if no bucket has both."""
        i = self._depth_index[depth]
        b0 = bs_bucket(bs)
        for off in range(N_BS_BUCKETS):
            for b in (b0 - off, b0 + off) if off else (b0,):
                if 0 <= b < N_BS_BUCKETS:
                    row = self._lat[b]
                    if row[i] > 0.0 and row[0] > 0.0:
                        return row[i] / row[0]
        return None

    # ------------------------------------------------------------------ update

    def update(self, step: Step) -> np.ndarray:
        """Fold one record in and return the observation (a fresh float32 array)."""
        depth, bs = step.depth, step.bs
        self.steps += 1
        t = self.steps
        di = self._depth_index.get(depth)

        # Acceptance per position: a request that accepted a drafts of d reached positions
        # 1..min(a+1, d) and accepted 1..a. Decay first so old batches fade.
        acc, tried = self._acc, self._tried
        for i in range(1, self.max_depth + 1):
            acc[i] *= ACCEPT_DECAY
            tried[i] *= ACCEPT_DECAY
        if depth > 0 and step.accept:
            accept = step.accept
            n_ge = bs  # requests with accept >= i-1, starting at i = 1
            for i in range(1, depth + 1):
                n_eq = accept.count(i - 1)
                tried[i] += n_ge
                n_ge -= n_eq
                acc[i] += n_ge
            mean_frac = sum(accept) / (bs * depth)
            self._acc_fast += FAST * (mean_frac - self._acc_fast)
            self._acc_slow += SLOW * (mean_frac - self._acc_slow)
            self._last_spec = t

        # Latency table per (bs bucket, depth); EMA so drift is followed.
        if di is not None and step.step_us > 0:
            row = self._lat[bs_bucket(bs)]
            old = row[di]
            row[di] = float(step.step_us) if old == 0.0 else old + LAT_ALPHA * (step.step_us - old)
            self._last_seen[di] = t

        first = self._last is None
        step_ms = step.step_us / 1000.0
        self._step_ms = step_ms if first else self._step_ms + FAST * (step_ms - self._step_ms)
        self._prefill = (
            float(step.prefill_tokens) if first else self._prefill + FAST * (step.prefill_tokens - self._prefill)
        )
        bs_f = math.log1p(bs) / _LOG_257
        if first:
            self._bs_fast = self._bs_slow = bs_f
        else:
            self._bs_fast += FAST * (bs_f - self._bs_fast)
            self._bs_slow += SLOW * (bs_f - self._bs_slow)
        self._last = step
        return self._observe(step, bs_f)

    def _observe(self, step: Step, bs_f: float) -> np.ndarray:
        bs, t = step.bs, self.steps
        out: list[float] = [
            bs_f,
            math.log1p(step.waiting) / _LOG_257,
            step.waiting / (bs + step.waiting),
            math.log1p(step.ctx_tokens / bs) / _LOG_CTX,
            step.kv_usage,
            math.log1p(self._prefill) / _LOG_PREFILL,
            math.log1p(self._step_ms) / _LOG_MS,
            self._bs_fast - self._bs_slow,
            self._acc_fast - self._acc_slow,
            1.0 - math.exp(-(t - self._last_spec) / 50.0),
        ]
        onehot = [0.0] * self._n
        di = self._depth_index.get(step.depth)
        if di is not None:
            onehot[di] = 1.0
        out += onehot

        probs = [self.accept_prob(i) for i in range(1, self.max_depth + 1)]
        out += probs
        # Expected tokens at every allowed depth from one running product over positions.
        cum = [1.0] * (self.max_depth + 1)
        run = 1.0
        for i, p in enumerate(probs, start=1):
            run *= p
            cum[i] = cum[i - 1] + run
        tokens = [cum[d] for d in self.depths]
        out += [tok / (d + 1) for tok, d in zip(tokens, self.depths)]

        ratios = [self.latency_ratio(d, bs) for d in self.depths]
        out += [0.0 if r is None else _clip(math.log(r), 2.0) for r in ratios]
        out += [1.0 - math.exp(-(t - seen) / 200.0) for seen in self._last_seen]
        base = tokens[0]
        out += [
            0.0 if r is None else _clip(math.log(tok / base / r), 2.0) for tok, r in zip(tokens, ratios)
        ]
        obs = self._obs
        obs[:] = out
        return obs.copy()


def _clip(x: float, bound: float) -> float:
    return bound if x > bound else -bound if x < -bound else x
