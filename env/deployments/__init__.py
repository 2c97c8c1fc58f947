"""Bundled deployments: fitted simulator parameters shipped as JSON.

- ``h200-llama8b``: latency fitted to ``reference/h200_llama8b/latency.csv`` (one H200,
  Llama-3.1-8B shape, EAGLE-3 head) plus SGLang overheads; acceptance calibrated to the
  published Llama-3.1-8B + EAGLE-3 MT-Bench figures (``reference/acceptance.md``).
- ``h200-llama8b-longctx``: the same GPU and model serving 8k-32k-token prompts; the KV pool
  binds (about 45 such requests fit).
- ``h200-70b``: a Llama-3.1-70B-shaped target (FP8) on the H200, derived from the 8B fit by
  roofline scaling (FP8 weights, 320 KB of KV per token, a pool of 155k tokens).
- ``seed``: the seed document's SGLang v0.5.9 EAGLE-3 deployment, calibrated so that the
  closed-loop benchmark reproduces ``reference/seed_benchmark.md`` (see docs/simulator.md).

Rebuild them with ``python -m env.deployments.build`` (from ``env/profiles/``, shipped).
"""

from __future__ import annotations

from pathlib import Path

from controller.errors import ConfigError
from env.params import SimParams

DEPLOYMENTS = ("h200-llama8b", "h200-llama8b-longctx", "h200-70b", "seed")
_DIR = Path(__file__).resolve().parent


def deployment_path(name: str) -> Path:
    """Path of a bundled deployment's JSON."""
    if name not in DEPLOYMENTS:
        raise ConfigError(f"unknown deployment {name!r}; bundled: {', '.join(DEPLOYMENTS)}")
    return _DIR / f"{name}.json"


def load_deployment(name: str) -> SimParams:
    """Load a bundled deployment by name (one of :data:`DEPLOYMENTS`)."""
    return SimParams.from_json(deployment_path(name))


def resolve(deployment: str | SimParams) -> SimParams:
    """A deployment name, a path to a sim.json, or SimParams → SimParams."""
    if isinstance(deployment, SimParams):
        return deployment
    if deployment in DEPLOYMENTS:
        return load_deployment(deployment)
    if deployment.endswith(".json"):
        return SimParams.from_json(deployment)
    raise ConfigError(
        f"unknown deployment {deployment!r}; bundled: {', '.join(DEPLOYMENTS)}, or a sim.json path"
    )
