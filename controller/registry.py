"""Policy specs → factories: what ``controller serve --policy SPEC`` (and bench, eval, demo) accept.

- a path to an SB3 PPO zip written by ``controller train`` (:mod:`controller.ppo_policy`);
- ``builtin:NAME``, one of :data:`BUILTINS` (the baselines of :mod:`controller.baselines`), e.g.
  ``builtin:static:3``. A name ending in ``:`` takes an argument after it.

Builtins adapt to any allowed depths; a PPO zip was trained for one tuple of depths and refuses
the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.baselines import (
    make_bandit,
    make_goodput,
    make_sglang_adaptive,
    make_sglang_adaptive_all,
    make_static,
    make_trtllm,
    make_vllm_dsd,
)
from controller.errors import PolicyLoadError
from controller.policy import Policy, PolicyFactory
from controller.ppo_policy import load_ppo_factory


def _refuse_oracle(name: str, depths: tuple[int, ...]) -> Policy:
    raise PolicyLoadError(
        "builtin:oracle is clairvoyant (it reads the simulator's true rates): simulator only"
    )


# name (or prefix ending in ":") -> maker(full_name, depths).
BUILTINS: dict[str, Callable[[str, tuple[int, ...]], Policy]] = {
    "static:": make_static,
    "vllm-dsd": make_vllm_dsd,
    "trtllm-schedule": make_trtllm,
    "sglang-adaptive": make_sglang_adaptive,
    "sglang-adaptive-all": make_sglang_adaptive_all,
    "goodput": make_goodput,
    "bandit": make_bandit,
    # Named so that the service says why it cannot serve it; the simulator builds the oracle
    # itself (agents.oracle).
    "oracle": _refuse_oracle,
}


class _Builtin:
    def __init__(self, name: str, make: Callable[[str, tuple[int, ...]], Policy]) -> None:
        self.name = name
        self._make = make

    def __call__(self, depths: tuple[int, ...]) -> Policy:
        return self._make(self.name, depths)


def builtin_names() -> list[str]:
    """The builtin names (and prefixes), sorted."""
    return sorted(BUILTINS)


def make_factory(spec: str, depths: Sequence[int] | None = None) -> PolicyFactory:
    """Resolve a policy spec into a factory; raises :class:`PolicyLoadError` with a reason.

    ``depths``, when given, is checked against what the policy supports (a PPO zip fixes its
    depths; builtins adapt to any).
    """
    if spec.startswith("builtin:"):
        name = spec[len("builtin:") :]
        for prefix, make in BUILTINS.items():
            if name == prefix or (prefix.endswith(":") and name.startswith(prefix)):
                factory = _Builtin(name, make)
                if depths is not None:
                    factory(tuple(depths))  # fail now, not at the first hello
                return factory
        raise PolicyLoadError(f"unknown builtin policy {name!r}; known: {', '.join(builtin_names())}")
    return load_ppo_factory(spec, depths)
