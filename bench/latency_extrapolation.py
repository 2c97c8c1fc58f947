"""The latency model's extrapolation on profile rows the fit never saw, as markdown tables.

Run: ``python bench/latency_extrapolation.py [--profile CSV]`` (default: the shipped H200
profile, ``env/profiles/h200_llama8b/latency.csv``). For each split of
``env.fit.EXTRAPOLATION_SPLITS`` (fit on context ≤ 2048 and predict the longer rows; fit on
batch ≤ 32 and predict the larger batches) it prints, per part, the held-out rows, their MAPE
and the worst row. ``tests/test_latency_extrapolation.py`` holds the same numbers to 5%.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from env.fit import extrapolation_report
from env.latency import read_profile

PROFILE = Path(__file__).resolve().parents[1] / "env" / "profiles" / "h200_llama8b" / "latency.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(PROFILE))
    args = ap.parse_args()
    rows = extrapolation_report(read_profile(args.profile))
    for split in dict.fromkeys(r["split"] for r in rows):
        print(f"\n{split}\n")
        print("| part | held-out rows | MAPE | worst row |")
        print("|---|---|---|---|")
        for r in rows:
            if r["split"] == split:
                print(f"| {r['part']} | {r['rows']} | {r['mape_pct']:.1f}% | {r['worst_pct']:+.1f}% ({r['worst_row']}) |")


if __name__ == "__main__":
    main()
