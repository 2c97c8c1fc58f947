"""How many steps after a record the hook applied the decision made from it, read from a trace.

The controller decides from each step record; the hook applies the answer at a later decode
launch. A deterministic policy's trace says how much later: replay the records through the
policy's own Featurizer and zip, and see after how many steps the depth the hook ran follows a
change of decision. Usage: ``python bench/h200/decision_delay.py --policy PPO_ZIP TRACE [...]``
(the trace of that policy's controller, ``traces/<policy>-<instance>-<start>.msgpack.gz``).
``bench/h200/realgpu_sim.py --action-delay`` replays calls with what this finds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.features import featurizer_for  # noqa: E402
from controller.protocol import DEFAULT_DEPTHS, Step  # noqa: E402
from controller.registry import make_factory  # noqa: E402
from controller.traces import file_steps  # noqa: E402


def followed(steps: list[Step], decisions: list[int], delay: int) -> tuple[float, int]:
    """The share of the decision changes whose depth the hook ran ``delay`` steps later, and
    how many changes there were."""
    changes = [t for t in range(1, len(steps) - delay) if decisions[t] != decisions[t - 1]]
    if not changes:
        return float("nan"), 0
    return sum(steps[t + delay].depth == decisions[t] for t in changes) / len(changes), len(changes)


def decisions_of(policy: str, steps: list[Step], depths: tuple[int, ...] = DEFAULT_DEPTHS) -> list[int]:
    """The depth ``policy`` decides after each record, replayed from a fresh controller."""
    pol = make_factory(policy, depths)(depths)
    pol.reset()
    feat = featurizer_for(pol, depths)
    return [depths[int(pol.act(feat.update(s), s))] for s in steps]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True, help="the PPO zip (or builtin:NAME) the trace's controller served")
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--max-delay", type=int, default=4)
    args = ap.parse_args(argv)
    print("| trace | decision changes | " + " | ".join(f"followed {k} later" for k in range(1, args.max_delay + 1)) + " |")
    print("|---|---|" + "---|" * args.max_delay)
    for path in args.traces:
        steps = list(file_steps(path))
        dec = decisions_of(args.policy, steps)
        shares = [followed(steps, dec, k) for k in range(1, args.max_delay + 1)]
        print(f"| {path.name} | {shares[0][1]} | " + " | ".join(f"{s:.3f}" for s, _ in shares) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
