"""The one policy interface, shared by the live service, the simulator and every baseline.

A policy sees what the Featurizer produced and the step record it came from — nothing else —
and answers an *action*: an index into the allowed depths. Policies with per-instance state
(EMA rules, bandits) are made per instance by a :class:`PolicyFactory`.

Specs (``controller serve --policy SPEC``):
- a path to an SB3 PPO zip (see ``controller.ppo_policy``);
- ``builtin:NAME`` from the registry, e.g. ``builtin:static:3``. Baselines in
  ``agents.baselines`` register themselves here; importing that module needs only numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from controller.errors import PolicyLoadError
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

    # A policy may also carry ``fused``: a compiled kernel that featurizes and acts in one call
    # (:attr:`controller.ppo_policy.PPOPolicy.fused`). The service then calls
    # ``featurizer.update_with(step, policy.fused)`` instead of ``act(featurizer.update(step))``;
    # both must give the same state and action.


class PolicyFactory(Protocol):
    """Builds one :class:`Policy` per instance for a given tuple of allowed depths."""

    name: str

    def __call__(self, depths: tuple[int, ...]) -> Policy: ...


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


class _Builtin:
    def __init__(self, name: str, make: Callable[[str, tuple[int, ...]], Policy]) -> None:
        self.name = name
        self._make = make

    def __call__(self, depths: tuple[int, ...]) -> Policy:
        return self._make(self.name, depths)


# name prefix -> maker(full_name, depths). A prefix ending in ":" takes an argument.
_REGISTRY: dict[str, Callable[[str, tuple[int, ...]], Policy]] = {}


def register_builtin(prefix: str, make: Callable[[str, tuple[int, ...]], Policy]) -> None:
    """Register a builtin policy maker under ``prefix`` (``"vllm-dsd"`` or ``"static:"``)."""
    _REGISTRY[prefix] = make


def _make_static(name: str, depths: tuple[int, ...]) -> Policy:
    arg = name.split(":", 1)[1]
    try:
        depth = int(arg)
    except ValueError:
        raise PolicyLoadError(f"builtin:{name}: the depth must be an integer") from None
    return StaticPolicy(depth, depths)


register_builtin("static:", _make_static)


def _load_builtins() -> None:
    # Baselines live in agents/ and register themselves; imported lazily so that the hook's
    # environment never needs them.
    try:
        import agents.baselines  # noqa: F401
    except ImportError:
        pass


def builtin_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def make_factory(spec: str, depths: Sequence[int] | None = None) -> PolicyFactory:
    """Resolve a policy spec into a factory; raises :class:`PolicyLoadError` with a reason.

    ``depths``, when given, is checked against what the policy supports (a PPO zip fixes its
    depths; builtins adapt to any).
    """
    if spec.startswith("builtin:"):
        name = spec[len("builtin:") :]
        _load_builtins()
        for prefix, make in _REGISTRY.items():
            if name == prefix or (prefix.endswith(":") and name.startswith(prefix)):
                factory = _Builtin(name, make)
                if depths is not None:
                    factory(tuple(depths))  # fail now, not at the first hello
                return factory
        raise PolicyLoadError(f"unknown builtin policy {name!r}; known: {', '.join(builtin_names())}")
    from controller.ppo_policy import load_ppo_factory

    return load_ppo_factory(spec, depths)
