"""``SpecDecode-v0``: choose the EAGLE-3 draft depth of every decode step of a simulated server."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from controller._jit import maybe_njit
from controller.errors import ConfigError
from controller.features import FEATURIZER_VERSION, Featurizer
from controller.protocol import DEFAULT_DEPTHS
from env.deployments import resolve
from env.engine import Engine
from env.params import SimParams
from env.runner import DecodeLoop

OBS_BOUND = 10.0
# Drafter quality for ``drafter_mix`` episodes: the acceptance model's base logit ``alpha``
# drawn uniformly from here — from a useless drafter (sigmoid(-6) ≈ 0.0025 per position, like
# a draft model for the wrong target) to a near-perfect one (sigmoid(5) ≈ 0.993).
DRAFTER_ALPHA_RANGE = (-6.0, 5.0)
# ... and the spread across requests (``sigma``, logits) log-uniform here: a fit pooled over
# different drafters has a huge sigma that no single drafter shows.
DRAFTER_SIGMA_RANGE = (0.2, 2.0)


class SpecDecodeEnv(gym.Env):
    """Pick the draft depth of each decode step of a simulated SGLang EAGLE-3 server.

    ## Description
    A discrete-event model of one SGLang replica (continuous batching, KV-budgeted admission,
    prefill, per-request acceptance, fitted step latency; :mod:`env.engine`) runs a workload.
    Each ``step`` runs one decode step. The agent sees only what the live controller sees: the
    Featurizer (``controller/features.py``) applied to the ``step`` records the engine emits,
    exactly the records the hook would send.

    ## Action Space
    ``Discrete(len(depths))``: an index into ``depths`` (default ``(0, 1, 2, 3, 5)``; depth 0
    means no speculation). As on the live hook, the action decided after record ``t`` is
    applied to step ``t + action_delay`` (overlap scheduling); the steps before run at
    ``depths[0]``.

    ## Observation Space
    ``Box(-10, 10, (obs_dim,), float32)``: the Featurizer's observation (its docstring has the
    table of features), clipped to ±10 (no feature reaches that in practice).

    ## Rewards
    ``r_t = (tokens_t − bs_t · T(d_t) / T(0)) / reward_scale`` where ``tokens_t = Σ(accept+1)``
    is what step ``t`` emitted, ``T(d)`` the latency model's time of this same batch (same
    contexts, same prefill) at depth ``d``, and ``bs_t · T(d_t)/T(0)`` the tokens no speculation
    would have emitted in the time the step took: "extra tokens over no speculation in the
    same time". Depth 0 earns exactly 0. The episode return × ``reward_scale`` is the number of
    extra output tokens over no speculation, batch by batch; divided by the episode's busy
    time it is the throughput gain (tok/s) over no speculation at the batch sizes the
    episode went through. ``reward_scale`` (default 32 tokens) keeps per-step rewards near
    unit scale.

    ## Starting State
    An empty server at t = 0; ``reset`` runs the first decode step at ``depths[0]`` and returns
    its observation. Workload, deployment (optionally randomized) and delay are drawn from
    ``self.np_random``; the engine's RNG streams are seeded from it, so the same seed gives the
    same episode.

    ## Episode End
    Terminated when a finite workload (``n=``/``replay:``) has no request left; truncated
    after ``episode_steps`` steps (and by ``max_episode_steps`` at registration, 2048).

    ## Arguments
    - ``deployment``: bundled name (``h200-llama8b``, ``seed``), a sim.json path, or SimParams.
    - ``workload``: a spec string or a list to sample from per episode (:mod:`env.workload`).
    - ``depths``: allowed depths, strictly increasing, starting at 0.
    - ``action_delay``: int, or ``(lo, hi)`` to draw per episode (inclusive).
    - ``randomize``: domain-randomization scale over the fit's standard errors (0 = off).
    - ``drafter_mix``: fraction of episodes whose drafter quality (acceptance ``alpha``) is
      drawn uniformly from ``DRAFTER_ALPHA_RANGE`` and its spread across requests log-uniformly
      from ``DRAFTER_SIGMA_RANGE``, instead of the fit's, so that a policy has
      also seen drafters far better or worse than the one it was fitted to (0 = off).
    - ``episode_steps``: steps per episode.
    - ``reward_scale``: tokens per unit reward.
    - ``featurizer_version``: the observation's definition (``controller.features``; default
      the current one).

    ``reset(options=...)`` may override ``deployment``, ``workload`` or ``concurrency`` (an int:
    workload ``closed:C``) for that episode.

    ``info`` holds ``step`` (the record), ``depth``, ``tokens``, ``busy_us``, ``now_us``.

    ## Version History
    - v0: first version (Featurizer version 1); ``drafter_mix`` added (off by default).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        deployment: str | SimParams = "h200-llama8b",
        workload: str | Sequence[str] = "closed:32",
        depths: Sequence[int] = DEFAULT_DEPTHS,
        action_delay: int | tuple[int, int] = 1,
        randomize: float = 0.0,
        drafter_mix: float = 0.0,
        episode_steps: int = 2048,
        reward_scale: float = 32.0,
        featurizer_version: int = FEATURIZER_VERSION,
    ) -> None:
        self.depths = tuple(int(d) for d in depths)
        if not self.depths or self.depths[0] != 0:
            raise ConfigError(f"depths must start at 0 (no speculation): {self.depths}")
        self.base_params = resolve(deployment)
        self.workloads = [workload] if isinstance(workload, str) else list(workload)
        if not self.workloads:
            raise ConfigError("workload: give a spec or a non-empty list")
        if isinstance(action_delay, int):
            self.delay_range = (action_delay, action_delay)
        else:
            self.delay_range = (int(action_delay[0]), int(action_delay[1]))
        if self.delay_range[0] < 1 or self.delay_range[1] < self.delay_range[0]:
            raise ConfigError(f"action_delay must be >= 1 (or a range lo <= hi): {action_delay}")
        self.randomize = float(randomize)
        if not 0.0 <= drafter_mix <= 1.0:
            raise ConfigError(f"drafter_mix must be in [0, 1], got {drafter_mix}")
        self.drafter_mix = float(drafter_mix)
        self.episode_steps = int(episode_steps)
        self.reward_scale = float(reward_scale)
        self.featurizer = Featurizer(self.depths, featurizer_version)
        self.observation_space = spaces.Box(-OBS_BOUND, OBS_BOUND, (self.featurizer.obs_dim,), np.float32)
        self.action_space = spaces.Discrete(len(self.depths))
        self.engine: Engine | None = None
        self._loop: DecodeLoop | None = None
        self._steps = 0

    def _obs(self, raw: np.ndarray) -> np.ndarray:
        # The Featurizer's fresh float32 array, clipped in place.
        return _clip(raw, OBS_BOUND)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        rng = self.np_random
        params = resolve(options["deployment"]) if "deployment" in options else self.base_params
        if self.randomize > 0.0:
            params = params.perturb(rng, self.randomize)
        if self.drafter_mix > 0.0 and rng.random() < self.drafter_mix:
            alpha = float(rng.uniform(*DRAFTER_ALPHA_RANGE))
            lo, hi = np.log(DRAFTER_SIGMA_RANGE)
            sigma = float(np.exp(rng.uniform(lo, hi)))
            params = replace(params, acceptance=replace(params.acceptance, alpha=alpha, sigma=sigma))
        if "workload" in options:
            wl = str(options["workload"])
        elif "concurrency" in options:
            wl = f"closed:{int(options['concurrency'])}"
        else:
            wl = self.workloads[int(rng.integers(len(self.workloads)))]
        delay = int(rng.integers(self.delay_range[0], self.delay_range[1] + 1))
        self.engine = Engine(params, wl)
        self.engine.reset(int(rng.integers(2**63 - 1)))
        self.featurizer.reset()
        self._loop = DecodeLoop(self.engine, self.depths, delay, featurizer=self.featurizer)
        self._steps = 0
        rec, raw = self._loop.start()
        obs = self._obs(raw)
        return obs, self._info(rec, self.depths[0], rec.tokens)

    def step(self, action):
        eng, loop = self.engine, self._loop
        if eng is None or loop is None:
            raise ConfigError("call reset() before step()")
        a = int(action)
        if not 0 <= a < len(self.depths):
            raise ConfigError(f"action {a} outside 0..{len(self.depths) - 1}")
        rec, raw = loop.advance(a)
        depth = loop.depth
        self._steps += 1
        obs = self._obs(raw)
        # The engine's step also evaluated the latency model at depth 0 for this batch.
        tokens = eng.last_tokens  # rec.tokens, already summed by the engine
        extra = tokens - rec.bs * (eng.last_model_us / eng.last_base_us)
        info = self._info(rec, depth, tokens)
        return obs, extra / self.reward_scale, eng.done, self._steps >= self.episode_steps, info

    def _info(self, rec, depth: int, tokens: int) -> dict[str, Any]:
        eng = self.engine
        assert eng is not None
        return {
            "step": rec,
            "depth": depth,
            "tokens": tokens,
            "busy_us": eng.last_busy_us,
            "now_us": eng.now_us,
        }


@maybe_njit
def _clip(x: np.ndarray, bound: float) -> np.ndarray:
    """Clip ``x`` to ``[-bound, bound]`` in place and return it (one compiled loop: half the
    cost of two in-place ufuncs on an observation, a tenth of np.clip's)."""
    for i in range(len(x)):
        v = x[i]
        if v > bound:
            x[i] = bound
        elif v < -bound:
            x[i] = -bound
    return x
