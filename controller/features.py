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
                           accepted), a decayed count with a weak prior; while nothing is
                           drafted the evidence ages and the estimate returns to the prior
``tokens_k`` (k ∈ D)       expected tokens per request-step at depth k, / (k + 1)
``lat_ratio_k`` (k ∈ D)    log(step time at depth k / at depth 0) for the current batch-size
                           bucket (else the running ratio over buckets; 0 if never), ±2
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

FEATURIZER_VERSION = 2

# Batch-size buckets for the latency table: floor(log2(bs)), so 1, 2-3, 4-7, ..., ≥512.
N_BS_BUCKETS = 10
PRIOR_ACCEPT = 0.6  # weak prior for a position never tried, between chat and code figures
PRIOR_WEIGHT = 2.0  # in "request-positions": a few real observations dominate it
ACCEPT_DECAY = 0.9  # per speculative step: about the last 10 batches count
# Per step without drafting, the acceptance evidence loses weight and the estimate returns to
# the prior (halved in ~23 steps): a policy that stopped drafting after a bad stretch will look
# again, instead of trusting a frozen, pessimistic estimate forever.
STALE_DECAY = 0.97
FAST, SLOW = 0.3, 0.03
LAT_ALPHA = 0.2

_INV_LOG_257 = 1.0 / math.log1p(256.0)
_INV_LOG_CTX = 1.0 / math.log1p(32768.0)
_INV_LOG_PREFILL = 1.0 / math.log1p(8192.0)
_INV_LOG_MS = 1.0 / math.log1p(1000.0)


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
            "bs",
            "waiting",
            "queue_frac",
            "ctx_per_req",
            "kv_usage",
            "prefill",
            "step_ms",
            "bs_trend",
            "accept_trend",
            "spec_staleness",
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
        self._ratio = [1.0] + [0.0] * (self._n - 1)  # EMA of latency / smallest-depth latency
        self._last_seen = [-(10**9)] * self._n
        self._last_spec = -(10**9)
        self._step_ms = 0.0
        self._prefill = 0.0
        self._bs_fast = self._bs_slow = 0.0
        self._acc_fast = self._acc_slow = 0.0
        self._last: Step | None = None
        self._accept_block: tuple[list[float], list[float]] | None = None

    # ------------------------------------------------------------------ estimates

    def accept_prob(self, position: int) -> float:
        """Recent conditional acceptance of draft position ``position`` (1-based)."""
        w = STALE_DECAY ** (self.steps - self._last_spec) if self.steps > self._last_spec else 1.0
        return (w * self._acc[position] + PRIOR_ACCEPT * PRIOR_WEIGHT) / (
            w * self._tried[position] + PRIOR_WEIGHT
        )

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
        """Step time at ``depth`` / at the smallest depth (0 = no speculation).

        From the batch-size bucket of ``bs`` when both were observed there; else the running
        ratio measured in any bucket where both were known; None if never measured.
        """
        i = self._depth_index[depth]
        row = self._lat[bs_bucket(bs)]
        if row[i] > 0.0 and row[0] > 0.0:
            return row[i] / row[0]
        r = self._ratio[i]
        return r if r > 0.0 else None

    # ------------------------------------------------------------------ update

    def update(self, step: Step) -> np.ndarray:
        """Fold one record in and return the observation (a fresh float32 array).

        Written as one flat pass because it runs on the controller's hot path and inside every
        simulator step; the acceptance block is recomputed only when a speculative step brings
        new evidence.
        """
        depth, bs, step_us = step.depth, step.bs, step.step_us
        self.steps = t = self.steps + 1
        di = self._depth_index.get(depth)
        b = bs.bit_length() - 1
        row = self._lat[b if b < N_BS_BUCKETS else N_BS_BUCKETS - 1]

        if depth > 0 and step.accept:
            # A request that accepted a of d drafts reached positions 1..min(a+1, d) and
            # accepted 1..a. Decay per speculative step, so "recent" means recent batches.
            acc, tried, accept = self._acc, self._tried, step.accept
            for i in range(1, self.max_depth + 1):
                acc[i] *= ACCEPT_DECAY
                tried[i] *= ACCEPT_DECAY
            n_ge = bs  # requests with accept >= i-1, starting at i = 1
            for i in range(1, depth + 1):
                tried[i] += n_ge
                n_ge -= accept.count(i - 1)
                acc[i] += n_ge
            mean_frac = sum(accept) / (bs * depth)
            self._acc_fast += FAST * (mean_frac - self._acc_fast)
            self._acc_slow += SLOW * (mean_frac - self._acc_slow)
            self._last_spec = t
            self._accept_block = None

        # Latency table per (bs bucket, depth); EMA so drift is followed.
        if di is not None and step_us > 0:
            old = row[di]
            row[di] = float(step_us) if old == 0.0 else old + LAT_ALPHA * (step_us - old)
            if di and row[0] > 0.0:
                r, sample = self._ratio[di], step_us / row[0]
                self._ratio[di] = sample if r == 0.0 else r + LAT_ALPHA * (sample - r)
            self._last_seen[di] = t

        bs_f = math.log1p(bs) * _INV_LOG_257
        if self._last is None:
            self._step_ms = step_us / 1000.0
            self._prefill = float(step.prefill_tokens)
            self._bs_fast = self._bs_slow = bs_f
        else:
            self._step_ms += FAST * (step_us / 1000.0 - self._step_ms)
            self._prefill += FAST * (step.prefill_tokens - self._prefill)
            self._bs_fast += FAST * (bs_f - self._bs_fast)
            self._bs_slow += SLOW * (bs_f - self._bs_slow)
        self._last = step

        waiting = step.waiting
        out = [
            bs_f,
            math.log1p(waiting) * _INV_LOG_257,
            waiting / (bs + waiting),
            math.log1p(step.ctx_tokens / bs) * _INV_LOG_CTX,
            step.kv_usage,
            math.log1p(self._prefill) * _INV_LOG_PREFILL,
            math.log1p(self._step_ms) * _INV_LOG_MS,
            self._bs_fast - self._bs_slow,
            self._acc_fast - self._acc_slow,
            1.0 - math.exp((self._last_spec - t) * 0.02),
        ]
        onehot = [0.0] * self._n
        if di is not None:
            onehot[di] = 1.0
        out += onehot

        block = self._accept_block
        if block is None or self._last_spec != t:  # new evidence, or evidence ageing
            block = self._accept_block = self._acceptance_features()
        probs_and_tokens, tokens = block
        out += probs_and_tokens

        # Latency ratio per depth: current bucket if both known, else the running ratio.
        lat_feats, good_feats = [], []
        base_tok, lat0 = tokens[0], row[0]
        ratio, log = self._ratio, math.log
        for i in range(self._n):
            r = row[i] / lat0 if row[i] > 0.0 and lat0 > 0.0 else ratio[i]
            if r > 0.0:
                x = log(r)
                lat_feats.append(2.0 if x > 2.0 else -2.0 if x < -2.0 else x)
                g = log(tokens[i] / base_tok / r)
                good_feats.append(2.0 if g > 2.0 else -2.0 if g < -2.0 else g)
            else:
                lat_feats.append(0.0)
                good_feats.append(0.0)
        out += lat_feats
        out += [1.0 - math.exp((seen - t) * 0.005) for seen in self._last_seen]
        out += good_feats
        return np.array(out, dtype=np.float32)

    def _acceptance_features(self) -> tuple[list[float], list[float]]:
        """``p_accept_i`` and ``tokens_k / (k+1)`` features, and expected tokens per depth."""
        acc, tried, w, pw = self._acc, self._tried, PRIOR_WEIGHT, PRIOR_ACCEPT * PRIOR_WEIGHT
        age = self.steps - self._last_spec
        if age > 0:  # evidence ages while nothing is drafted
            s = STALE_DECAY**age
            probs = [(s * acc[i] + pw) / (s * tried[i] + w) for i in range(1, self.max_depth + 1)]
        else:
            probs = [(acc[i] + pw) / (tried[i] + w) for i in range(1, self.max_depth + 1)]
        cum = [1.0] * (self.max_depth + 1)
        run = 1.0
        for i, p in enumerate(probs, start=1):
            run *= p
            cum[i] = cum[i - 1] + run
        tokens = [cum[d] for d in self.depths]
        return probs + [tok / (d + 1) for tok, d in zip(tokens, self.depths)], tokens
