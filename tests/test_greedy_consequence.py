"""On the KV-bound long-context deployment at C=32, a per-step greedy rule loses to depth 0
through the batches its choices leave, not through its steps (docs/results.md, "PPO never
more than 1% below static:0"). ``bench/greedy_consequence.py`` prints the table over 15 seeds;
here 3 seeds check the mechanism, so that a simulator change that removes or reverses it shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import greedy_consequence  # noqa: E402


def test_the_clairvoyant_greedy_rule_gains_every_step_and_loses_the_run():
    rows = dict(greedy_consequence.run("longctx/long-prompts-c32", 3, ["static:0", "oracle"]))
    base, oracle = rows["static:0"].mean(axis=0), rows["oracle"].mean(axis=0)
    assert base[0] == 1.0 and base[3] == 1.0  # depth 0 against itself
    assert oracle[3] > 1.005  # each of its steps beats depth 0's on the true expected rate...
    assert oracle[0] < 0.995  # ...and the run loses to depth 0
    # Because its batches hold longer contexts, where depth 0 itself runs slower.
    assert oracle[1] > 1.03 * base[1]
    assert oracle[2] < 0.97 * base[2]
