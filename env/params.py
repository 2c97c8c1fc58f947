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

from env.acceptance import AcceptanceParams
from env.errors import FitError
from env.latency import LatencyParams
from env.workload import WorkloadParams

SIM_FORMAT = 1


@dataclass(frozen=True)
class EngineParams:
    """Scheduler limits of the modelled SGLang server."""

    max_running_requests: int = 256
    kv_budget_tokens: int = 400_000
    chunked_prefill_tokens: int = 8192
    instance: str = "sim-0"

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> EngineParams:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FitError(f"engine params: unknown keys {sorted(unknown)}")
        return cls(**d)


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
                for n in ("t_fix_us", "w_us", "f_us_per_tok", "tok_us_per_tok", "kv_us_per_ctx_tok", "oh_us")
            },
        )
        return replace(self, latency=lat, acceptance=self.acceptance.perturb(rng, scale))
