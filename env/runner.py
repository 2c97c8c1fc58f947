"""The one simulation loop: Engine → step record → Featurizer → action → (delayed) depth.

:class:`DecodeLoop` is that loop, one step at a time, and everything that drives the simulator
goes through it: :func:`simulate` (a policy decides; ``controller bench`` and ``controller eval``),
``SpecDecode-v0`` (the agent decides, one loop step per ``env.step``) and ``controller demo``
(a served policy decides, over ZeroMQ). So a policy is judged on exactly the observations it
would get live, with the delay it would see.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.errors import ConfigError
from controller.features import Featurizer, featurizer_for
from controller.policy import EngineBound, Policy
from controller.protocol import DEFAULT_DEPTHS, Step, WarmResume
from env.engine import Engine, RequestStats
from env.params import SimParams

_NO_OBSERVATION = np.zeros(0, dtype=np.float32)


class DecodeLoop:
    """Engine step → step record → Featurizer → observation; the action decided from a record
    runs ``action_delay`` steps later (overlap scheduling: the live hook applies decisions made
    from telemetry one or two steps old); the steps before the first decision run at
    ``depths[0]``.

    Call :meth:`start` once (the first step), then :meth:`advance` with each action, decided
    from the record and observation the previous call returned.

    Args:
        engine: a reset engine (:meth:`Engine.reset`).
        depths: the allowed depths; an action is an index into them.
        action_delay: steps between a record and the step its action applies to (≥ 1).
        featurizer: folds each record into the observation returned (reset, for ``depths``);
            by default a fresh one.
        observe: False: no Featurizer, and an empty observation (whoever decides featurizes,
            as the served controller does in the demo).

    Attributes:
        depth: the depth the last step ran with: the action's, except where the engine's server
            resumes warm (``EngineParams.warm_resume``): a depth above 0 right after a depth-0
            step runs one more step at depth 0 first, as the live hook does.
    """

    def __init__(
        self,
        engine: Engine,
        depths: Sequence[int],
        action_delay: int = 1,
        *,
        featurizer: Featurizer | None = None,
        observe: bool = True,
    ) -> None:
        if action_delay < 1:
            raise ConfigError(f"action_delay must be >= 1, got {action_delay}")
        self.engine = engine
        self.depths = tuple(int(d) for d in depths)
        self.action_delay = action_delay
        self.featurizer = (featurizer or Featurizer(self.depths)) if observe else None
        self.depth = self.depths[0]
        self._pending: deque[int] = deque()
        self._resume = WarmResume()

    def start(self) -> tuple[Step, np.ndarray]:
        """Run the first step, at ``depths[0]``: its record and observation."""
        self._pending = deque([0] * (self.action_delay - 1))
        # The hook's own rule, fresh: the depth of every step goes through it, as on the server.
        self._resume = WarmResume(enabled=self.engine.params.engine.warm_resume)
        return self._run(0)

    def advance(self, action: int) -> tuple[Step, np.ndarray]:
        """Queue ``action`` and run the next step at the action queued ``action_delay`` steps
        ago: its record and observation."""
        pending = self._pending
        pending.append(action)
        return self._run(pending.popleft())

    def _run(self, action: int) -> tuple[Step, np.ndarray]:
        self.depth = depth = self._resume.depth(self.depths[action])
        rec = self.engine.step(depth)
        feat = self.featurizer
        return rec, (feat.update(rec) if feat is not None else _NO_OBSERVATION)


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
        completed: the completed requests' :class:`~env.engine.RequestStats` (for scores
            that judge each request, e.g. goodput under a TPOT target).
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
    completed: list[RequestStats] = field(repr=False, default_factory=list)

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
        and engine.arrivals.limit is None  # n= or requests= bounds the arrivals
        and engine.spec.kind != "replay"
    ):
        raise ConfigError("simulate: give duration_s or n_requests for an endless workload")
    # The policy's own Featurizer version (a zip trained on an older one reads its own).
    loop = DecodeLoop(engine, depths, action_delay, featurizer=featurizer_for(policy, depths))
    policy.reset()
    if isinstance(policy, EngineBound):
        policy.bind_engine(engine)
    limit_us = None if duration_s is None else int(duration_s * 1e6)
    t_list: list[int] = []
    bs_list: list[int] = []
    d_list: list[int] = []
    n_act = len(depths)
    steps = 0
    if not engine.done and max_steps > 0:
        rec, obs = loop.start()
        while True:
            steps += 1
            t_list.append(engine.now_us)
            bs_list.append(rec.bs)
            d_list.append(loop.depth)
            action = int(policy.act(obs, rec))
            if not 0 <= action < n_act:
                raise ConfigError(f"policy {policy.name!r} answered action {action}, outside 0..{n_act - 1}")
            if limit_us is not None and engine.now_us >= limit_us:
                break
            if n_requests is not None and len(engine.completed) >= n_requests:
                break
            if engine.done or steps >= max_steps:
                break
            rec, obs = loop.advance(action)
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
        completed=list(engine.completed),
    )
