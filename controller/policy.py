"""The one policy interface, shared by the live service, the simulator and every baseline.

A policy sees what the Featurizer produced and the step record it came from — nothing else —
and answers an *action*: an index into the allowed depths. Policies with per-instance state
(EMA rules, bandits) are made per instance by a :class:`PolicyFactory`.

Optional capabilities are declared here, each as a runtime-checkable protocol; callers test
for them with ``isinstance`` and never guess by attribute name:

=========================  =======================================================================
capability                 who has it, who uses it
=========================  =======================================================================
:class:`FusedPolicy`       ``fused``: a compiled kernel that featurizes and acts in one call
                           (:class:`controller.ppo_policy.PPOPolicy`); the service then calls
                           ``featurizer.update_with(step, policy.fused)`` instead of
                           ``act(featurizer.update(step), step)``; both give the same state and
                           action. ``None`` when it has none (no numba, stacked frames).
:class:`ServingFactory`    ``prepare_serving()``: costly set-up (compiling that kernel) a factory
                           does once, before the service binds (:class:`~controller.ppo_policy.PPOFactory`)
:class:`VersionedPolicy`   ``featurizer_version``: the observation definition a policy was trained on
                           (:class:`~controller.ppo_policy.PPOPolicy`: its zip's); whoever builds
                           its Featurizer builds that version (:func:`controller.features.featurizer_for`).
                           Policies without it read the current version.
:class:`EngineBound`       ``bind_engine(engine)``: a policy that reads the simulator's engine (the
                           clairvoyant oracle, ``agents.oracle``); the simulation loop binds it
                           before the first step. Such a policy cannot be served.
=========================  =======================================================================

Which policies exist (``builtin:NAME``, PPO zips) is :mod:`controller.registry`'s business; the
builtin ones are in :mod:`controller.baselines`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from controller.protocol import Step


@runtime_checkable
class Policy(Protocol):
    """Decides the next draft depth for one instance."""

    name: str

    def reset(self) -> None:
        """Forget per-instance state (new instance or new episode)."""

    def act(self, obs: np.ndarray, step: Step) -> int:
        """Return an index into the allowed depths, given the Featurizer's observation of
        ``step`` and the record itself."""


class PolicyFactory(Protocol):
    """Builds one :class:`Policy` per instance for a given tuple of allowed depths."""

    name: str

    def __call__(self, depths: tuple[int, ...]) -> Policy: ...


@runtime_checkable
class FusedPolicy(Protocol):
    """A policy that can also featurize and act in one compiled call (see the module docstring)."""

    fused: Callable[..., int] | None


@runtime_checkable
class ServingFactory(Protocol):
    """A factory with set-up to do once before serving (see the module docstring)."""

    def prepare_serving(self) -> None: ...


@runtime_checkable
class VersionedPolicy(Protocol):
    """A policy trained on a given Featurizer version (see the module docstring)."""

    featurizer_version: int


@runtime_checkable
class EngineBound(Protocol):
    """A policy that reads the simulator's engine (see the module docstring)."""

    def bind_engine(self, engine: Any) -> None: ...
