"""``controller serve`` for ``goodput-fit``: the goodput baseline with a fitted latency model.

``controller serve --policy builtin:goodput`` serves goodput with the Featurizer's measured
latency table (the policies layer does not import the simulator). ``controller eval`` also
runs ``goodput-fit``: the same rule, its step cost from the fit's latency model. This script
serves that one live, through the service's own loop (:class:`controller.service.Server` with
a factory), so the benchmark can put it on a real server: the fit is a ``sim.json`` written by
``controller fit`` / ``controller train --traces`` on the same deployment's traces (for the
testbed: ``bench/results/realgpu/ppo-retrained/sim.json``, see ``REALGPU.md``).

It logs like ``controller serve`` (``serving ...``, ``hello from ...``, ``stopped after N
steps ...``), which is what ``policyswap.py`` waits for and reads.

Usage: python bench/h200/serve_goodput_fit.py --sim SIM_JSON --bind ENDPOINT [--record DIR]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agents.evaluate import model_goodput  # noqa: E402
from controller.errors import ControllerError  # noqa: E402
from controller.policy import Policy  # noqa: E402
from controller.service import ServeConfig, Server  # noqa: E402
from env.latency import LatencyParams  # noqa: E402
from env.params import SimParams  # noqa: E402

log = logging.getLogger("controller.service")
NAME = "goodput-fit"


class GoodputFit:
    """A policy factory: goodput whose step cost is ``step_time_us`` of a fitted latency model."""

    name = NAME

    def __init__(self, latency: LatencyParams) -> None:
        self.latency = latency

    def __call__(self, depths: tuple[int, ...]) -> Policy:
        return model_goodput(NAME, depths, self.latency)  # the eval's goodput-fit, one definition


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sim", required=True, type=Path, help="a fitted sim.json")
    parser.add_argument("--bind", required=True, help="the ROUTER endpoint (the hook's --spec-controller)")
    parser.add_argument("--record", default=None, help="trace folder, as controller serve --record")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        factory = GoodputFit(SimParams.from_json(args.sim).latency)
        server = Server(ServeConfig(policy=NAME, bind=args.bind, record=args.record), factory=factory)
    except ControllerError as exc:
        print(f"serve_goodput_fit: error: {exc}", file=sys.stderr)
        return 2

    def _on_signal(signum: int, _frame: Any) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    log.info("serving %s (%s) on %s", NAME, args.sim, server.endpoint)
    server.serve_forever()
    s = server.stats
    log.info("stopped after %d steps from %d frames; errors %s", s.steps, s.frames,
             {k: v for k, v in s.errors.items() if v})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
