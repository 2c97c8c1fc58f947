"""Simulator parameters: one frozen dataclass per component, composed into :class:`SimParams`.

Stored as plain JSON (never pickle). Every fitted coefficient carries a standard error where
the fit produced one (``rel_se`` / ``se`` maps), and :meth:`SimParams.perturb` draws a
deployment around the fit for domain randomization.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from env.acceptance import AcceptanceParams, without_resume_loss
from env.errors import FitError
from env.latency import KV_NAMES, LatencyParams
from env.workload import WorkloadParams

SIM_FORMAT = 2
# Format 1 had one linear KV term and ``extend0``; its files cannot be read as format 2.
_OLD_FORMATS = {1: "the single-KV-term latency model (before the per-kernel attention and off_path)"}


@dataclass(frozen=True)
class EngineParams:
    """Scheduler limits and memory of the modelled SGLang server.

    ``kv_budget_tokens`` is what the KV pool holds *without* a drafter, in target tokens. A
    speculating server also keeps the drafter's weights and the drafter's KV for every cached
    token in the same pool (measured on the H200, SGLang 0.5.17, 8B shape: 1.04 GB of weights,
    4 KB of draft KV per token against the target's 128 KB, i.e. 3.1%;
    ``bench/results/realgpu/offswitch/README.md``), so it holds fewer tokens:
    :attr:`spec_kv_budget_tokens`, which the engine admits against. Zero drafter bytes: a
    deployment without a drafter.

    ``prefix_cache_hit``: the fraction of each prompt SGLang's radix cache already holds (not
    prefilled, still cached context); a benchmark that warms its prompts first runs near 1.
    ``request_latency_us`` / ``request_serial_us``: the server's request path before the
    scheduler (HTTP, tokenizer): each request reaches the waiting queue that long after it was
    sent, and at most one per ``request_serial_us`` (0, 0: at once, as before). The hook never
    sees it; the client's TTFT does.
    ``warm_resume``: the hook's off switch resumes drafting warm (``controller.protocol.
    WarmResume``, its default since 2026-12-06): a depth above 0 right after depth 0 runs one
    more depth-0 step first (:class:`env.runner.DecodeLoop`); False: at once, as the
    deployments were built and as the traces of calls before AA were recorded (whose resumes
    lost their drafts: ``env.acceptance.with_resume_loss``).
    """

    max_running_requests: int = 256
    kv_budget_tokens: int = 400_000
    chunked_prefill_tokens: int = 8192
    instance: str = "sim-0"
    kv_bytes_per_token: float = 131072.0
    draft_kv_bytes_per_token: float = 0.0
    draft_weight_bytes: float = 0.0
    prefix_cache_hit: float = 0.0
    request_latency_us: int = 0
    request_serial_us: int = 0
    warm_resume: bool = False

    @property
    def spec_kv_budget_tokens(self) -> int:
        """Target tokens the pool holds once the drafter's weights and KV are carried."""
        if self.draft_kv_bytes_per_token <= 0.0 and self.draft_weight_bytes <= 0.0:
            return self.kv_budget_tokens
        pool = self.kv_budget_tokens * self.kv_bytes_per_token - self.draft_weight_bytes
        return max(0, int(pool // (self.kv_bytes_per_token + self.draft_kv_bytes_per_token)))

    def plain_budget_for(self, spec_budget_tokens: int) -> int:
        """The inverse of :attr:`spec_kv_budget_tokens`: the drafter-free budget of a pool that
        holds ``spec_budget_tokens`` with this drafter (for budgets read off a speculating server)."""
        if self.draft_kv_bytes_per_token <= 0.0 and self.draft_weight_bytes <= 0.0:
            return int(spec_budget_tokens)
        pool = spec_budget_tokens * (self.kv_bytes_per_token + self.draft_kv_bytes_per_token)
        return int(math.ceil((pool + self.draft_weight_bytes) / self.kv_bytes_per_token))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> EngineParams:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FitError(f"engine params: unknown keys {sorted(unknown)}")
        return cls(**d)


def warm_resumed(params: SimParams) -> SimParams:
    """``params`` for a hook that resumes warm (``EngineParams.warm_resume``), with a fit's
    resume loss (``env.acceptance.with_resume_loss``, read off cold traces) taken out."""
    return replace(
        params,
        acceptance=without_resume_loss(params.acceptance),
        engine=replace(params.engine, warm_resume=True),
    )


@dataclass(frozen=True)
class SimParams:
    """Everything the simulator needs for one deployment."""

    latency: LatencyParams = field(default_factory=LatencyParams)
    acceptance: AcceptanceParams = field(default_factory=AcceptanceParams)
    workload: WorkloadParams = field(default_factory=WorkloadParams)
    engine: EngineParams = field(default_factory=EngineParams)
    name: str = "custom"
    notes: str = ""

    def to_dict(self) -> dict:
        return {
            "format": SIM_FORMAT,
            "name": self.name,
            "notes": self.notes,
            "latency": self.latency.to_dict(),
            "acceptance": self.acceptance.to_dict(),
            "workload": self.workload.to_dict(),
            "engine": self.engine.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "sim params") -> SimParams:
        if isinstance(d, dict) and d.get("format") in _OLD_FORMATS:
            raise FitError(
                f"{where}: simulator parameter file of format {d['format']} ({_OLD_FORMATS[d['format']]}); "
                f"this simulator reads format {SIM_FORMAT}: refit it (controller fit) or rebuild the deployment"
            )
        if not isinstance(d, dict) or d.get("format") != SIM_FORMAT:
            raise FitError(f"{where}: not a simulator parameter file of format {SIM_FORMAT}")
        try:
            return cls(
                latency=LatencyParams.from_dict(d["latency"]),
                acceptance=AcceptanceParams.from_dict(d["acceptance"]),
                workload=WorkloadParams.from_dict(d["workload"]),
                engine=EngineParams.from_dict(d["engine"]),
                name=str(d.get("name", "custom")),
                notes=str(d.get("notes", "")),
            )
        except KeyError as exc:
            raise FitError(f"{where}: missing section {exc.args[0]!r}") from None
        except TypeError as exc:
            raise FitError(f"{where}: {exc}") from None

    def to_json(self, path: str | Path) -> None:
        """Write as plain JSON (indented, stable key order)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> SimParams:
        """Read a file written by :meth:`to_json`; raises FitError naming the file."""
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FitError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise FitError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(d, str(path))

    def perturb(self, rng: np.random.Generator, scale: float = 1.0) -> SimParams:
        """Domain randomization: a deployment drawn around this one.

        Latency coefficients move by their fitted relative standard errors (× ``scale``) and
        the whole step time by a common log-normal factor of s.d. ``0.05·scale`` (what moves
        between a profile and a serving engine: kernels, clocks); acceptance by its fitted
        errors (see :meth:`AcceptanceParams.perturb`). ``scale = 0`` returns ``self``.
        """
        if scale <= 0.0:
            return self
        lat = self.latency.perturb(rng, scale)
        common = math.exp(rng.normal(0.0, 0.05 * scale))
        lat = replace(
            lat,
            **{
                n: getattr(lat, n) * common
                for n in ("t_fix_us", "w_us", "f_us_per_tok", "tok_us_per_tok", "oh_us", *KV_NAMES)
            },
        )
        return replace(self, latency=lat, acceptance=self.acceptance.perturb(rng, scale))
