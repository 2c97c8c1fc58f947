"""The one simulation loop: Engine → step record → Featurizer → policy → (delayed) depth.

The gym environment, ``controller bench`` and the agents' evaluation all drive the engine
this way, so a policy is judged on exactly the observations it would get live.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.errors import ConfigError
from controller.features import Featurizer
from controller.policy import EngineBound, Policy
from env.engine import Engine
from env.params import SimParams

DEFAULT_DEPTHS = (0, 1, 2, 3, 5)


@dataclass
class RunResult:
    """What one simulated run measured.

    Attributes:
        throughput_tok_s: output tokens / simulated wall time (from t = 0 to the last step).
        tpot_ms_mean: mean over completed requests of (finish − first token)/(tokens − 1).
        tpot_ms_p99: 99th percentile of the same.
        n_requests: requests completed.
        steps: decode steps run.
        depth_hist: depth → steps run at it.
        tokens: output tokens emitted.
        duration_s: simulated wall time.
        trace_time_s, trace_bs, trace_depth: per step, for plots.
    """

    throughput_tok_s: float
    tpot_ms_mean: float
    tpot_ms_p99: float
    n_requests: int
    steps: int
    depth_hist: dict[int, int]
    tokens: int
    duration_s: float
    trace_time_s: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    trace_bs: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.int32))
    trace_depth: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.int16))

    def as_dict(self) -> dict:
        return {
            "throughput_tok_s": self.throughput_tok_s,
            "tpot_ms_mean": self.tpot_ms_mean,
            "tpot_ms_p99": self.tpot_ms_p99,
            "n_requests": self.n_requests,
            "steps": self.steps,
            "depth_hist": {str(k): v for k, v in sorted(self.depth_hist.items())},
            "tokens": self.tokens,
            "duration_s": self.duration_s,
        }


def simulate(
    params: SimParams,
    workload: str,
    policy: Policy,
    *,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    seed: int = 0,
    duration_s: float | None = None,
    n_requests: int | None = None,
    action_delay: int = 1,
    max_steps: int = 10_000_000,
) -> RunResult:
    """Run ``policy`` on the simulated deployment and measure it.

    The decision made from record ``t`` is applied at step ``t + action_delay`` (the live hook
    applies decisions made from telemetry one or two steps old); the steps before the first
    decision arrives run at ``depths[0]``.

    Args:
        params: the deployment.
        workload: a workload spec (see :mod:`env.workload`).
        policy: any :class:`controller.policy.Policy`; an :class:`~controller.policy.EngineBound`
            one (the clairvoyant oracle) is bound to the engine first.
        depths: the allowed depths (the policy's action indexes them).
        seed: RNG seed of the engine.
        duration_s: stop once simulated time reaches this.
        n_requests: stop once this many requests completed.
        action_delay: steps between a record and the step its decision applies to (≥ 1).
        max_steps: a hard cap on steps.

    Raises:
        ConfigError: no stop condition for an endless workload, a bad delay, or an action
            outside ``range(len(depths))``.
    """
    depths = tuple(int(d) for d in depths)
    if action_delay < 1:
        raise ConfigError(f"action_delay must be >= 1, got {action_delay}")
    engine = Engine(params, workload)
    engine.reset(seed)
    if (
        duration_s is None
        and n_requests is None
        and engine.spec.n_requests is None
        and engine.spec.kind != "replay"
    ):
        raise ConfigError("simulate: give duration_s or n_requests for an endless workload")
    feat = Featurizer(depths)
    policy.reset()
    if isinstance(policy, EngineBound):
        policy.bind_engine(engine)
    pending: deque[int] = deque([0] * action_delay)
    limit_us = None if duration_s is None else int(duration_s * 1e6)
    t_list: list[int] = []
    bs_list: list[int] = []
    d_list: list[int] = []
    n_act = len(depths)
    steps = 0
    while not engine.done and steps < max_steps:
        depth = depths[pending.popleft()]
        rec = engine.step(depth)
        steps += 1
        t_list.append(engine.now_us)
        bs_list.append(rec.bs)
        d_list.append(depth)
        obs = feat.update(rec)
        action = int(policy.act(obs, rec))
        if not 0 <= action < n_act:
            raise ConfigError(f"policy {policy.name!r} answered action {action}, outside 0..{n_act - 1}")
        pending.append(action)
        if limit_us is not None and engine.now_us >= limit_us:
            break
        if n_requests is not None and len(engine.completed) >= n_requests:
            break
    return _result(engine, steps, t_list, bs_list, d_list)


def _result(
    engine: Engine, steps: int, t_list: list[int], bs_list: list[int], d_list: list[int]
) -> RunResult:
    dur_s = engine.now_us / 1e6
    tpots = np.array([r.tpot_ms for r in engine.completed if r.output_tokens > 1], dtype=float)
    depth_arr = np.asarray(d_list, dtype=np.int16)
    hist = {int(d): int(c) for d, c in zip(*np.unique(depth_arr, return_counts=True))}
    return RunResult(
        throughput_tok_s=engine.tokens_emitted / dur_s if dur_s > 0 else 0.0,
        tpot_ms_mean=float(tpots.mean()) if len(tpots) else float("nan"),
        tpot_ms_p99=float(np.percentile(tpots, 99)) if len(tpots) else float("nan"),
        n_requests=len(engine.completed),
        steps=steps,
        depth_hist=hist,
        tokens=engine.tokens_emitted,
        duration_s=dur_s,
        trace_time_s=np.asarray(t_list, dtype=np.float64) / 1e6,
        trace_bs=np.asarray(bs_list, dtype=np.int32),
        trace_depth=depth_arr,
    )
