"""What a policy is trained for and judged by: throughput, or goodput under a TPOT target.

``--objective`` takes one of

=================  ===========================================================================
value              objective
=================  ===========================================================================
``throughput``     output tokens per second (the default)
``slo:TPOT_MS``    goodput under a per-request TPOT target: output tokens per second of the
                   requests whose TPOT (time per output token after the first) is at most
                   ``TPOT_MS`` milliseconds; the tokens of a request that misses it count 0
=================  ===========================================================================

The goodput definition is DistServe's request-level SLO attainment, token-weighted: a request
either meets its TPOT target over its whole life or contributes nothing (a one-token request
has no inter-token latency and always meets it). ``controller train --objective`` stores the
objective in the policy zip (``specdepth.json``), ``controller eval`` scores every policy by
the zip's objective, and ``controller serve`` reports the served policy's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from controller.errors import ConfigError

THROUGHPUT: Final = "throughput"
SLO_PREFIX: Final = "slo:"
OBJECTIVE_HELP: Final = (
    "what the policy maximises: 'throughput' (output tokens/s, the default) or 'slo:TPOT_MS' "
    "(goodput under a TPOT target: tokens/s of the requests whose time per output token is at "
    "most TPOT_MS ms, e.g. slo:50)"
)


@dataclass(frozen=True)
class Objective:
    """A parsed ``--objective``.

    Attributes:
        tpot_ms: the per-request TPOT target in ms for goodput; None for throughput.
    """

    tpot_ms: float | None = None

    @property
    def is_slo(self) -> bool:
        return self.tpot_ms is not None

    def __str__(self) -> str:
        return THROUGHPUT if self.tpot_ms is None else f"{SLO_PREFIX}{self.tpot_ms:g}"

    def meets(self, tpot_ms: float) -> bool:
        """Whether a request with this TPOT counts toward the objective's score."""
        return self.tpot_ms is None or tpot_ms <= self.tpot_ms


def parse_objective(text: str | None) -> Objective:
    """Parse ``throughput`` or ``slo:TPOT_MS`` (None: throughput).

    Raises:
        ConfigError: anything else, with the accepted forms.
    """
    if text is None:
        return Objective()
    value = str(text).strip()
    if value == THROUGHPUT:
        return Objective()
    bad = (
        f"--objective must be 'throughput' or 'slo:TPOT_MS' with TPOT_MS a TPOT target in "
        f"milliseconds > 0 (e.g. slo:50), got {text!r}"
    )
    if not value.startswith(SLO_PREFIX):
        raise ConfigError(bad)
    try:
        tpot_ms = float(value[len(SLO_PREFIX) :])
    except ValueError:
        raise ConfigError(bad) from None
    if not (math.isfinite(tpot_ms) and tpot_ms > 0.0):
        raise ConfigError(bad)
    return Objective(tpot_ms)


__all__ = ["OBJECTIVE_HELP", "THROUGHPUT", "Objective", "parse_objective"]
