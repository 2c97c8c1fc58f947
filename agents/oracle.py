"""The clairvoyant per-step oracle: the ceiling every policy is measured against.

It reads the simulator's true expected throughput at each depth for the engine's current
state (``engine.expected_rate(depth)``, tokens/s) — something no live controller can see — and
picks the best. It only runs in the simulator: ``env.runner.simulate`` calls
:meth:`OraclePolicy.bind_engine` before the first step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from controller.errors import ConfigError
from controller.protocol import Step


class OraclePolicy:
    """Per step, the depth with the highest true expected tokens/s (greedy, myopic).

    Args:
        depths: the allowed depths.
    """

    name = "oracle"

    def __init__(self, depths: tuple[int, ...]) -> None:
        self.depths = depths
        self._engine: Any = None

    def bind_engine(self, engine: Any) -> None:
        """Attach the simulator engine whose ``expected_rate(depth)`` this oracle reads."""
        self._engine = engine

    def reset(self) -> None:
        pass

    def act(self, obs: np.ndarray, step: Step) -> int:
        if self._engine is None:
            raise ConfigError("the oracle needs the simulator: call bind_engine(engine) first")
        rates = [self._engine.expected_rate(d) for d in self.depths]
        return int(np.argmax(rates))


def make_oracle(depths: tuple[int, ...]) -> OraclePolicy:
    """A fresh oracle for ``depths`` (bind it to an engine before use)."""
    return OraclePolicy(depths)
