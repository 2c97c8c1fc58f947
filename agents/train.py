"""``controller train``: fit the simulator, train a PPO depth policy in it, save what serving needs.

The pipeline, top to bottom:

1. **Simulator.** ``--traces DIR [--profile CSV ...]`` → ``env.fit.fit_sim``; or a bundled
   ``--deployment``; or a ready ``--sim sim.json``. The parameters used are written as
   ``sim.json`` next to the policy.
2. **Environment.** ``env.gym_env.SpecDecodeEnv`` (``SpecDecode-v0``): observations are the
   Featurizer's, exactly as served. Domain randomization per episode: simulator parameters
   drawn around the fit by their standard errors (``randomize``), a workload drawn from a
   broad mix (closed loop C log-uniform in 1…250, Poisson at 5–100% of capacity, ramps,
   bursts, chat↔code acceptance phase shifts on closed and open bases), in 30% of episodes a
   drafter of random quality (from useless to near perfect: ``drafter_mix``), and the
   overlap-scheduling action delay drawn from {1, 2}.
3. **Reward** (``--reward``). The default, ``objective``, is the user's objective over time
   (``--objective``: throughput, or goodput under a TPOT target) as a Dinkelbach reward
   against a slowly moving reference rate, with ``gamma`` 0.98 so that a choice whose payoff
   comes later (a probe of the drafter, a queue) is credited. :class:`RegretReward` (the
   fraction of the best expected tokens/s at each step, ``gamma`` 0) remains as ``regret``.
   Rewards use the simulator's true acceptance and latency (privileged information for the
   reward only, never in an observation).
4. **Warm start.** DAgger-style cloning of a realistic expert: the fitted model's goodput on
   the observed acceptance, plus :class:`ProbeRule` (draft briefly after a long stretch at
   depth 0, so a drafter that turned good is found). States are collected by rolling out the
   expert, then the current network; every allowed depth is scored there.
5. **PPO.** stable-baselines3 PPO (MlpPolicy, 2×64 tanh) fine-tunes on-policy with the same
   reward, with a progress bar and TensorBoard logs (``tb/``).
6. **Selection.** SB3's ``EvalCallback`` scores the deterministic policy on the same validation
   episodes (the training distribution, their own seed: :class:`ValidationSelect`) before PPO
   and every ``select_every`` steps; the weights saved are the best scored, so the fine-tuning
   can only replace the warm start where it did better on episodes it was not trained on.
7. **Outputs.** ``ppo.zip`` (SB3 format + ``specdepth.json``, loadable by ``controller serve``
   unchanged), ``sim.json``, ``train_config.json`` (the resolved config),
   ``train_report.md``.

Reproducible for a seed: every RNG derives from ``seed`` and torch runs single-threaded.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from controller.errors import ConfigError
from controller.features import FEATURIZER_VERSION, SPEC_STALENESS_STEPS, SUPPORTED_VERSIONS
from controller.protocol import DEFAULT_DEPTHS

MAX_DELAY = 8


def parse_delay(text: str) -> tuple[int, int]:
    """``--delay LO,HI`` (or one number) → the inclusive range of action delays to draw from."""
    try:
        parts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"--delay must be LO,HI or one step count, got {text!r}") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[-1])
    if len(parts) > 2 or not 1 <= lo <= hi <= MAX_DELAY:
        raise ConfigError(f"--delay must be LO,HI with 1 <= LO <= HI <= {MAX_DELAY}, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``controller train`` does; written next to the artefacts as JSON.

    Attributes:
        out: path of the policy zip; its folder receives sim.json, reports and tb/.
        traces: trace folder to fit (with ``profiles``), or None.
        profiles: latency profile CSVs for the fit.
        deployment: bundled deployment name instead of traces.
        sim: a fitted sim.json instead of traces.
        off_draft: with ``traces``, what the traced server's drafter did at depth 0 (its
            ``--spec-off-draft``: kv, keep or skip); None: the base deployment's (kv).
        depths: allowed depths.
        seed: the one seed everything derives from.
        timesteps: PPO environment steps after the warm start.
        n_envs: simulator copies stepped together (in-process).
        n_steps: PPO rollout length per env.
        batch_size: PPO minibatch.
        n_epochs: PPO epochs per rollout.
        learning_rate: PPO learning rate (linearly decayed to 0): 2e-5. At 1e-4 the fine-tuning
            moved the cloned actor away from what it had learned: on h200-llama8b every
            checkpoint scored below the warm start on the validation episodes (−271 to −273
            against −266.6); at 2e-5 they scored up to −260.8 (freezing the actor for the first
            28-57k steps instead gave −261.8 to −262.6).
        gamma: discount: 0.98, so a probe of the drafter (a few costly steps) is paid for by the
            tens of steps it makes better (0.9 erased the probe the warm start had learned).
        ent_coef: entropy bonus.
        clip_range: PPO clip.
        net_arch: hidden widths of policy and value MLPs.
        randomize: domain-randomization scale (× the fit's standard errors).
        drafter_mix: fraction of episodes with a drafter of random quality (acceptance
            ``alpha`` uniform over ``env.gym_env.DRAFTER_ALPHA_RANGE``): a policy must still
            stop drafting when the drafter is useless and draft deep when it is near perfect,
            whatever the traces it was fitted to showed.
        episode_steps: decode steps per episode.
        delay: overlap-scheduling action delay range (inclusive).
        featurizer_version: the observation's definition the policy is trained on and served
            with (``controller.features``).
        n_workloads: size of the per-episode workload pool drawn at start.
        bc_rounds: DAgger rounds of the warm start (0 = plain PPO from scratch).
        bc_states: states collected per round.
        bc_explore_first: the share of random actions in round 1 (the expert's rollout), which
            covers the states a decent policy's mistakes lead to.
        bc_explore_later: the share of random actions in later rounds (the network's own
            rollouts): 0. A random action drafts 4 times in 5 and so resets
            ``spec_staleness``: at 0.1 (before) the long stretches at depth 0 in which the
            expert probes the drafter were 0.2-0.4% of the cloned states, and the network never
            learned the probe (on ``llama8b/drafter-alt-c8`` it resumed drafting about 2 s
            after the drafter turned good, later than ``goodput-fit``).
        bc_expert: weight of the clairvoyant oracle in the cloning labels; the rest is the
            realistic expert, the fitted model's goodput on the observed acceptance (the
            ``model_features``): the oracle alone cannot teach looking for information it
            never lacks (e.g. drafting again after a stretch at depth 0), the realistic
            expert alone cannot teach anything better than ``goodput-fit``. Needs
            ``model_features`` when < 1.
        model_features: give the policy the fitted latency model as input features
            (``controller.ppo_policy.model_features``; the zip carries the table).
        bc_time_weighted: weigh cloned states by their share of request-time.
        bc_probe_staleness: the realistic expert's probe (:class:`ProbeRule`): draft at
            ``bc_probe_depth`` once ``spec_staleness`` reaches this (0.5: about 35 steps
            without drafting, postponed by ``bc_probe_cost_steps``; 0 = no probe), and keep
            drafting there while the estimate is rising (``accept_trend`` > 0) and within
            ``bc_probe_keep`` of depth 0's goodput.
        bc_probe_gate: the probe runs only where some drafting depth would beat depth 0 on the
            model's step times for a drafter accepting this fraction per position (0.8, a good
            drafter); 0 = everywhere. Where no drafter could pay (large batches and long
            contexts on the H200 fits) a probe only costs: 1.5-2.5% on the suite's open-loop
            waves once the network learned it.
        bc_probe_depth: the depth a probe drafts at.
        bc_probe_keep: goodput ratio (to depth 0) above which a rising probe continues.
        bc_probe_cost_steps: postpone the probe by this many steps × the share of depth 0's
            goodput a probe step gives up (the model's estimate; :meth:`ProbeRule.threshold`):
            400, so a probe where drafting costs little (small batches) comes early and one where
            it costs much (large batches) late; 0 = the fixed ``bc_probe_staleness``.
        bc_epochs: passes over the aggregated states per round.
        save_warm_start: also save the policy before PPO as ``warmstart.zip`` (ablation).
        reward: ``"regret"`` (module docstring) or ``"extra-tokens"`` (SpecDecode-v0's own:
            tokens over what no speculation would have emitted in the same time; ablation).
        objective: ``throughput`` or ``slo:TPOT_MS`` (:mod:`controller.objective`): what the
            ``objective`` reward counts (every token, or only the tokens of requests on their
            TPOT target; :class:`RegretReward`), stored in the zip for eval and serve.
        slo_credit: how the ``objective`` reward credits an SLO objective: ``"step"`` (a step
            counts for a request if its own time per token is on target) or ``"running"``
            (each request's running TPOT: :class:`SloCredit`).
        bc_slo_labels: under an SLO objective, the oracle's warm-start labels (with
            ``bc_expert`` > 0): ``"step"`` or ``"projected"`` (each request's TPOT projected to
            its end at the depth; :func:`projected_on_target_tokens`).
        select_every: PPO steps between validation scores (:class:`ValidationSelect`); the
            warm start is scored first and the final weights last; 0 saves the final weights
            unscored.
        select_episodes: validation episodes per score (the same ones each time).
        progress: show a progress bar.
    """

    out: Path = Path("ppo.zip")
    traces: Path | None = None
    profiles: tuple[Path, ...] = ()
    deployment: str | None = None
    sim: Path | None = None
    off_draft: str | None = None
    depths: tuple[int, ...] = DEFAULT_DEPTHS
    seed: int = 0
    timesteps: int = 150_000
    n_envs: int = 8
    n_steps: int = 512
    batch_size: int = 512
    n_epochs: int = 5
    learning_rate: float = 2e-5
    gamma: float = 0.98
    ent_coef: float = 0.0
    clip_range: float = 0.1
    net_arch: tuple[int, ...] = (64, 64)
    randomize: float = 1.0
    drafter_mix: float = 0.3
    episode_steps: int = 1024
    delay: tuple[int, int] = (1, 2)
    featurizer_version: int = FEATURIZER_VERSION
    n_workloads: int = 400
    bc_rounds: int = 3
    bc_states: int = 40_000
    bc_explore_first: float = 0.3
    bc_explore_later: float = 0.0
    bc_epochs: int = 20
    save_warm_start: bool = True
    reward: str = "objective"
    bc_time_weighted: bool = True
    model_features: bool = True
    bc_expert: float = 0.0
    bc_probe_staleness: float = 0.5
    bc_probe_depth: int = 2
    bc_probe_keep: float = 0.85
    bc_probe_cost_steps: float = 400.0
    bc_probe_gate: float = 0.8
    objective: str = "throughput"
    slo_credit: str = "step"
    bc_slo_labels: str = "step"
    select_every: int = 28_672  # 7 rollouts of 8 × 512 steps
    select_episodes: int = 16
    progress: bool = True

    @classmethod
    def from_args(cls, args: Any, depths: tuple[int, ...] | None) -> TrainConfig:
        cfg = cls(
            out=args.out,
            traces=args.traces,
            profiles=tuple(args.profile),
            deployment=args.deployment,
            sim=args.sim,
            seed=args.seed,
            progress=not args.no_progress,
        )
        if depths is not None:
            cfg = replace(cfg, depths=depths)
        for flag, name in (
            ("warm_start_rounds", "bc_rounds"),
            ("gamma", "gamma"),
            ("learning_rate", "learning_rate"),
            ("select_every", "select_every"),
            ("reward", "reward"),
            ("drafter_mix", "drafter_mix"),
            ("objective", "objective"),
            ("slo_credit", "slo_credit"),
            ("probe_staleness", "bc_probe_staleness"),
            ("probe_cost_steps", "bc_probe_cost_steps"),
            ("probe_gate", "bc_probe_gate"),
            ("off_draft", "off_draft"),
        ):
            value = getattr(args, flag, None)
            if value is not None:
                cfg = replace(cfg, **{name: value})
        if getattr(args, "delay", None) is not None:
            cfg = replace(cfg, delay=parse_delay(args.delay))
        if getattr(args, "featurizer_version", None) is not None:
            cfg = replace(cfg, featurizer_version=args.featurizer_version)
        if cfg.featurizer_version not in SUPPORTED_VERSIONS:
            raise ConfigError(
                f"--featurizer-version {cfg.featurizer_version}: this controller serves {list(SUPPORTED_VERSIONS)}"
            )
        if args.timesteps is not None:
            cfg = replace(cfg, timesteps=args.timesteps)
        if args.n_envs is not None:
            cfg = replace(cfg, n_envs=args.n_envs)
        if not 0.0 <= cfg.bc_probe_staleness < 1.0:
            raise ConfigError(f"--probe-staleness must be in [0, 1), got {cfg.bc_probe_staleness}")
        if not (math.isfinite(cfg.bc_probe_cost_steps) and cfg.bc_probe_cost_steps >= 0.0):
            raise ConfigError(f"--probe-cost-steps must be finite and ≥ 0, got {cfg.bc_probe_cost_steps}")
        if not 0.0 <= cfg.bc_probe_gate < 1.0:
            raise ConfigError(f"--probe-gate must be in [0, 1), got {cfg.bc_probe_gate}")
        if not (math.isfinite(cfg.learning_rate) and cfg.learning_rate > 0.0):
            raise ConfigError(f"--learning-rate must be finite and > 0, got {cfg.learning_rate}")
        if cfg.select_every < 0:
            raise ConfigError(f"--select-every must be >= 0 (0 = no selection), got {cfg.select_every}")
        if not 0.0 <= cfg.drafter_mix <= 1.0:
            raise ConfigError(f"--drafter-mix must be in [0, 1], got {cfg.drafter_mix}")
        if cfg.off_draft is not None and cfg.traces is None:
            raise ConfigError("--off-draft describes the traced server: it needs --traces")
        from controller.objective import parse_objective

        cfg = replace(cfg, objective=str(parse_objective(cfg.objective)))
        if cfg.objective != "throughput" and cfg.reward != "objective":
            raise ConfigError(f"--objective {cfg.objective} needs --reward objective, got --reward {cfg.reward}")
        if cfg.slo_credit not in SLO_CREDITS:
            raise ConfigError(f"--slo-credit must be one of {', '.join(SLO_CREDITS)}, got {cfg.slo_credit!r}")
        if not cfg.out.name.endswith(".zip"):
            raise ConfigError(f"--out must name a .zip file, got {str(cfg.out)!r}")
        return cfg

    def to_json(self) -> str:
        return json.dumps({k: _jsonable(v) for k, v in asdict(self).items()}, indent=1)


def _jsonable(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


@dataclass
class TrainResult:
    zip_path: Path
    report_path: Path
    timesteps: int
    wall_s: float
    history: list[dict[str, float]] = field(default_factory=list)


# --------------------------------------------------------------------------- simulator


def fitted_params(cfg: TrainConfig) -> tuple[Any, str]:
    """The simulator parameters to train in, and a line saying where they came from."""
    from env.params import SimParams

    if cfg.sim is not None:
        return SimParams.from_json(cfg.sim), f"sim.json {cfg.sim}"
    if cfg.deployment is not None:
        from env.deployments import load_deployment

        return load_deployment(cfg.deployment), f"bundled deployment {cfg.deployment}"
    if cfg.traces is None:
        raise ConfigError("give --traces, --deployment or --sim")
    try:
        from env.fit import fit_sim
    except ImportError as exc:
        raise ConfigError(f"fitting traces needs env.fit ({exc})") from None
    params, report = fit_sim(str(cfg.traces), [str(p) for p in cfg.profiles], off_draft=cfg.off_draft)
    out_dir = cfg.out.parent if str(cfg.out.parent) else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fit_report.txt").write_text(f"{report}\n")
    return params, f"fitted to {cfg.traces} + {len(cfg.profiles)} profile(s) (fit_report.txt)"


def capacity_req_s(params: Any, depths: tuple[int, ...]) -> float:
    """Requests/s the deployment sustains without speculation at full concurrency.

    Measured as output tokens/s at full concurrency over the workload's mean output length,
    not as completions in the window: with long outputs few requests finish in 20 s, and
    counting them would put every Poisson workload of the pool far below real load.
    """
    from controller.baselines import StaticPolicy
    from env.runner import simulate

    cap = max(1, params.engine.max_running_requests)
    res = simulate(
        params, f"closed:{cap}", StaticPolicy(depths[0], depths), depths=depths, seed=0, duration_s=20.0
    )
    wp = params.workload
    draws = wp.output_median_tokens * np.exp(wp.output_sigma * np.random.default_rng(0).standard_normal(4096))
    mean_out = float(np.clip(draws, wp.output_min_tokens, wp.output_max_tokens).mean())
    return res.throughput_tok_s / mean_out if res.tokens else 1.0


def workload_pool(rng: np.random.Generator, capacity: float, n: int, max_c: int = 250) -> list[str]:
    """``n`` workload specs covering the regimes the policy must handle (see module docstring).

    Besides steady closed and Poisson loads, ramps, bursts and chat↔code phases: waves from a
    trickle to overload and back, drafter-quality alternation (a drafter that accepts almost
    nothing ↔ a good one, on closed and open bases), and on 40% of specs request-level
    options: task mixes, long-document mixes (up to 32k-token prompts) and acceptance that
    falls with prompt length. Drawn at random, so the held-out suites' specs
    (``agents.suite``) are not in the pool.
    """
    out: list[str] = []

    def rate(lo: float, hi: float) -> float:
        return round(float(capacity * rng.uniform(lo, hi)), 3)

    def conc() -> int:
        return max(1, int(round(math.exp(rng.uniform(0.0, math.log(max_c))))))

    for _ in range(n):
        u = rng.random()
        if u < 0.25:
            spec = f"closed:{conc()}"
        elif u < 0.33:
            spec = f"poisson:{rate(0.05, 1.0)}"
        elif u < 0.39:
            r0, r1 = rate(0.05, 0.5), rate(0.5, 1.1)
            if rng.random() < 0.5:
                r0, r1 = r1, r0
            spec = f"ramp:{r0},{r1},{rng.uniform(10, 40):.1f}"
        elif u < 0.46:
            spec = f"burst:{rate(0.02, 0.3)},{rate(0.8, 1.6)},{rng.uniform(4, 20):.1f},{rng.uniform(0.1, 0.4):.2f}"
        elif u < 0.53:
            spec = f"phase:{rng.uniform(4, 30):.1f}:closed:{conc()}"
        elif u < 0.57:
            spec = f"phase:{rng.uniform(4, 30):.1f}:poisson:{rate(0.05, 0.9)}"
        elif u < 0.66:
            spec = f"wave:{rate(0.01, 0.2)},{rate(0.6, 1.5)},{rng.uniform(10, 60):.1f}"
        else:
            # A drafter whose quality alternates: from useless to good and back.
            lo = float(rng.uniform(-4.5, 0.5))
            hi = lo + float(rng.uniform(1.0, 6.0))
            if rng.random() < 0.6:
                base = f"closed:{conc()}"
            elif rng.random() < 0.5:
                base = f"wave:{rate(0.01, 0.2)},{rate(0.6, 1.5)},{rng.uniform(10, 60):.1f}"
            else:
                base = f"poisson:{rate(0.05, 1.2)}"
            spec = f"phase:{rng.uniform(6, 40):.1f}:{base}@accept_shift={lo:.2f},odd_shift={hi - lo:.2f}"
        if rng.random() < 0.4:
            opts = []
            if rng.random() < 0.5:
                opts.append(
                    f"mix=code:{rng.uniform(0, 0.4):.2f}+math:{rng.uniform(0, 0.3):.2f}"
                    f"+longdoc:{rng.uniform(0, 0.2):.2f}"
                )
            if rng.random() < 0.5:
                lo_p = int(math.exp(rng.uniform(math.log(2048), math.log(8192))))
                opts.append(f"long={rng.uniform(0.05, 0.5):.2f}:{lo_p}-{min(32768, lo_p * 4)}")
            elif rng.random() < 0.3:
                opts.append("prompt=100-32000")
            if opts:
                spec += (",", "@")["@" not in spec] + ",".join(opts)
        out.append(spec)
    return out


def _rates(engine: Any, depths: tuple[int, ...]) -> np.ndarray:
    """True expected tokens/s of the next step at every depth (the oracle's view)."""
    return np.array([engine.expected_rate(d) for d in depths], dtype=np.float64)


def _tokens_and_times(engine: Any, depths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """True expected tokens of the next step and its latency-model time (µs) at every depth."""
    from env.latency import step_time_us

    tokens = np.array([engine.expected_tokens(d) for d in depths], dtype=np.float64)
    lat = engine.params.latency
    times = np.array(
        [step_time_us(lat, engine.n, d, engine.ctx_sum, engine.prefill_pending, engine.pairs_pending) for d in depths],
        dtype=np.float64,
    )
    return tokens, times


def on_target_tokens(engine: Any, depths: tuple[int, ...], times_us: np.ndarray, tpot_ms: float) -> np.ndarray:
    """Per depth, the true expected tokens of the next step from the requests for which that
    step is on the TPOT target: time per token ``T_d / e_i(d) ≤ tpot_ms`` (``e_i``: request
    i's expected tokens at depth d). The per-step stand-in for a request-level target: a
    request every step of which is on target meets it."""
    budget_us = tpot_ms * 1000.0
    out = np.zeros(len(depths))
    for i, (d, t_us) in enumerate(zip(depths, times_us)):
        e = engine.expected_tokens_each(d)
        out[i] = float(e[t_us <= budget_us * e].sum())
    return out


def on_target_emitted(engine: Any, tpot_ms: float) -> float:
    """Tokens emitted so far by the running requests whose running TPOT is on target.

    A request's running TPOT is ``(now − first token) / (emitted − 1)``; it is on target iff
    ``now − t_first ≤ tpot_ms · (emitted − 1)`` (its slack, target time for the tokens after
    the first minus the time they took, is ≥ 0; a request with one token so far has no TPOT
    and is on target). At the step a request finishes, ``emitted`` is its output length and
    ``now`` its finish time, so the running TPOT is the request's final TPOT: the test is
    exactly :meth:`controller.objective.Objective.meets` on it. Ground truth (the simulator's
    per-request state): for the reward only, never an observation.
    """
    from env.engine import OUT, TFIRST

    n = int(engine.n)
    if n == 0:
        return 0.0
    emitted = engine.S[:n, OUT] - engine.rem[:n]
    elapsed_us = float(engine.now_us) - engine.S[:n, TFIRST]
    ok = (elapsed_us <= tpot_ms * 1000.0 * (emitted - 1.0)) | (emitted <= 1.0)
    return float(emitted[ok].sum())


class SloCredit:
    """The running-slack credit of goodput under a TPOT target (``slo_credit="running"``).

    The potential ``Φ = Σ tokens of the completed requests that met the target + Σ tokens
    emitted so far by the running requests whose running TPOT is on target``
    (:func:`on_target_emitted`), and a step's credit is ``ΔΦ`` over it. Why this form:

    - a running request on target earns its tokens as they come, so keeping it on target
      across a phase pays step by step;
    - the step that pushes its running TPOT over the target takes back every token it had
      earned (``ΔΦ`` includes ``−emitted``): the eventual loss of the whole request, charged
      where it happens rather than at its finish; a step that brings it back returns them;
    - at its finish the running test is the final one, so a completed request keeps its
      ``output_tokens`` iff it met the target and 0 otherwise.

    Summed over an episode the credit telescopes to ``Φ(end) − Φ(start)``: the output
    tokens of the requests completed in it that met the target (the numerator of the SLO
    goodput that ``controller eval`` scores, :func:`agents.evaluate.slo_goodput_tok_s`) plus the
    on-target tokens of the requests still running at the end (the boundary term, their
    projected contribution), minus those of the requests running at the start.
    """

    def __init__(self, tpot_ms: float) -> None:
        from controller.objective import Objective

        self.tpot_ms = tpot_ms
        self._objective = Objective(tpot_ms)  # its `meets` is the eval's test of a finished request
        self._phi = 0.0
        self._done_i = 0
        self._met = 0.0

    def reset(self, engine: Any) -> None:
        """Start counting from the engine's current state (Φ here is the zero)."""
        self._done_i = len(engine.completed)
        self._met = 0.0
        self._phi = on_target_emitted(engine, self.tpot_ms)

    def step(self, engine: Any) -> float:
        """The credit of the step(s) the engine ran since the last call: ``ΔΦ`` in tokens."""
        done = engine.completed
        for r in done[self._done_i :]:
            if self._objective.meets(r.tpot_ms):
                self._met += r.output_tokens
        self._done_i = len(done)
        phi = self._met + on_target_emitted(engine, self.tpot_ms)
        credit = phi - self._phi
        self._phi = phi
        return credit


def projected_on_target_tokens(
    engine: Any, depths: tuple[int, ...], times_us: np.ndarray, tpot_ms: float
) -> np.ndarray:
    """Per depth d, the true expected tokens of the next step from the requests whose TPOT
    would end on target if every step left ran at d: projected finish ``now + rem_i ·
    T_d / e_i(d)``, projected TPOT ``(finish − t_first) / (output − 1) ≤ tpot_ms``. Unlike
    :func:`on_target_tokens` a request's past slack counts, and a depth that is slow per step
    but keeps a request on target over its life does too. Ground truth (true output lengths
    and acceptance): for the warm start's oracle labels only, never an observation."""
    from env.engine import OUT, TFIRST

    out = np.zeros(len(depths))
    n = int(engine.n)
    if n == 0:
        return out
    total = engine.S[:n, OUT]
    rem = engine.rem[:n].astype(np.float64)
    t_first = np.where(engine.S[:n, TFIRST] >= 0, engine.S[:n, TFIRST], float(engine.now_us))
    for i, (d, t_us) in enumerate(zip(depths, times_us)):
        e = engine.expected_tokens_each(d)
        finish = float(engine.now_us) + rem * t_us / np.maximum(e, 1e-9)
        ok = (finish - t_first <= tpot_ms * 1000.0 * (total - 1.0)) | (total <= 1.0)
        out[i] = float(e[ok].sum())
    return out


REWARDS = ("objective", "regret", "extra-tokens")
SLO_CREDITS = ("step", "running")
SLO_LABELS = ("step", "projected")


class RegretReward(gym.Wrapper):
    """The training reward (see the module docstring); ``info["rates"]`` holds the true
    expected tokens/s per depth at the decision, ``info["weight"]`` the step's share of
    request-time relative to the episode's recent steps (for time-weighted cloning).

    Rewards:

    - ``objective`` (default): the user's objective over time — tokens per request-second —
      as a Dinkelbach reward ``(E_d − ρ̄·bs·T_d) / (ρ̄·W̄)``: expected tokens of the chosen
      depth minus what the request-time it costs (``bs·T_d``) is worth at a slowly moving
      reference rate ``ρ̄`` (an EMA, over about 256 steps, of the best achievable per-request
      rate), in units of a typical step (``W̄``, an EMA of request-time per step). Summed over
      an episode it is tokens − ρ̄ × request-seconds, so a step weighs by the time it takes
      for the requests it holds, and a decision that makes later states better or worse
      (stale drafter, batches that drain faster or grow, queues) is paid for later: trained
      with γ > 0. Closed loop: maximises throughput; open loop (arrivals fixed): minimises
      request-seconds, i.e. token-weighted TPOT.

      With ``objective="slo:TPOT_MS"`` the same form counts only on-target tokens
      (:func:`on_target_tokens`: tokens of the requests whose time per token in this step is
      within the target), and ``ρ̄`` tracks the best on-target rate (floored at 5% of the best
      throughput rate, so a target no depth meets prices time rather than dividing by zero).
      Summed over an episode: on-target tokens − ρ̄ × request-seconds, the Dinkelbach form of
      goodput under the SLO. ``info["rates"]`` are then on-target rates too.

      With ``slo_credit="running"`` the tokens are instead the realised :class:`SloCredit`
      of the step that ran (``ΔΦ``: tokens earned by requests whose running TPOT stays on
      target, minus every token earned so far by a request the step pushed over it) and the
      request-time its realised duration (``bs·busy``): summed over an episode, the tokens of
      the requests that met the target (plus the on-target tokens of those still running) −
      ρ̄ × request-seconds, the Dinkelbach form of the SLO goodput eval scores rather than of
      its per-step stand-in. Its reference rate is the policy's own recent goodput per
      request-second (:meth:`_running_step` says why); ``W̄`` and ``info["rates"]`` (the
      oracle's share of the warm start's labels, ``bc_expert``) stay the stand-in's: the warm
      start does not see the objective's running slack.
    - ``regret``: ``rate_d / max_k rate_k`` at the decision, immediate (γ = 0; the earlier
      method).
    - ``extra-tokens``: SpecDecode-v0's own reward (an ablation).

    Args:
        env: a ``SpecDecode-v0`` environment (its engine gives the true values).
        reward: one of :data:`REWARDS`.
        use_env_reward: deprecated spelling of ``reward="extra-tokens"``.
        objective: ``throughput`` or ``slo:TPOT_MS`` (:mod:`controller.objective`).
        slo_credit: under an SLO objective, ``"step"`` (the per-step stand-in) or
            ``"running"`` (:class:`SloCredit`); ignored for throughput.
        slo_labels: under an SLO objective, what ``info["rates"]`` (the oracle's labels for
            the warm start, ``bc_expert``) count: ``"step"`` (:func:`on_target_tokens`) or
            ``"projected"`` (:func:`projected_on_target_tokens`); the reward is unchanged.
    """

    RHO_ALPHA = 1.0 / 256.0
    W_ALPHA = 1.0 / 64.0

    RHO_FLOOR = 0.05
    RHO_PRIOR_STEPS = 16

    def __init__(
        self,
        env: gym.Env,
        use_env_reward: bool = False,
        reward: str = "regret",
        objective: str = "throughput",
        slo_credit: str = "step",
        slo_labels: str = "step",
    ) -> None:
        super().__init__(env)
        from controller.objective import parse_objective

        self.reward_kind = "extra-tokens" if use_env_reward else reward
        if self.reward_kind not in REWARDS:
            raise ConfigError(f"reward must be one of {', '.join(REWARDS)}, got {reward!r}")
        self.objective = parse_objective(objective)
        if slo_credit not in SLO_CREDITS:
            raise ConfigError(f"slo_credit must be one of {', '.join(SLO_CREDITS)}, got {slo_credit!r}")
        if slo_labels not in SLO_LABELS:
            raise ConfigError(f"slo_labels must be one of {', '.join(SLO_LABELS)}, got {slo_labels!r}")
        self._projected = self.objective.tpot_ms is not None and slo_labels == "projected"
        self._credit: SloCredit | None = None
        if self.objective.tpot_ms is not None and slo_credit == "running":
            self._credit = SloCredit(self.objective.tpot_ms)
        sim: Any = env.unwrapped
        self._sim = sim
        self.depths: tuple[int, ...] = tuple(sim.depths)
        self._rates = np.ones(len(self.depths))
        self._tokens = np.ones(len(self.depths))
        self._times = np.ones(len(self.depths))
        self._n = 0
        self._rho = 0.0
        self._w = 0.0
        self._floor = 0.0
        self._credit_ema = 0.0  # slo_credit="running": EMAs of ΔΦ and of request-seconds
        self._cost_ema = 0.0
        self._credit_k = 0

    def _observe(self, info: dict[str, Any]) -> None:
        eng = self._sim.engine
        self._tokens, self._times = _tokens_and_times(eng, self.depths)
        self._n = n = int(eng.n)
        inv_s = np.where(self._times > 0, 1e6 / np.maximum(self._times, 1e-9), 0.0)
        self._floor = 0.0
        if self.objective.tpot_ms is not None:
            self._floor = self.RHO_FLOOR * float((self._tokens * inv_s).max()) / max(n, 1)
            self._tokens = on_target_tokens(eng, self.depths, self._times, self.objective.tpot_ms)
        self._rates = self._tokens * inv_s
        info["rates"] = self._rates
        if self._projected and self.objective.tpot_ms is not None:
            proj = projected_on_target_tokens(eng, self.depths, self._times, self.objective.tpot_ms)
            info["rates"] = proj * inv_s
        best = int(np.argmax(self._rates))
        req_time = n * self._times[best]
        if n > 0 and self._w <= 0.0:
            self._w = req_time
            self._rho = max(self._rates[best] / n, self._floor)
        info["weight"] = req_time / self._w if self._w > 0 else 0.0

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        self._rho = self._w = 0.0
        self._credit_ema = self._cost_ema = 0.0
        self._credit_k = 0
        if self._credit is not None:
            self._credit.reset(self._sim.engine)
        self._observe(info)
        return obs, info

    def step(self, action: Any):
        a = int(action)
        rates, n = self._rates, self._n
        best = rates.max()
        if self._credit is not None and self.reward_kind == "objective":
            return self._running_step(action, rates, n)
        if self.reward_kind == "objective":
            if n > 0 and self._w > 0:
                cost = n * self._times[a] * 1e-6  # request-seconds
                rho = max(self._rho, self._floor)
                reward = float((self._tokens[a] - rho * cost) / (rho * self._w * 1e-6))
                self._rho += self.RHO_ALPHA * (best / n - self._rho)
                self._w += self.W_ALPHA * (n * self._times[int(np.argmax(rates))] - self._w)
            else:
                reward = 0.0
        else:
            reward = float(rates[a] / best) if best > 0 else 1.0
        obs, env_reward, terminated, truncated, info = self.env.step(action)
        if self.reward_kind == "extra-tokens":
            reward = float(env_reward)
        self._observe(info)
        return obs, reward, terminated, truncated, info

    def _running_step(self, action: Any, rates: np.ndarray, n: int):
        """The ``slo_credit="running"`` objective reward: realised ``(ΔΦ − ρ·bs·busy) / (ρ·W̄)``.

        ``ρ`` here is the policy's own recent goodput per request-second (a running mean, then
        an EMA over about 256 steps, of credit over request-seconds, starting from the
        stand-in's ``ρ̄`` weighed as 16 steps; floored as ``ρ̄`` is): the Dinkelbach iteration's ``ρ_{k+1} = G(π_k)/T(π_k)``.
        Not the stand-in's best on-target rate, which counts a step for every request whose
        own step is fast and so can sit far above any goodput reachable over a request's
        life (8× on h200-llama8b at C=64 under 10 ms): a ``ρ`` above every policy's ratio
        makes ``Σ(ΔΦ − ρ·cost)`` favour whatever spends the least time per step, not the most
        goodput per time."""
        assert self._credit is not None
        obs, _, terminated, truncated, info = self.env.step(action)
        eng = self._sim.engine
        credit = self._credit.step(eng)
        reward = 0.0
        if self._w > 0:
            cost = int(info["step"].bs) * float(eng.last_busy_us) * 1e-6  # request-seconds
            if self._cost_ema <= 0.0:
                self._cost_ema = self._w * 1e-6
                self._credit_ema = max(self._rho, self._floor) * self._cost_ema
            rho = max(self._credit_ema / self._cost_ema, self._floor)
            reward = float((credit - rho * cost) / (rho * self._w * 1e-6))
            # A running mean over the first steps (the stand-in's ρ̄ weighs as 16 of them),
            # then an EMA: the stand-in can be far off, and episodes are 1024 steps.
            self._credit_k += 1
            alpha = max(self.RHO_ALPHA, 1.0 / (self._credit_k + self.RHO_PRIOR_STEPS))
            self._credit_ema += alpha * (credit - self._credit_ema)
            self._cost_ema += alpha * (cost - self._cost_ema)
            if n > 0:
                self._w += self.W_ALPHA * (n * self._times[int(np.argmax(rates))] - self._w)
        self._observe(info)
        return obs, reward, terminated, truncated, info


def fit_model_table(params: Any, depths: tuple[int, ...]) -> np.ndarray:
    """The fitted latency model as the table a policy carries (``PPOMeta.model_table``):
    log(step time at each depth / at depth 0) over the observation's ``bs`` × ``ctx_per_req``
    grids, through ``env.latency.step_time_us`` (whatever terms the model has)."""
    from controller.features import decode_bs, decode_ctx
    from controller.ppo_policy import MODEL_BS_GRID, MODEL_CTX_GRID
    from env.latency import step_time_us

    lat = params.latency
    out = np.zeros((len(depths), len(MODEL_BS_GRID), len(MODEL_CTX_GRID)))
    for j, xb in enumerate(MODEL_BS_GRID):
        bs = max(1, int(round(decode_bs(xb))))
        for c, xc in enumerate(MODEL_CTX_GRID):
            ctx = bs * decode_ctx(xc)
            t0 = step_time_us(lat, bs, depths[0], ctx)
            for i, d in enumerate(depths):
                out[i, j, c] = math.log(step_time_us(lat, bs, d, ctx) / t0)
    return out


class ModelFeatures(gym.ObservationWrapper):
    """Appends the fitted model's features (``controller.ppo_policy.model_features``) to each
    observation: what the served policy computes from the same observation and its table."""

    def __init__(self, env: gym.Env, table: np.ndarray) -> None:
        super().__init__(env)
        from controller.ppo_policy import model_features, model_inputs

        sim: Any = env.unwrapped
        self._table = np.ascontiguousarray(table, dtype=np.float64)
        self._inputs = model_inputs(sim.depths)
        self._features = model_features
        box = env.observation_space
        n = box.shape[0] + 2 * len(sim.depths)  # type: ignore[index]
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (n,), np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return self._features(observation, self._table, self._inputs)  # type: ignore[no-any-return]


def make_env(params: Any, workloads: list[str], cfg: TrainConfig, table: np.ndarray | None = None):
    """One training environment: SpecDecode-v0 on ``params`` with the training reward (and
    the fitted model's features when ``table`` is given)."""
    from env.gym_env import SpecDecodeEnv

    env = SpecDecodeEnv(
        deployment=params,
        workload=workloads,
        depths=cfg.depths,
        action_delay=cfg.delay,
        randomize=cfg.randomize,
        drafter_mix=cfg.drafter_mix,
        episode_steps=cfg.episode_steps,
        featurizer_version=cfg.featurizer_version,
    )
    wrapped: gym.Env = ModelFeatures(env, table) if table is not None else env
    return RegretReward(
        wrapped, reward=cfg.reward, objective=cfg.objective, slo_credit=cfg.slo_credit, slo_labels=cfg.bc_slo_labels
    )


# --------------------------------------------------------------------------- warm start


def _estimated_rel(obs: np.ndarray, n_act: int) -> np.ndarray:
    """The realistic expert's relative rates: exp(goodput_k − max) from the model features
    (the last ``n_act`` entries of an observation with model features)."""
    g = obs[-n_act:].astype(np.float64)
    return np.exp(g - g.max())


@dataclass(frozen=True)
class ProbeRule:
    """The realistic expert's exploration, a rule on the observation alone (so the MLP can
    learn it): at depth 0 the acceptance estimate returns to its prior, and where drafting
    pays only for a good drafter (the ``seed`` deployment: depth 1 costs 1.9× a plain step)
    the argmax of the model's goodput never drafts again, and never sees the drafter turn
    good. So once ``spec_staleness`` reaches ``staleness`` the expert drafts at ``action``;
    one step moves the estimate too little to switch (a weak prior of 2 request-positions),
    so while the last step ran at that depth, the accepted fraction is rising and the
    estimated goodput there is within ``keep`` of depth 0's, it drafts again. A drafter that
    stays bad ends the probe within a few steps (the trend turns down). It probes only where
    some drafting depth d would pay for a good drafter: where the model's log(step time at d /
    at 0) is below ``gate_logs[d]``, the log of the tokens a step at d emits when each position
    is accepted with probability ``bc_probe_gate`` (empty: everywhere)."""

    stale_idx: int
    trend_idx: int
    onehot_idx: int
    action: int
    staleness: float
    keep: float
    cost_steps: float = 0.0
    gate_logs: tuple[float, ...] = ()

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> ProbeRule | None:
        if cfg.bc_probe_staleness <= 0:
            return None
        from controller.features import Featurizer

        if cfg.bc_probe_depth not in cfg.depths[1:]:
            raise ConfigError(f"bc_probe_depth {cfg.bc_probe_depth} is not a drafting depth of {list(cfg.depths)}")
        names = Featurizer(cfg.depths, cfg.featurizer_version).feature_names
        return cls(
            names.index("spec_staleness"),
            names.index("accept_trend"),
            names.index(f"depth={cfg.bc_probe_depth}"),
            cfg.depths.index(cfg.bc_probe_depth),
            cfg.bc_probe_staleness,
            cfg.bc_probe_keep,
            cfg.bc_probe_cost_steps,
            tuple(math.log(sum(cfg.bc_probe_gate**i for i in range(d + 1))) for d in cfg.depths)
            if cfg.bc_probe_gate > 0
            else (),
        )

    def threshold(self, rel: np.ndarray) -> float:
        """The staleness at which the expert probes: ``staleness``, postponed by
        ``cost_steps`` × the share of depth 0's goodput a probe step gives up (on the model's
        estimate), so a probe costs about as much wherever it runs."""
        if self.cost_steps <= 0:
            return self.staleness
        loss = min(max(1.0 - float(rel[self.action]) / max(float(rel[0]), 1e-12), 0.0), 1.0)
        steps = -SPEC_STALENESS_STEPS * math.log(1.0 - self.staleness) + self.cost_steps * loss
        return 1.0 - math.exp(-steps / SPEC_STALENESS_STEPS)

    def probes(self, obs: np.ndarray, rel: np.ndarray) -> bool:
        """Whether the expert probes in this state (``rel``: its relative goodput per depth;
        ``obs`` with the model features, whose log step-time ratios are its ``2n``-th to
        ``n``-th last entries, as :func:`_estimated_rel` reads the goodputs after them)."""
        if int(np.argmax(rel)) != 0:
            return False
        if self.gate_logs:
            n = len(rel)
            lat = obs[-2 * n : -n]
            if not any(self.gate_logs[k] > lat[k] for k in range(1, n)):
                return False
        if obs[self.stale_idx] >= self.threshold(rel):
            return True
        return bool(obs[self.onehot_idx] > 0.5 and obs[self.trend_idx] > 0 and rel[self.action] >= self.keep * rel[0])

    def labels(self, obs: np.ndarray, rel: np.ndarray) -> np.ndarray:
        """``rel`` with the probe depth made the clear best where the expert probes."""
        if not self.probes(obs, rel):
            return rel
        out = rel * 0.97
        out[self.action] = 1.0
        return out


def _expert_rel(obs: np.ndarray, n_act: int, probe: ProbeRule | None) -> np.ndarray:
    """The realistic expert's relative rates: the model's goodput, with its probe."""
    rel = _estimated_rel(obs, n_act)
    return rel if probe is None else probe.labels(obs, rel)


def _collect(
    envs: list[Any], n_states: int, act_fn, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Roll out ``act_fn(obs, rates) -> action`` over the envs; return (obs, rates, weight)
    triples (weight: the state's share of request-time, ``info["weight"]``)."""
    obs_l, rate_l, w_l = [], [], []
    state = [e.reset(seed=int(rng.integers(2**31))) for e in envs]
    per_env = math.ceil(n_states / len(envs))
    for i, env in enumerate(envs):
        obs, info = state[i]
        for _ in range(per_env):
            rates = info["rates"]
            if rates.max() > 0:
                obs_l.append(obs)
                rate_l.append(rates / rates.max())
                w_l.append(info.get("weight", 1.0))
            obs, _, term, trunc, info = env.step(act_fn(obs, rates))
            if term or trunc:
                obs, info = env.reset(seed=int(rng.integers(2**31)))
    return (
        np.asarray(obs_l, dtype=np.float32),
        np.asarray(rate_l, dtype=np.float32),
        np.asarray(w_l, dtype=np.float32),
    )


def _fit_actor(
    model: Any,
    obs: np.ndarray,
    rel: np.ndarray,
    epochs: int,
    rng: np.random.Generator,
    tau: float = 0.005,
    weight: np.ndarray | None = None,
    value_scale: float = 1.0,
) -> float:
    """Fit the actor to soft labels softmax(rel / tau) by cross-entropy; returns the mean regret
    of the greedy action on the states.

    Why not minimise expected regret Σ_k π(k|s)(1 − rel_k) directly: its gradient vanishes as
    the softmax saturates, and it does — on the majority depth — within an epoch. Soft labels
    keep the cost-sensitivity (a depth 1% worse gets e^-2 of the best one's mass at tau=0.005)
    with cross-entropy's non-vanishing gradient.

    ``weight``: per state, its share of request-time (a long step of a big batch weighs more
    in tokens per request-second than a short one), clipped to [0.05, 20] and normalised to
    mean 1; None weighs states alike."""
    import torch

    policy = model.policy
    # The critic learns the labels' expected reward too, so PPO's first advantages are not noise.
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    x = torch.as_tensor(obs)
    regret = torch.as_tensor(1.0 - rel)
    target = torch.softmax(torch.as_tensor(rel) / tau, dim=1)
    value = (target * torch.as_tensor(rel)).sum(1, keepdim=True) * value_scale
    n = len(x)
    w = np.ones(n, dtype=np.float32) if weight is None else np.clip(weight, 0.05, 20.0).astype(np.float32)
    wt = torch.as_tensor(w / w.mean())
    bs = 1024
    for _ in range(epochs):
        perm = torch.as_tensor(rng.permutation(n))
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            logp = torch.log_softmax(policy.get_distribution(x[idx]).distribution.logits, dim=1)
            loss = -(wt[idx] * (target[idx] * logp).sum(1)).mean()
            loss = loss + torch.nn.functional.mse_loss(policy.predict_values(x[idx]), value[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        greedy = policy.get_distribution(x).distribution.probs.argmax(1)
        return float(regret[torch.arange(n), greedy].mean())


def _serving_actor(model: Any):
    """The model's current actor as the MLP that serving evaluates (the same forward pass)."""
    from controller.ppo_policy import MLP, policy_net_layers

    return MLP(policy_net_layers(model.policy.state_dict()), "tanh")


def warm_start(
    model: Any, envs: list[Any], cfg: TrainConfig, rng: np.random.Generator, log
) -> list[dict[str, float]]:
    """DAgger rounds of regret-weighted cloning of the oracle into ``model``'s actor."""
    n_act = len(cfg.depths)
    probe = ProbeRule.for_config(cfg)
    history: list[dict[str, float]] = []
    obs_all: list[np.ndarray] = []
    rel_all: list[np.ndarray] = []
    w_all: list[np.ndarray] = []
    for r in range(cfg.bc_rounds):
        # Round 1: the expert with bc_explore_first random actions, covering the states a decent
        # policy visits and the ones its mistakes lead to (queues after deep steps). Later
        # rounds: the current network as it will be served (DAgger), bc_explore_later random.
        mlp = _serving_actor(model) if r > 0 else None  # ~30× faster than a torch forward per step
        explore = cfg.bc_explore_first if r == 0 else cfg.bc_explore_later

        def act(obs: np.ndarray, rates: np.ndarray, mlp: Any = mlp, explore: float = explore) -> int:
            if explore > 0.0 and rng.random() < explore:
                return int(rng.integers(n_act))
            if mlp is None:
                if cfg.bc_expert < 1.0 and rng.random() >= cfg.bc_expert:
                    return int(np.argmax(_expert_rel(obs, n_act, probe)))
                return int(np.argmax(rates))
            return int(mlp.act(obs))

        t0 = time.perf_counter()
        obs, rel, w = _collect(envs, cfg.bc_states, act, rng)
        if cfg.bc_expert < 1.0:
            if not cfg.model_features:
                raise ConfigError("bc_expert < 1 needs model_features (the realistic expert reads them)")
            est = np.stack([_expert_rel(o, n_act, probe) for o in obs]).astype(np.float32)
            rel = cfg.bc_expert * rel + (1.0 - cfg.bc_expert) * est
        obs_all.append(obs)
        rel_all.append(rel)
        w_all.append(w)
        regret = _fit_actor(
            model,
            np.concatenate(obs_all),
            np.concatenate(rel_all),
            cfg.bc_epochs,
            rng,
            weight=np.concatenate(w_all) if cfg.bc_time_weighted else None,
            # The critic starts where the reward starts: the regret reward's expected value
            # is the labels' oracle fraction; the objective reward is centred near 0.
            value_scale=1.0 if cfg.reward == "regret" else 0.0,
        )
        history.append({"round": r, "states": float(sum(len(o) for o in obs_all)), "greedy_regret": regret})
        log(
            f"warm start round {r + 1}/{cfg.bc_rounds}: {len(obs)} states, greedy regret {regret:.4f} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    return history


# --------------------------------------------------------------------------- selection


def validation_select(env: Any, episodes: int, every_calls: int, seed: int) -> Any:
    """SB3's ``EvalCallback`` as the training's model selection: a ``ValidationSelect``.

    It scores the deterministic policy's mean episode return on ``episodes`` validation episodes
    of ``env`` (a VecEnv), reseeded with ``seed`` before every score so that each checkpoint
    meets the same episodes (common random numbers: a difference between two scores is the
    policies', not the draw's). It scores at the start of training (the warm start), every
    ``every_calls`` callback calls (vector steps), and at the end, and keeps the best scoring
    weights in memory (``best_state``; a checkpoint must beat the best so far strictly).
    ``scores`` lists ``(timesteps, mean return)``.

    Nothing is written or loaded from disk: the weights restored are a ``state_dict`` copy.
    """
    import copy

    from stable_baselines3.common.callbacks import EvalCallback

    class ValidationSelect(EvalCallback):
        def __init__(self) -> None:
            super().__init__(env, n_eval_episodes=episodes, eval_freq=every_calls, verbose=0, warn=False)
            self.scores: list[tuple[int, float]] = []
            self.best_state: dict[str, Any] | None = None
            self.best_timesteps = -1

        def _on_step(self) -> bool:
            if self.eval_freq <= 0 or self.n_calls % self.eval_freq:
                return True
            self.eval_env.seed(seed)  # applied at evaluate_policy's reset
            before = self.best_mean_reward
            keep_going = bool(super()._on_step())
            self.scores.append((self.num_timesteps, self.last_mean_reward))
            if self.best_mean_reward > before:
                self.best_state = copy.deepcopy(self.model.policy.state_dict())
                self.best_timesteps = self.num_timesteps
            return keep_going

        def _on_training_start(self) -> None:
            super()._on_training_start()
            self._on_step()  # n_calls is 0: the warm start's score

        def _on_training_end(self) -> None:
            if not self.scores or self.scores[-1][0] != self.num_timesteps:
                every, self.eval_freq = self.eval_freq, 1  # the final weights' score, whenever it falls
                self._on_step()
                self.eval_freq = every

    return ValidationSelect()


# --------------------------------------------------------------------------- train


def train(cfg: TrainConfig, log=print) -> TrainResult:
    """Run the whole pipeline (module docstring) and write its outputs."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.vec_env import DummyVecEnv

    from controller.ppo_policy import meta_for, write_metadata

    t_start = time.perf_counter()
    torch.set_num_threads(1)  # determinism, and a fair share of a shared 2-core machine
    torch.manual_seed(cfg.seed)
    out_dir = cfg.out.parent if str(cfg.out.parent) else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    params, source = fitted_params(cfg)
    params.to_json(out_dir / "sim.json")
    (out_dir / "train_config.json").write_text(cfg.to_json() + "\n")
    rng = np.random.default_rng(cfg.seed)
    capacity = capacity_req_s(params, cfg.depths)
    workloads = workload_pool(rng, capacity, cfg.n_workloads)
    log(f"simulator: {source}; capacity ≈ {capacity:.2f} req/s; {len(workloads)} workloads")

    table = fit_model_table(params, cfg.depths) if cfg.model_features else None

    def factory(i: int):
        return lambda: make_env(params, workloads, cfg, table)

    vec = DummyVecEnv([factory(i) for i in range(cfg.n_envs)])
    model = PPO(
        "MlpPolicy",
        vec,
        n_steps=cfg.n_steps,
        batch_size=cfg.batch_size,
        n_epochs=cfg.n_epochs,
        learning_rate=lambda progress: cfg.learning_rate * progress,
        gamma=cfg.gamma,
        gae_lambda=0.0 if cfg.gamma == 0.0 else 0.95,
        ent_coef=cfg.ent_coef,
        clip_range=cfg.clip_range,
        policy_kwargs={"net_arch": list(cfg.net_arch), "activation_fn": torch.nn.Tanh},
        tensorboard_log=str(out_dir / "tb"),
        seed=cfg.seed,
        device="cpu",
        verbose=0,
    )
    history: list[dict[str, float]] = []
    bc_history: list[dict[str, float]] = []
    extra = {
        "seed": cfg.seed,
        "timesteps": cfg.timesteps,
        "sim": params.name,
        "source": source,
        "reward": cfg.reward,
        "objective": cfg.objective,
        "slo_credit": cfg.slo_credit,
        "warm_start_rounds": cfg.bc_rounds,
    }
    meta = meta_for(
        cfg.depths, cfg.net_arch, "tanh", 1, extra, model_table=table, objective=cfg.objective,
        featurizer_version=cfg.featurizer_version,
    )  # fmt: skip
    if cfg.bc_rounds > 0:
        bc_envs = [make_env(params, workloads, cfg, table) for _ in range(4)]
        bc_history = warm_start(model, bc_envs, cfg, rng, log)
        if cfg.save_warm_start and cfg.timesteps > 0:
            # The policy before PPO, kept for the ablation in the eval report.
            ws = cfg.out.with_name("warmstart.zip")
            model.save(ws)
            write_metadata(ws, replace(meta, extra={**extra, "timesteps": 0}))
    t_bc = time.perf_counter() - t_start

    class Track(BaseCallback):
        """Mean reward (fraction of the oracle's expected rate) per rollout, for the report."""

        def _on_rollout_end(self) -> None:
            rewards = self.model.rollout_buffer.rewards  # type: ignore[attr-defined]
            history.append({"timesteps": float(self.num_timesteps), "mean_reward": float(np.mean(rewards))})
            self.logger.record("charts/oracle_fraction", float(np.mean(rewards)))

        def _on_step(self) -> bool:
            return True

    select = None
    if cfg.timesteps > 0:
        callbacks: list[BaseCallback] = [Track()]
        if cfg.select_every > 0:
            # Validation episodes of the training distribution under their own seed.
            val = DummyVecEnv([factory(i) for i in range(4)])
            select = validation_select(val, cfg.select_episodes, max(1, cfg.select_every // cfg.n_envs), cfg.seed + 7919)
            callbacks.append(select)
        model.learn(
            total_timesteps=cfg.timesteps, callback=CallbackList(callbacks), progress_bar=cfg.progress,
            tb_log_name="ppo",
        )  # fmt: skip
    if select is not None and select.best_state is not None:
        model.policy.load_state_dict(select.best_state)
        meta = replace(meta, extra={**extra, "selected_timesteps": select.best_timesteps})
        log(f"validation: kept the weights of step {select.best_timesteps} of {cfg.timesteps}")
    wall = time.perf_counter() - t_start
    model.save(cfg.out)
    write_metadata(cfg.out, meta)
    report = out_dir / "train_report.md"
    scores = select.scores if select is not None else []
    report.write_text(_report(cfg, source, capacity, bc_history, history, t_bc, wall, scores))
    return TrainResult(cfg.out, report, cfg.timesteps, wall, history)


def _report(
    cfg: TrainConfig,
    source: str,
    capacity: float,
    bc: list[dict[str, float]],
    hist: list[dict[str, float]],
    t_bc: float,
    wall: float,
    scores: list[tuple[int, float]] | None = None,
) -> str:
    lines = [
        f"# Training report: {cfg.out.name}",
        "",
        f"- simulator: {source} (written as sim.json); capacity ≈ {capacity:.2f} req/s",
        f"- depths {list(cfg.depths)}; seed {cfg.seed}; net {list(cfg.net_arch)} tanh",
        f"- domain randomization ×{cfg.randomize} of the fit's standard errors; drafter of random quality in "
        f"{cfg.drafter_mix:.0%} of episodes; {cfg.n_workloads} workloads; "
        f"action delay {cfg.delay[0]}–{cfg.delay[1]} steps",
        f"- objective: {cfg.objective}" + (f" (SLO credit: {cfg.slo_credit})" if cfg.objective != "throughput" else ""),
        f"- wall time {wall:.0f} s (warm start {t_bc:.0f} s, PPO {wall - t_bc:.0f} s for {cfg.timesteps} steps)",
        "",
        {
            "objective": "Reward: tokens per request-second over time (Dinkelbach form against a slowly moving "
            f"reference rate; γ = {cfg.gamma}); cloned expert: oracle weight {cfg.bc_expert} (the rest: the fitted "
            "model's goodput on the observed acceptance); greedy regret is against those labels.",
            "regret": "Reward: expected tokens/s of the chosen depth ÷ the best depth's, for the batch at decision "
            "time (1.0 = the clairvoyant oracle's choice).",
            "extra-tokens": "Reward: SpecDecode-v0's extra tokens over no speculation in the same time (/32).",
        }[cfg.reward],
        "",
    ]
    if bc:
        lines += [
            "## Warm start (regret-weighted cloning of the oracle, DAgger)",
            "",
            "| round | states | greedy regret |",
            "|---|---|---|",
        ]
        lines += [f"| {int(h['round']) + 1} | {int(h['states'])} | {h['greedy_regret']:.4f} |" for h in bc]
        lines.append("")
    if hist:
        lines += ["## PPO", "", "| timesteps | mean reward (stochastic policy) |", "|---|---|"]
        step = max(1, len(hist) // 12)
        for h in hist[::step] + ([hist[-1]] if (len(hist) - 1) % step else []):
            lines.append(f"| {int(h['timesteps'])} | {h['mean_reward']:.4f} |")
        lines.append("")
    if scores:
        best = max(range(len(scores)), key=lambda i: (scores[i][1], -i))  # the first of equals: strictly better wins
        lines += [
            f"## Selection ({cfg.select_episodes} validation episodes, the same each time; deterministic policy)",
            "",
            "| timesteps | mean return | kept |",
            "|---|---|---|",
        ]
        for i, (t, r) in enumerate(scores):
            lines.append(f"| {t}{' (before PPO)' if i == 0 else ''} | {r:.2f} | {'**yes**' if i == best else ''} |")
        lines.append("")
    lines += ["Resolved config: train_config.json. TensorBoard: `tensorboard --logdir tb`.", ""]
    return "\n".join(lines)


__all__ = [
    "SloCredit",
    "TrainConfig",
    "TrainResult",
    "capacity_req_s",
    "make_env",
    "on_target_emitted",
    "train",
    "workload_pool",
]
