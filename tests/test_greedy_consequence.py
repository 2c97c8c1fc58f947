"""On the KV-bound long-context deployment at C=32, per-step greedy rules and depth 0
(docs/results.md, "PPO never more than 1% below static:0"). ``bench/greedy_consequence.py``
prints the table over 15 seeds; here 3 seeds check the mechanism, so that a simulator change
that removes or reverses it shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import greedy_consequence  # noqa: E402


def test_where_a_drafted_step_loops_over_every_prefix_the_greedy_rule_stays_at_depth_0():
    """Since the H200 deployments price SGLang's extend kernel's loop over each request's prefix
    (fitted to the H200's steps at 8k-32k tokens, where a drafted step costs 4-12x a depth-0
    one), no step of this scenario favours drafting on the true expected rate: the clairvoyant
    greedy rule runs depth 0 and ties it. Before (the loop unpriced), each of its steps beat
    depth 0's by 0.5% or more and the run lost 1.8% through the longer contexts its batches held,
    the mechanism this test then froze; a change that makes drafting pay here again shows."""
    rows = dict(greedy_consequence.run("longctx/long-prompts-c32", 3, ["static:0", "oracle"]))
    base, oracle = rows["static:0"].mean(axis=0), rows["oracle"].mean(axis=0)
    assert base[0] == 1.0 and base[3] == 1.0  # depth 0 against itself
    assert oracle[3] < 1.001  # no step's expected rate beats depth 0's ...
    assert abs(oracle[0] - 1.0) < 0.002  # ... and the run is depth 0's
