"""The builtin policies: the baselines the learned controller must beat, behind the one Policy interface.

Every baseline sees only what a live controller sees — the Featurizer's observation and the
step record it came from — so each runs unchanged in the simulator and under
``controller serve --policy builtin:NAME`` (:mod:`controller.registry` names them). This
module needs only numpy and the shared base.

=====================  ======================================================================
builtin name           rule
=====================  ======================================================================
``static:K``           always depth K
``vllm-dsd``           vLLM Dynamic SD's batch-size table (Llama-3.1-8B EAGLE-3 example):
                       k=5 for bs 1–16, 4 for 17–32, 3 for 33–64, 1 for 65–128, 0 above
``trtllm-schedule``    TensorRT-LLM ``draft_len_schedule`` {4: 4, 8: 2, 32: 1}, else 0
``sglang-adaptive``    SGLang 0.5.23's ``AdaptiveSpeculativeParams`` with its default
                       per-batch-size tiers, re-implemented from
                       ``speculative/adaptive_spec_params.py`` (what a stock SGLang runs)
``sglang-adaptive-all``  the same rule with the tiers ``sglang_hook.launch_server`` generates:
                       every allowed depth at every batch size, starting at the middle depth
                       (what SGLang runs under our launcher when the controller is silent)
``goodput``            SmartSpec-style: per-position acceptance × step cost, argmax expected
                       tokens/s; step cost from a fitted latency model when given
                       (``controller eval``'s ``goodput-fit``: the deployment's fit, while the
                       simulated world is drawn around it), else — as ``controller serve``
                       serves it — the Featurizer's measured latency table
``bandit``             discounted UCB over depths per batch-size bucket, reward = tokens/s
``oracle``             clairvoyant per-step best — simulator only (``agents.oracle``; the
                       registry refuses to serve it)
=====================  ======================================================================

Table baselines map a table depth k to the largest allowed depth ≤ k (the smallest allowed
depth if none is ≤ k), so they work for any ``depths``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

import numpy as np

from controller.errors import PolicyLoadError
from controller.features import N_BS_BUCKETS, Featurizer, bs_bucket
from controller.policy import Policy
from controller.protocol import Step

# A fitted step-cost model: (depth, bs, ctx_tokens) -> µs per decode step.
LatencyFn = Callable[[int, int, int], float]


def nearest_allowed_at_most(k: int, depths: Sequence[int]) -> int:
    """Index of the largest allowed depth ≤ k, or of the smallest allowed depth if none is."""
    i = bisect.bisect_right(list(depths), k) - 1
    return max(i, 0)


# --------------------------------------------------------------------------- static


class StaticPolicy:
    """Always the same depth: ``static:K``. Depth 0 means no speculation."""

    def __init__(self, depth: int, depths: tuple[int, ...]) -> None:
        if depth not in depths:
            raise PolicyLoadError(
                f"static:{depth}: depth {depth} is not one of the allowed depths {list(depths)}"
            )
        self.name = f"static:{depth}"
        self._action = depths.index(depth)

    def reset(self) -> None:
        pass

    def act(self, obs: np.ndarray, step: Step) -> int:
        return self._action


def make_static(name: str, depths: tuple[int, ...]) -> Policy:
    """``static:K`` (``name`` holds K after the colon)."""
    arg = name.split(":", 1)[1]
    try:
        depth = int(arg)
    except ValueError:
        raise PolicyLoadError(f"builtin:{name}: the depth must be an integer") from None
    return StaticPolicy(depth, depths)


# --------------------------------------------------------------------------- table rules


class TablePolicy:
    """Depth from the current batch size through a step table: ``(bs_max, k)`` rows, first
    row with ``bs <= bs_max`` wins, ``default`` above the last row."""

    def __init__(
        self, name: str, depths: tuple[int, ...], rows: Sequence[tuple[int, int]], default: int
    ) -> None:
        self.name = name
        self.depths = depths
        self._bounds = [b for b, _ in rows]
        self._actions = [nearest_allowed_at_most(k, depths) for _, k in rows]
        self._default = nearest_allowed_at_most(default, depths)

    def reset(self) -> None:
        pass

    def act(self, obs: np.ndarray, step: Step) -> int:
        i = bisect.bisect_left(self._bounds, step.bs)
        return self._actions[i] if i < len(self._actions) else self._default


VLLM_DSD_ROWS = ((16, 5), (32, 4), (64, 3), (128, 1))
TRTLLM_ROWS = ((4, 4), (8, 2), (32, 1))


def make_vllm_dsd(name: str, depths: tuple[int, ...]) -> Policy:
    return TablePolicy(name, depths, VLLM_DSD_ROWS, default=0)


def make_trtllm(name: str, depths: tuple[int, ...]) -> Policy:
    return TablePolicy(name, depths, TRTLLM_ROWS, default=0)


# --------------------------------------------------------------------------- SGLang adaptive

# SGLang 0.5.23 speculative/adaptive_spec_params.py, DEFAULT_ADAPTIVE_CONFIG, verbatim.
SGLANG_DEFAULT_ADAPTIVE_CONFIG: dict[str, dict[str, object]] = {
    "1": {
        "candidate_steps": [1, 3, 5, 7],
        "up_hysteresis": 0.0,
        "down_hysteresis": -0.25,
        "ceiling_coeff": 0,
    },
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
# SGLang's default --speculative-num-steps for EAGLE-3 launches in its docs and examples.
SGLANG_INITIAL_STEPS = 3
# The decode CUDA-graph batch sizes SGLang captures with speculation on
# (arg_groups/cuda_graph_hook.py, generate_decode_cuda_graph_batch_sizes, spec case), up to
# max_bs 256: routing pads the batch size to these before picking a tier.
SGLANG_SPEC_GRAPH_BS = (
    list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
)


class _AdaptiveSlot:
    """``AdaptiveStepSlot``: EMA of accepted drafts, warm-up, update interval, hysteresis."""

    def __init__(self, initial_steps: int, cfg: dict[str, object]) -> None:
        candidates = sorted(set(cfg["candidate_steps"]))  # type: ignore[call-overload]
        self.candidate_steps: list[int] = candidates
        self.ema_alpha = float(cfg.get("ema_alpha", 0.2))  # type: ignore[arg-type]
        self.update_interval = int(cfg.get("update_interval", 5))  # type: ignore[call-overload]
        self.warmup_batches = int(cfg.get("warmup_batches", 10))  # type: ignore[call-overload]
        self.down_hysteresis = float(cfg.get("down_hysteresis", -0.25))  # type: ignore[arg-type]
        self.up_hysteresis = float(cfg.get("up_hysteresis", 0.0))  # type: ignore[arg-type]
        self.ceiling_coeff = float(cfg.get("ceiling_coeff", 0))  # type: ignore[arg-type]
        if initial_steps in candidates:
            self.current_steps = initial_steps
        else:
            self.current_steps = candidates[len(candidates) // 2]
        self.ema_accept_len = float(self.current_steps - 1)
        self._batch_count = 0

    def update(self, num_correct_drafts_per_req: list[int]) -> bool:
        if not num_correct_drafts_per_req:
            return False
        if self.current_steps > 0:
            batch_avg = sum(num_correct_drafts_per_req) / len(num_correct_drafts_per_req)
            self.ema_accept_len = (1 - self.ema_alpha) * self.ema_accept_len + self.ema_alpha * batch_avg
        self._batch_count += 1
        if self._batch_count <= self.warmup_batches:
            return False
        if (self._batch_count - self.warmup_batches) % self.update_interval != 0:
            return False
        return self._recompute()

    def _recompute(self) -> bool:
        old = self.current_steps
        idx = self.candidate_steps.index(old)
        old_idx = idx
        if old == 0:  # probe the smallest positive step after a no-spec interval
            idx = min(idx + 1, len(self.candidate_steps) - 1)
            target = self.candidate_steps[idx]
            if target > 0 and self.ema_accept_len < 0:
                self.ema_accept_len = float(target - 1)
            return self._apply(old, target)
        while idx > 0:
            prev = self.candidate_steps[idx - 1]
            drop = (0.5 if prev == 0 else prev - 0.5) + self.down_hysteresis
            if self.ema_accept_len <= drop:
                idx -= 1
            else:
                break
        if not idx < old_idx:
            while idx < len(self.candidate_steps) - 1:
                if self.ema_accept_len > self.candidate_steps[idx] - 0.5 + self.up_hysteresis:
                    idx += 1
                else:
                    break
        target = self.candidate_steps[idx]
        if self.ceiling_coeff > 0:
            ceiling = max(1, math.ceil(self.ema_accept_len * self.ceiling_coeff))
            if ceiling < target <= old:
                while idx > 0 and self.candidate_steps[idx] > ceiling:
                    idx -= 1
                target = self.candidate_steps[idx]
        return self._apply(old, target)

    def _apply(self, old: int, target: int) -> bool:
        if target != old:
            self.current_steps = target
            return True
        return False


class SGLangAdaptivePolicy:
    """SGLang 0.5.23's adaptive rule (``AdaptiveSpeculativeParams``) with its defaults.

    Each tier's ``candidate_steps`` is intersected with the allowed depths (a tier left empty
    gets the allowed depth nearest below its smallest candidate). Per step record, exactly
    what SGLang does per verify: ``on_verify_complete(accepts, bs)`` on the tier of ``bs``
    (a depth-0 step runs a width-1 verify, so SGLang passes one zero per request), then
    ``get_steps_for_batch(bs)`` for the next launch — with the record's ``bs`` standing in
    for the next batch, which the controller cannot see yet.
    """

    def __init__(
        self,
        name: str,
        depths: tuple[int, ...],
        config: dict[str, dict[str, object]] | None = None,
        initial_steps: int = SGLANG_INITIAL_STEPS,
        graph_bs: Sequence[int] | None = SGLANG_SPEC_GRAPH_BS,
    ) -> None:
        self.name = name
        self.depths = depths
        self._config = dict(config or SGLANG_DEFAULT_ADAPTIVE_CONFIG)
        self._initial = initial_steps
        self._graph_bs = sorted(graph_bs) if graph_bs else None
        self._index = {d: i for i, d in enumerate(depths)}
        self.reset()

    def reset(self) -> None:
        self._bs_list = sorted(int(k) for k in self._config if k.isdigit())
        self._slots: dict[int, _AdaptiveSlot] = {}
        for key in self._bs_list:
            entry = dict(self._config[str(key)])
            cands = [s for s in entry["candidate_steps"] if s in self._index]  # type: ignore[attr-defined]
            if not cands:
                lowest = min(entry["candidate_steps"])  # type: ignore[call-overload]
                cands = [self.depths[nearest_allowed_at_most(lowest, self.depths)]]
            entry["candidate_steps"] = cands
            self._slots[key] = _AdaptiveSlot(self._initial, entry)

    def _route(self, bs: int) -> _AdaptiveSlot:
        if self._graph_bs is not None:
            i = bisect.bisect_left(self._graph_bs, bs)
            if i < len(self._graph_bs):
                bs = self._graph_bs[i]
        i = bisect.bisect_right(self._bs_list, bs) - 1
        return self._slots[self._bs_list[max(0, i)]]

    def act(self, obs: np.ndarray, step: Step) -> int:
        accepts = step.accept if step.depth > 0 else [0] * step.bs
        self._route(step.bs).update(accepts)
        return self._index[self._route(step.bs).current_steps]


def make_sglang_adaptive(name: str, depths: tuple[int, ...]) -> Policy:
    return SGLangAdaptivePolicy(name, depths)


def launcher_adaptive_config(depths: Sequence[int]) -> dict[str, dict[str, object]]:
    """The ``--speculative-adaptive-config`` ``sglang_hook.launch_server`` generates: one key
    routing every batch size to every allowed depth (SGLang's defaults for the rest)."""
    return {"1": {"candidate_steps": list(depths)}}


def make_sglang_adaptive_all(name: str, depths: tuple[int, ...]) -> Policy:
    """SGLang's rule under our launcher: all depths at every batch size, starting where the
    launcher starts it (``--speculative-num-steps`` = the middle allowed depth)."""
    return SGLangAdaptivePolicy(
        name, depths, config=launcher_adaptive_config(depths), initial_steps=depths[len(depths) // 2]
    )


# --------------------------------------------------------------------------- goodput


class GoodputPolicy:
    """SmartSpec-style goodput maximiser: argmax over depths of expected tokens per second.

    Expected tokens per request at depth k are the Featurizer's estimate, 1 + Σ_{i≤k} Π_{j≤i} p_j
    over its per-position conditional acceptance (``tokens_k`` in the observation). The step cost
    comes from ``latency_fn(depth, bs, ctx_tokens)`` (a fitted model, µs) when given; without
    one (``controller serve`` with no sim), from the Featurizer's measured latency table
    (``lat_ratio_k``), probing, every ``probe_every`` steps, a depth whose cost in this
    batch-size bucket is unknown or stale, so the table fills in. After ``probe_zero_every``
    steps at depth 0 (where acceptance goes unobserved) it drafts once to re-measure it, with
    the interval doubling while depth 0 stays best.

    Args:
        name: policy name.
        depths: the allowed depths.
        latency_fn: fitted step cost in µs, or None for the measured table.
        probe_every: steps between probes of an unmeasured depth (measured-table mode).
        probe_zero_every: depth-0 steps between acceptance probes.
    """

    def __init__(
        self,
        name: str,
        depths: tuple[int, ...],
        latency_fn: LatencyFn | None = None,
        probe_every: int = 100,
        probe_zero_every: int = 20,
    ) -> None:
        self.name = name
        self.depths = depths
        self.latency_fn = latency_fn
        self.probe_every = probe_every
        self.probe_zero_every = probe_zero_every
        names = Featurizer(depths).feature_names
        self._tokens_idx = [names.index(f"tokens_{d}") for d in depths]
        self._gp_idx = [names.index(f"goodput_{d}") for d in depths]
        self.reset()

    def reset(self) -> None:
        self._t = 0
        self._zero_run = 0
        self._probe_gap = self.probe_zero_every
        self._seen: dict[tuple[int, int], int] = {}  # (bucket, action) -> last step measured
        self._pending: tuple[int, int, int] | None = None  # (bucket, action, step) not yet measured

    def expected_tokens(self, obs: np.ndarray) -> list[float]:
        """Expected tokens per request-step at each allowed depth: the observation's
        ``tokens_k``, which the Featurizer reports divided by k + 1."""
        return [float(obs[j]) * (d + 1) for j, d in zip(self._tokens_idx, self.depths)]

    def act(self, obs: np.ndarray, step: Step) -> int:
        self._t += 1
        self._zero_run = self._zero_run + 1 if step.depth == 0 else 0
        if self.latency_fn is not None:
            tokens = self.expected_tokens(obs)
            rates = [
                tok / max(self.latency_fn(d, step.bs, step.ctx_tokens), 1.0)
                for tok, d in zip(tokens, self.depths)
            ]
            best = int(np.argmax(rates))
            # Without drafting, acceptance is not observed and its estimate freezes; a batch
            # whose requests changed would stay at depth 0 for ever. Probe the best positive
            # depth for one step after `_probe_gap` steps at depth 0; the gap doubles (up to
            # 32×) while probes keep confirming depth 0, so a deployment where speculation
            # never pays spends almost nothing on probes, and resets once drafting wins.
            if self.depths[best] != 0:
                self._probe_gap = self.probe_zero_every
            elif len(self.depths) > 1 and self._zero_run >= self._probe_gap:
                self._zero_run = 0
                self._probe_gap = min(2 * self._probe_gap, 32 * self.probe_zero_every)
                return 1 + int(np.argmax(rates[1:]))
            return best
        # Measured-table mode: the observation's goodput_k is log(tokens/s at k ÷ at depth 0)
        # from this bucket's measured latencies, or the running ratio over buckets where one is
        # missing. As in the Featurizer (version 5), a step measures its depth once the next
        # one is known, and neither a step that admitted requests nor the one before it does.
        bucket = bs_bucket(step.bs)
        if self._pending is not None and step.prefill_tokens == 0:
            self._seen[self._pending[:2]] = self._pending[2]
        self._pending = None
        if step.depth in self.depths and step.prefill_tokens == 0:
            self._pending = (bucket, self.depths.index(step.depth), self._t)
        if self._t % self.probe_every == 0:
            stalest = min(range(len(self.depths)), key=lambda a: self._seen.get((bucket, a), -(10**9)))
            if self._t - self._seen.get((bucket, stalest), -(10**9)) > 5 * self.probe_every:
                return stalest
        best = int(np.argmax(obs[self._gp_idx]))
        # Depth 0 is the reference of every ratio and the safe choice: in a bucket where it was
        # never measured, measure it before drafting. Reading the running ratio instead, the
        # served goodput entered batch 64-128 drafting on the H100 testbed (small batches'
        # ratios flatter drafting there), never measured depth 0 and stayed at 0.46-0.49x a
        # plain server (bench/results/realgpu/h100/README.md).
        if best != 0 and (bucket, 0) not in self._seen:
            return 0
        return best


def make_goodput(name: str, depths: tuple[int, ...]) -> Policy:
    return GoodputPolicy(name, depths)


# --------------------------------------------------------------------------- bandit


class BanditPolicy:
    """Discounted UCB1 over depths, one bandit per batch-size bucket (BanditSpec/Nightjar-style).

    The reward of a step is its throughput, tokens/s, credited to the depth that step really
    ran with (under overlap scheduling that is not the last choice). Rewards are scaled by the
    bucket's best mean so the exploration bonus is unit-free; discounting (``gamma`` per
    update of that bucket) lets it follow acceptance phase shifts.

    Args:
        name: policy name.
        depths: the allowed depths.
        c: exploration weight.
        gamma: per-observation discount of the bucket's statistics.
    """

    def __init__(self, name: str, depths: tuple[int, ...], c: float = 0.2, gamma: float = 0.998) -> None:
        self.name = name
        self.depths = depths
        self.c = c
        self.gamma = gamma
        self._index = {d: i for i, d in enumerate(depths)}
        self.reset()

    def reset(self) -> None:
        n = len(self.depths)
        self._n = np.zeros((N_BS_BUCKETS, n))
        self._sum = np.zeros((N_BS_BUCKETS, n))

    def act(self, obs: np.ndarray, step: Step) -> int:
        b = bs_bucket(step.bs)
        ran = self._index.get(step.depth)
        if ran is not None and step.step_us > 0:
            self._n[b] *= self.gamma
            self._sum[b] *= self.gamma
            self._n[b, ran] += 1.0
            self._sum[b, ran] += step.tokens / step.step_us * 1e6
        n = self._n[b]
        untried = np.flatnonzero(n < 1e-9)
        if untried.size:
            return int(untried[0])
        means = self._sum[b] / n
        scale = float(means.max()) or 1.0
        bonus = self.c * np.sqrt(2.0 * math.log(n.sum()) / n)
        return int(np.argmax(means / scale + bonus))


def make_bandit(name: str, depths: tuple[int, ...]) -> Policy:
    return BanditPolicy(name, depths)


# The non-static baselines a real deployment can run (each sees telemetry only), in report
# order; static:K are added per allowed depth. ``controller eval`` adds ``goodput-fit`` (the
# fitted model) and, as labelled references, ``goodput-exact`` and ``oracle``.
BASELINES: tuple[str, ...] = (
    "vllm-dsd",
    "trtllm-schedule",
    "sglang-adaptive",
    "sglang-adaptive-all",
    "goodput",
    "bandit",
)


__all__ = [
    "BASELINES",
    "BanditPolicy",
    "GoodputPolicy",
    "LatencyFn",
    "SGLangAdaptivePolicy",
    "StaticPolicy",
    "TablePolicy",
    "nearest_allowed_at_most",
]
