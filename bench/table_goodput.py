"""Does the model table a policy zip carries cost it anything? ``goodput-fit`` priced from it.

A PPO zip carries the fitted latency model as a table (``PPOMeta.model_table``: log step time at
each depth over depth 0's, on a grid of batch size × context per request), and the policy reads
it through ``controller.ppo_policy.model_features``, interpolated. ``goodput-fit`` prices each
step from the fitted model itself. This runs ``controller eval`` with ``goodput-fit`` pricing
its steps from the zip's table instead (everything else as it is: its acceptance estimate, its
probe), so the table's share of a gap between PPO and ``goodput-fit`` reads off the scores:

    python bench/table_goodput.py --zip agents/bundled/h200-llama8b/ppo.zip -- \\
        eval --suite decisions-v3 --only llama8b/drafter-alt-c8 --policy agents/bundled/h200-llama8b/ppo.zip \\
        --seeds 15 --jobs 2 --baselines goodput-fit,static:0 --out /tmp/table-goodput

Then compare its ``goodput-fit`` column with the same command run as ``controller eval``
(``docs/results.md`` has the numbers). The evaluation's worker processes are forked, so they
inherit the substitution.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def table_latency(zip_path: str, depths: tuple[int, ...]) -> Any:
    """``latency_fn(depth, bs, ctx_tokens, latency)`` read from the zip's table: depth 0's step
    time from ``latency`` times the table's interpolated ratio (what the policy's features read)."""
    from controller.errors import PolicyLoadError
    from controller.features import encode_bs, encode_ctx
    from controller.ppo_policy import load_ppo_factory, model_features, model_inputs
    from env.latency import step_time_us

    try:
        meta = load_ppo_factory(zip_path, depths).meta  # refuses a zip trained for other depths
    except PolicyLoadError as e:
        raise SystemExit(str(e)) from None
    if meta.model_table is None:
        raise SystemExit(f"{zip_path} carries no model table")
    table = np.ascontiguousarray(meta.model_table, dtype=np.float64)
    inputs = model_inputs(depths)  # where the features read bs and ctx_per_req
    obs = np.zeros(meta.obs_dim, dtype=np.float32)
    ratio_at = {d: meta.obs_dim + i for i, d in enumerate(depths)}  # each depth's clipped log ratio

    def fn(depth: int, bs: int, ctx: float, latency: Any) -> float:
        # The Featurizer's bs and ctx_per_req.
        obs[inputs[0]] = encode_bs(bs)
        obs[inputs[1]] = encode_ctx(ctx / max(bs, 1))
        ratio = model_features(obs, table, inputs)[ratio_at[depth]]
        return math.exp(float(ratio)) * step_time_us(latency, bs, 0, ctx)

    return fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zip", required=True, help="the policy zip whose table goodput-fit reads")
    ap.add_argument("--depths", default="0,1,2,3,5")
    ap.add_argument("controller_args", nargs=argparse.REMAINDER, help="after --: a controller eval command line")
    args = ap.parse_args(argv)
    depths = tuple(int(d) for d in args.depths.split(","))
    fn = table_latency(args.zip, depths)

    import agents.evaluate as ev
    from controller.baselines import GoodputPolicy

    plain = ev.model_goodput

    def model_goodput(name: str, depths: tuple[int, ...], latency: Any) -> Any:
        if name != "goodput-fit":
            return plain(name, depths, latency)
        return GoodputPolicy(name, depths, latency_fn=lambda d, bs, ctx: fn(d, bs, ctx, latency))

    ev.model_goodput = model_goodput
    from agents.cli import main as cli

    rest = args.controller_args[1:] if args.controller_args[:1] == ["--"] else args.controller_args
    return int(cli(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
