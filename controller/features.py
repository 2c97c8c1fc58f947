"""The Featurizer: a stream of one instance's ``step`` records → a fixed-size observation.

The same class runs in the live controller (one per instance) and in the simulator, which
produces observations only through it; that is what makes a policy trained offline see the
world the way it will see it in production. Everything here is computed from the records
alone — nothing the live hook cannot observe (no true output lengths, no true acceptance
rates) can enter an observation.

Cost: O(|depths| + max depth) per record plus one pass over ``accept``, independent of
history: one call of a kernel over a float64 state array, compiled by numba when installed
(:mod:`controller._jit`; the same source runs as plain Python without it, slower, with the
same results). Deterministic: the same records give the same observations, bit for bit.

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
``accept_trend``           fast − slow EMA of mean accepted fraction (accept / depth); while
                           nothing is drafted it fades to 0 as the acceptance evidence ages
``spec_staleness``         1 − exp(−steps since the last step with depth > 0 / 50)
``depth=k`` (k ∈ D)        one-hot of the depth the last step ran with
``p_accept_i`` (i ≤ K)     recent conditional acceptance of draft position i (given i−1 were
                           accepted), a decayed count with a weak prior; while nothing is
                           drafted the evidence ages and the estimate returns to the prior
``tokens_k`` (k ∈ D)       expected tokens per request-step at depth k, / (k + 1)
``lat_ratio_k`` (k ∈ D)    log(step time at depth k / at depth 0) for the current batch-size
                           bucket (else the running ratio over buckets; 0 if never), ±2; from
                           decode steps only: a record enters one record late, and not when
                           it or the next one admitted requests (``prefill_tokens`` > 0)
``lat_stale_k`` (k ∈ D)    1 − exp(−steps since depth k was last observed / 200)
``goodput_k`` (k ∈ D)      log(tokens_k·(k+1) / latency ratio), expected tokens per second
                           relative to depth 0, clipped to ±2
=========================  ==================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import numpy as np

from controller._jit import maybe_njit, njit_uncached
from controller.policy import VersionedPolicy
from controller.protocol import Step

T = TypeVar("T")

# 3: accept_trend fades while nothing is drafted (was frozen at its last value: a policy read a
# trend from a bad phase long gone as "the drafter is getting worse" and never drafted again).
# 4: a step that admitted requests (prefill_tokens > 0) does not enter the latency table. On the
# H100 testbed such steps took 47-58 ms (median, batch >= 48) at every depth against 9.7 ms for
# a depth-0 step without admissions, even with the prompts in the prefix cache: the cost is the
# admission's, not the depth's, and whichever depth happened to admit read as the slow one
# (goodput then drafted at 64-128 requests, where depth 0 was 2x faster).
# 5: nor does the step before an admitting one. SGLang's overlap scheduler records most of an
# admission's time in the record before the one that counts the prefilled tokens (H100 drawn
# traces, one request admitted: median 31 ms over a decode step there, 5 ms in the counting
# record; bench/admission_latency_table.py), so the table takes a record only once the next
# one is known: one record late.
# 6: a folded acceptance estimate, tried on the H100 testbed (calls V and W) and not kept; the
# number stays unused so that its zips cannot be served with another definition.
# 7: a drafted record right after a depth-0 one is not acceptance evidence. With the hook's
# off switch resumed cold (SPECDEPTH_OFF_RESUME=cold; its default resumes warm and loses
# nothing) the first drafted step after depth 0 proposes from a stale hidden state and
# accepts nothing (0 of 628 first draft tokens on the H100 testbed, 0.38 elsewhere): counted,
# each probe reads as a bad drafter, and in the simulator with that loss and a decision applied
# one step late goodput and PPO stopped drafting at 4-16 requests, where depth 3 ran 1.6x
# depth 0 (bench/resume_evidence.py). Not the default: at the three steps the hook measured,
# the version-5 PPO holds, and version-7 policies trained so far lose 2-6% at 64 requests
# there, where the zeros counted also priced the toggling.
FEATURIZER_VERSION = 5
# Versions whose policies this Featurizer still serves: a user's zip keeps working after an
# upgrade. They differ only in the per-step fade of ``accept_trend`` (1.0 = none, version 2),
# in which steps the latency table takes (every step, versions 2-3; not an admitting one,
# version 4; nor the one before it, version 5 on), and in which drafted steps are acceptance
# evidence (version 7).
SUPPORTED_VERSIONS = (2, 3, 4, 5, 7)

# Batch-size buckets for the latency table: floor(log2(bs)), so 1, 2-3, 4-7, ..., ≥512.
N_BS_BUCKETS = 10
PRIOR_ACCEPT = 0.6  # weak prior for a position never tried, between chat and code figures
PRIOR_WEIGHT = 2.0  # in "request-positions": a few real observations dominate it
ACCEPT_DECAY = 0.9  # per speculative step: about the last 10 batches count
# Per step without drafting, the acceptance evidence loses weight and the estimate returns to
# the prior (halved in ~23 steps): a policy that stopped drafting after a bad stretch will look
# again, instead of trusting a frozen, pessimistic estimate forever. The acceptance trend fades
# at the same rate: no evidence, no trend.
STALE_DECAY = 0.97
SPEC_STALENESS_STEPS = 50.0  # spec_staleness = 1 − exp(−steps without drafting / this)
FAST, SLOW = 0.3, 0.03
LAT_ALPHA = 0.2

# The observation's log scales: a feature is log1p(x) / log1p(top), 1.0 at x = top.
_LOG_BS = math.log1p(256.0)  # ``bs`` and ``waiting``
_LOG_CTX = math.log1p(32768.0)  # ``ctx_per_req``
_INV_LOG_BS = 1.0 / _LOG_BS
_INV_LOG_CTX = 1.0 / _LOG_CTX
_INV_LOG_PREFILL = 1.0 / math.log1p(8192.0)
_INV_LOG_MS = 1.0 / math.log1p(1000.0)


# Layout of the state array: scalars first, then the per-position and per-depth tables.
# _TREND_FADE: the per-step fade of accept_trend without drafting, _LAT_DECODE_ONLY: 1 when
# steps that admitted requests stay out of the latency table, _LAT_LAG: 1 when a record enters
# it only with the next one (and not when that one admits); all three set by the version.
# _PEND_*: the record waiting for its successor (version 5): its depth index (-1: none), the
# start of its latency row, its step_us, its step index. _RESUME: 1 when a drafted record right
# after a depth-0 one is not evidence (version 7); _PREV_DEPTH: the previous record's depth
# (-1: none).
(_T, _LAST_SPEC, _STEP_MS, _PREFILL, _BS_FAST, _BS_SLOW, _ACC_FAST, _ACC_SLOW, _HAS_LAST, _TREND_FADE,
 _LAT_DECODE_ONLY, _LAT_LAG, _PEND_DI, _PEND_ROW, _PEND_US, _PEND_T, _RESUME, _PREV_DEPTH) = range(18)  # fmt: skip
_HEAD = 18
_NEVER = -1e9  # "step index" of something never seen: every staleness feature reads 1


@maybe_njit
def _encode_bs1(bs: float) -> float:
    return math.log1p(bs) * _INV_LOG_BS


@maybe_njit
def _encode_ctx1(tokens: float) -> float:
    return math.log1p(tokens) * _INV_LOG_CTX


def _decode_bs1(x: float) -> float:
    return math.expm1(x * _LOG_BS)


def _decode_ctx1(x: float) -> float:
    return math.expm1(x * _LOG_CTX)


def _elementwise(fn: Callable[[float], float], x: float | np.ndarray) -> Any:
    """``fn`` (plain Python, even where numba compiled it) of a number, or of each entry of an
    array: a float64 array of the same shape, each entry exactly ``fn`` of it as a number."""
    py = getattr(fn, "py_func", fn)
    if isinstance(x, np.ndarray):
        flat = np.fromiter(map(py, x.ravel().tolist()), dtype=np.float64, count=x.size)
        return flat.reshape(x.shape)
    return float(py(x))


@overload
def encode_bs(bs: float) -> float: ...
@overload
def encode_bs(bs: np.ndarray) -> np.ndarray: ...
def encode_bs(bs: float | np.ndarray) -> float | np.ndarray:
    """A batch size (or queue length) in the observation's units: the ``bs`` and ``waiting``
    features, ``log1p(bs) / log1p(256)`` (0 at 0, 1 at 256). The Featurizer computes them with
    this formula, bit for bit, before their rounding to float32. Numbers give a float, arrays
    a float64 array of the same values entry by entry."""
    return _elementwise(_encode_bs1, bs)


@overload
def decode_bs(x: float) -> float: ...
@overload
def decode_bs(x: np.ndarray) -> np.ndarray: ...
def decode_bs(x: float | np.ndarray) -> float | np.ndarray:
    """The batch size whose :func:`encode_bs` is ``x`` (a float, not rounded)."""
    return _elementwise(_decode_bs1, x)


@overload
def encode_ctx(tokens: float) -> float: ...
@overload
def encode_ctx(tokens: np.ndarray) -> np.ndarray: ...
def encode_ctx(tokens: float | np.ndarray) -> float | np.ndarray:
    """Context tokens per request in the observation's units: the ``ctx_per_req`` feature of
    ``tokens = ctx_tokens / bs``, ``log1p(tokens) / log1p(32768)`` (0 at 0, 1 at 32768). As
    :func:`encode_bs`: the Featurizer's own formula, numbers or arrays."""
    return _elementwise(_encode_ctx1, tokens)


@overload
def decode_ctx(x: float) -> float: ...
@overload
def decode_ctx(x: np.ndarray) -> np.ndarray: ...
def decode_ctx(x: float | np.ndarray) -> float | np.ndarray:
    """The context tokens per request whose :func:`encode_ctx` is ``x`` (a float)."""
    return _elementwise(_decode_ctx1, x)


def bs_bucket(bs: int) -> int:
    """Index of the latency-table bucket of a batch size."""
    return min(max(bs, 1).bit_length() - 1, N_BS_BUCKETS - 1)


def _offsets(n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """Start of ``acc``, ``tried`` (k + 1 each), ``lat`` (N_BS_BUCKETS × n), ``ratio``,
    ``last_seen`` (n each) in the state array, and its length."""
    acc = _HEAD
    tried = acc + k + 1
    lat = tried + k + 1
    ratio = lat + N_BS_BUCKETS * n
    seen = ratio + n
    return acc, tried, lat, ratio, seen, seen + n


class Featurizer:
    """Turns one instance's ``step`` records into observations (see module docstring).

    All state lives in one float64 array (step counts are exact there below 2**53) that the
    kernel :func:`_fold` updates in place. The methods below read it through the kernels that
    compute the observation's estimates (:func:`_acceptance`, :func:`_lat_ratio`): an estimate
    here is the one in the observation, before its rounding to float32.

    Args:
        depths: the allowed draft depths, strictly increasing (0 = no speculation).
        version: the observation's definition, one of :data:`SUPPORTED_VERSIONS` (default
            :data:`FEATURIZER_VERSION`): a policy is served with the version it was trained on
            (:func:`featurizer_for`).

    Attributes:
        version: the version this Featurizer computes.
        obs_dim: length of every observation.
        feature_names: one name per observation entry.
    """

    def __init__(self, depths: Sequence[int], version: int = FEATURIZER_VERSION) -> None:
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"Featurizer version {version}: this controller computes {list(SUPPORTED_VERSIONS)}"
            )
        self.version = int(version)
        depths = tuple(int(d) for d in depths)
        if not depths or any(a >= b for a, b in zip(depths, depths[1:])) or depths[0] < 0:
            raise ValueError(f"depths must be non-empty, non-negative, strictly increasing: {depths}")
        self.depths = depths
        self.max_depth = depths[-1]
        self._depth_index = {d: i for i, d in enumerate(depths)}
        self._depths = np.array(depths, dtype=np.int64)
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
        self._off = _offsets(n, k)
        self.reset()

    def reset(self) -> None:
        """Forget everything: a new instance, or a new episode."""
        acc, _, lat, ratio, seen, size = self._off
        st = np.zeros(size, dtype=np.float64)
        # acc/tried: decayed counts of requests that accepted/reached position i; lat: EMA of
        # step_us per (bs bucket, depth), 0 = unknown; ratio: EMA of latency / smallest-depth
        # latency; seen: step index at which each depth was last observed.
        st[_LAST_SPEC] = _NEVER
        st[_TREND_FADE] = STALE_DECAY if self.version >= 3 else 1.0
        st[_LAT_DECODE_ONLY] = 1.0 if self.version >= 4 else 0.0
        st[_LAT_LAG] = 1.0 if self.version >= 5 else 0.0
        st[_PEND_DI] = -1.0
        st[_RESUME] = 1.0 if self.version >= 7 else 0.0
        st[_PREV_DEPTH] = -1.0
        st[ratio] = 1.0
        st[seen:] = _NEVER
        self._state = st

    # ------------------------------------------------------------------ estimates

    @property
    def steps(self) -> int:
        """Records folded in since the last reset."""
        return int(self._state[_T])

    @property
    def _acc(self) -> np.ndarray:
        return self._state[self._off[0] : self._off[1]]

    @property
    def _tried(self) -> np.ndarray:
        return self._state[self._off[1] : self._off[2]]

    def _lat_row(self, bs: int) -> np.ndarray:
        lat = self._off[2] + bs_bucket(bs) * self._n
        return self._state[lat : lat + self._n]

    def _estimates(self) -> tuple[np.ndarray, np.ndarray]:
        k = self.max_depth
        p, cum = np.empty(k, dtype=np.float64), np.empty(k + 1, dtype=np.float64)
        _acceptance(self._state, k, self._state[_T], p, cum)
        return p, cum

    def accept_prob(self, position: int) -> float:
        """Recent conditional acceptance of draft position ``position`` (1-based, ≤ max depth)."""
        return float(self._estimates()[0][position - 1])

    def expected_tokens(self, depth: int) -> float:
        """Expected tokens one request emits in a step at ``depth``: 1 + Σ_i Π_{j≤i} p_j."""
        return float(self._estimates()[1][depth])

    def latency_us(self, depth: int, bs: int) -> float:
        """Recent step time at ``depth`` in the batch-size bucket of ``bs``; 0.0 if never seen."""
        return float(self._lat_row(bs)[self._depth_index[depth]])

    def latency_ratio(self, depth: int, bs: int) -> float | None:
        """Step time at ``depth`` / at the smallest depth (0 = no speculation).

        From the batch-size bucket of ``bs`` when both were observed there; else the running
        ratio measured in any bucket where both were known; None if never measured.
        """
        o_row = self._off[2] + bs_bucket(bs) * self._n
        r = _lat_ratio(self._state, o_row, self._off[3], self._depth_index[depth])
        return float(r) if r > 0.0 else None

    # ------------------------------------------------------------------ update

    def update(self, step: Step, accept_u8: bytes | None = None) -> np.ndarray:
        """Fold one record in and return the observation (a fresh float32 array).

        ``accept_u8``: as for :meth:`update_with`.

        Raises:
            ValueError: a speculative record deeper than the deepest allowed depth.
        """
        return self.update_with(step, _fold, accept_u8)  # type: ignore[no-any-return]

    def update_with(self, step: Step, kernel: Callable[..., T], accept_u8: bytes | None = None) -> T:
        """Fold one record in with ``kernel`` and return what it returns.

        ``kernel`` takes :func:`_fold`'s arguments: :func:`_fold` itself (that is
        :meth:`update`), or a kernel made by :func:`fuse`, which folds the record exactly as
        :meth:`update` does and consumes the observation in the same compiled call.
        ``accept_u8``: ``bytes(step.accept)`` if the caller has it already
        (:func:`controller.protocol.read_step` returns it).
        """
        if accept_u8 is None:
            try:
                # bytes are the cheapest array numba accepts from a list of small ints; records
                # of depth <= 255 always fit (accept entries are 0..depth).
                acc_arr: bytes | np.ndarray = bytes(step.accept)
            except ValueError:
                acc_arr = np.array(step.accept, dtype=np.int64)
        else:
            acc_arr = accept_u8
        return kernel(
            self._state,
            self._depths,
            acc_arr,
            step.depth,
            step.bs,
            step.waiting,
            step.step_us,
            step.ctx_tokens,
            float(step.kv_usage),
            step.prefill_tokens,
        )


def fuse(consume: Callable[[np.ndarray], T]) -> Callable[..., T] | None:
    """A compiled kernel for :meth:`Featurizer.update_with` that hands the observation to ``consume``.

    ``consume`` is a compiled (numba) function of the observation alone, e.g. a policy with its
    weights built in. Featurizing and consuming in one call from Python saves the second call's
    argument checks and the observation's trip through Python: about 1 µs per decision on the
    development box, a fifth of the controller's work per step. Returns None when numba is off.
    Compiled in this process (~0.4 s), never cached on disk (see :mod:`controller._jit`).
    """

    def fold_then(*fold_args: Any) -> T:  # _fold's arguments, passed on as they came
        return consume(_fold(*fold_args))

    return njit_uncached(fold_then)


def featurizer_version_of(policy: object) -> int:
    """The Featurizer version ``policy`` (or a factory of such policies) decides from: the one
    it was trained on (:class:`~controller.policy.VersionedPolicy`), else the current one."""
    return policy.featurizer_version if isinstance(policy, VersionedPolicy) else FEATURIZER_VERSION


def featurizer_for(policy: object, depths: Sequence[int]) -> Featurizer:
    """The Featurizer ``policy`` decides from (:func:`featurizer_version_of`)."""
    return Featurizer(depths, featurizer_version_of(policy))


def warm_up(kernel: Callable[..., Any] | None = None, depths: Sequence[int] = (0, 1)) -> None:
    """Compile ``kernel`` now (or load it from numba's cache): 0.5-6 s, once per process.

    By default the Featurizer's own kernel; a kernel made by :func:`fuse` needs the depths
    its consumer was built for (their observation size). ``controller serve`` calls this
    before it binds, so a (re)started controller's first decision does not wait for the
    compiler (without numba this costs microseconds).
    """
    # Depth 0 is valid for any depths (a deeper record than the deepest allowed raises);
    # numba compiles for the argument types, which every record shares.
    step = Step("warm-up", 1, 0, 1, 0, [], 1000, 100, 0.5, 0, 0)
    Featurizer(depths).update_with(step, _fold if kernel is None else kernel)


@maybe_njit
def _acceptance(st: np.ndarray, k: int, t: float, p: np.ndarray, cum: np.ndarray) -> None:
    """The acceptance estimates at step ``t``: ``p[i - 1]`` the recent conditional acceptance of
    draft position i (1..k), ``cum[d]`` the expected tokens per request at depth d (0..k),
    1 + Σ_{i≤d} Π_{j≤i} p_j. The evidence ages toward the prior while nothing is drafted.

    ``p`` may be the observation's float32 slice: the running product keeps float64.
    """
    o_acc = _HEAD
    o_tried = o_acc + k + 1
    pw = PRIOR_ACCEPT * PRIOR_WEIGHT
    age = t - st[_LAST_SPEC]
    s = STALE_DECAY**age if age > 0 else 1.0
    cum[0] = 1.0
    run = 1.0
    for i in range(1, k + 1):
        if age > 0:
            pi = (s * st[o_acc + i] + pw) / (s * st[o_tried + i] + PRIOR_WEIGHT)
        else:
            pi = (st[o_acc + i] + pw) / (st[o_tried + i] + PRIOR_WEIGHT)
        p[i - 1] = pi
        run *= pi
        cum[i] = cum[i - 1] + run


@maybe_njit
def _lat_ratio(st: np.ndarray, o_row: int, o_ratio: int, i: int) -> float:
    """Step time at the ``i``-th allowed depth / at the smallest, from the latency row at
    ``o_row`` when both are known there, else the running ratio; 0.0 if never measured."""
    li = st[o_row + i]
    lat0 = st[o_row]
    return li / lat0 if li > 0.0 and lat0 > 0.0 else st[o_ratio + i]


@maybe_njit
def _clip2(x: float) -> float:
    return 2.0 if x > 2.0 else -2.0 if x < -2.0 else x


@maybe_njit
def _lat_enter(st: np.ndarray, o_row: int, o_ratio: int, o_seen: int, di: int, step_us: float, t: float) -> None:
    """Enter one record's step time (``step_us``, at the ``di``-th allowed depth, step index
    ``t``) into the latency row at ``o_row``, the running ratio and the last-seen table."""
    old = st[o_row + di]
    st[o_row + di] = step_us if old == 0.0 else old + LAT_ALPHA * (step_us - old)
    if di > 0 and st[o_row] > 0.0:
        r = st[o_ratio + di]
        sample = step_us / st[o_row]
        st[o_ratio + di] = sample if r == 0.0 else r + LAT_ALPHA * (sample - r)
    st[o_seen + di] = t


@maybe_njit
def _fold(
    st: np.ndarray,
    depths: np.ndarray,
    accept: bytes | np.ndarray,
    depth: int,
    bs: int,
    waiting: int,
    step_us: int,
    ctx_tokens: int,
    kv_usage: float,
    prefill_tokens: int,
) -> np.ndarray:
    """Fold one record into the state array ``st`` and return the observation.

    ``accept`` holds the record's accepted drafts (uint8 or int64); ``depths`` the allowed
    depths. The order of every floating-point operation is part of the observation's
    definition (policies are trained on these exact values): change it only with
    ``FEATURIZER_VERSION``.
    """
    n = len(depths)
    k = depths[n - 1]
    o_acc = _HEAD
    o_tried = o_acc + k + 1
    o_lat = o_tried + k + 1
    o_ratio = o_lat + N_BS_BUCKETS * n
    o_seen = o_ratio + n
    t = st[_T] + 1.0
    st[_T] = t
    di = -1
    for i in range(n):
        if depths[i] == depth:
            di = i
    b = 0
    x = bs
    while x > 1 and b < N_BS_BUCKETS - 1:
        x >>= 1
        b += 1
    if bs < 1:
        b = N_BS_BUCKETS - 1
    o_row = o_lat + b * n

    # Version 7: the first drafted record after a depth-0 one proposed from a stale state
    # (the off switch's resume): not evidence of the drafter, as if nothing had been drafted.
    resumed = st[_RESUME] != 0.0 and st[_PREV_DEPTH] == 0.0
    st[_PREV_DEPTH] = float(depth)
    if depth > 0 and len(accept) > 0 and not resumed:
        if depth > k:
            raise ValueError("a speculative record deeper than the deepest allowed depth")
        # A request that accepted a of d drafts reached positions 1..min(a+1, d) and accepted
        # 1..a. Decay per speculative step, so "recent" means recent batches.
        for i in range(1, k + 1):
            st[o_acc + i] *= ACCEPT_DECAY
            st[o_tried + i] *= ACCEPT_DECAY
        count = np.zeros(depth + 1, dtype=np.int64)
        total = 0
        for a in accept:
            total += a
            if 0 <= a <= depth:
                count[a] += 1
        n_ge = bs  # requests with accept >= i-1, starting at i = 1
        for i in range(1, depth + 1):
            st[o_tried + i] += n_ge
            n_ge -= count[i - 1]
            st[o_acc + i] += n_ge
        mean_frac = total / (bs * depth)
        st[_ACC_FAST] += FAST * (mean_frac - st[_ACC_FAST])
        st[_ACC_SLOW] += SLOW * (mean_frac - st[_ACC_SLOW])
        st[_LAST_SPEC] = t

    # Latency table per (bs bucket, depth); EMA so drift is followed. A step that admitted
    # requests also timed their admission, whatever the depth (version 4 leaves it out); under
    # SGLang's overlap scheduler so did, mostly, the step before it (version 5 leaves both out:
    # a record waits for the next one, and enters only if neither admitted).
    decode_step = st[_LAT_DECODE_ONLY] == 0.0 or prefill_tokens == 0
    if st[_LAT_LAG] == 0.0:
        if di >= 0 and step_us > 0 and decode_step:
            _lat_enter(st, o_row, o_ratio, o_seen, di, float(step_us), t)
    else:
        pdi = int(st[_PEND_DI])
        if pdi >= 0 and prefill_tokens == 0:
            _lat_enter(st, int(st[_PEND_ROW]), o_ratio, o_seen, pdi, st[_PEND_US], st[_PEND_T])
        if di >= 0 and step_us > 0 and decode_step:
            st[_PEND_DI] = float(di)
            st[_PEND_ROW] = float(o_row)
            st[_PEND_US] = float(step_us)
            st[_PEND_T] = t
        else:
            st[_PEND_DI] = -1.0

    bs_f = _encode_bs1(bs)
    if st[_HAS_LAST] == 0.0:
        st[_HAS_LAST] = 1.0
        st[_STEP_MS] = step_us / 1000.0
        st[_PREFILL] = float(prefill_tokens)
        st[_BS_FAST] = bs_f
        st[_BS_SLOW] = bs_f
    else:
        st[_STEP_MS] += FAST * (step_us / 1000.0 - st[_STEP_MS])
        st[_PREFILL] += FAST * (prefill_tokens - st[_PREFILL])
        st[_BS_FAST] += FAST * (bs_f - st[_BS_FAST])
        st[_BS_SLOW] += SLOW * (bs_f - st[_BS_SLOW])

    out = np.zeros(10 + 2 * n + k + 3 * n, dtype=np.float32)
    out[0] = bs_f
    out[1] = _encode_bs1(waiting)
    out[2] = waiting / (bs + waiting)
    out[3] = _encode_ctx1(ctx_tokens / bs)
    out[4] = kv_usage
    out[5] = math.log1p(st[_PREFILL]) * _INV_LOG_PREFILL
    out[6] = math.log1p(st[_STEP_MS]) * _INV_LOG_MS
    out[7] = st[_BS_FAST] - st[_BS_SLOW]
    # The trend is evidence too: it fades while nothing is drafted, as the estimates below do.
    # A frozen trend would tell a policy, hundreds of steps later, that acceptance is falling.
    spec_age = t - st[_LAST_SPEC]
    out[8] = (st[_ACC_FAST] - st[_ACC_SLOW]) * (st[_TREND_FADE] ** spec_age if spec_age > 0 else 1.0)
    out[9] = 1.0 - math.exp((st[_LAST_SPEC] - t) * (1.0 / SPEC_STALENESS_STEPS))
    if di >= 0:
        out[10 + di] = 1.0

    # Acceptance per position (evidence ages while nothing is drafted), expected tokens.
    o = 10 + n
    cum = np.empty(k + 1, dtype=np.float64)
    _acceptance(st, k, t, out[o : o + k], cum)
    o += k
    for i in range(n):
        out[o + i] = cum[depths[i]] / (depths[i] + 1)
    o += n

    # Latency ratio per depth: current bucket if both known, else the running ratio.
    base_tok = cum[depths[0]]
    for i in range(n):
        r = _lat_ratio(st, o_row, o_ratio, i)
        if r > 0.0:
            out[o + i] = _clip2(math.log(r))
            out[o + 2 * n + i] = _clip2(math.log(cum[depths[i]] / base_tok / r))
        out[o + n + i] = 1.0 - math.exp((st[o_seen + i] - t) * 0.005)
    return out
