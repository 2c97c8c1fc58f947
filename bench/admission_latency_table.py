"""How admissions distort the Featurizer's latency table on real traces, by Featurizer version.

Run: ``python bench/admission_latency_table.py [--traces DIR] [--min-bs N]`` (default: the
H100 drawn-length traces, ``bench/results/realgpu/h100/drawn/traces``, batch >= 48). Each
trace file is replayed through Featurizers of every version that takes admissions into account
differently (3: every step; 4: not a step that admitted requests; 5: nor the step before one).

The reference is the median step time, per depth and batch size (in bins of 8), of the
decode-only records of all the files: neither the record, the one before it nor the one after
it admitted requests. It prints:

- what one admission costs per record: the excess over that median of the record before the
  one that counts the prefilled tokens, and of the counting record, for admissions of one
  prefix-cached request (2 tokens prefilled) after a decode step;
- per version, at every record with bs >= ``--min-bs``, the table's step time at depth 0 and
  at depth 3 (for the record's bucket) over the reference at the record's batch size.
  ``lat_ratio_3`` is log(depth 3's entry / depth 0's): its error is the two entries' errors
  (the traces' policies never measured both depths in one bucket at large batches: ``ppo``
  ran depth 0 there), so a depth-0 entry 3x too slow makes depth 3 read 3x cheaper.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

from controller.features import Featurizer
from controller.protocol import ProtocolError, Step, parse_step
from controller.traces import iter_records, trace_files

TRACES = Path(__file__).resolve().parent / "results" / "realgpu" / "h100" / "drawn" / "traces"
VERSIONS = (3, 4, 5)


def read(path: Path) -> tuple[tuple[int, ...], list[Step]]:
    """The allowed depths (from the ``hello``) and the ``step`` records of one trace file."""
    depths: tuple[int, ...] = ()
    steps = []
    for rec in iter_records(path):
        if rec["t"] == "hello":
            depths = tuple(rec["depths"])
        elif rec["t"] == "step":
            try:
                steps.append(parse_step(rec))
            except ProtocolError:
                continue
    return depths, steps


BIN = 8


def decode_medians(files: list[list[Step]]) -> dict[tuple[int, int], float]:
    """Median step_us per (depth, bs // BIN) of records with no admission in them or either side."""
    times: dict[tuple[int, int], list[int]] = defaultdict(list)
    for steps in files:
        for prev, cur, nxt in zip(steps, steps[1:], steps[2:]):
            if prev.prefill_tokens == cur.prefill_tokens == nxt.prefill_tokens == 0 and cur.step_us > 0:
                times[(cur.depth, cur.bs // BIN)].append(cur.step_us)
    return {k: float(statistics.median(v)) for k, v in times.items() if len(v) >= 5}


def summary(x: list[float]) -> str:
    if not x:
        return "n = 0"
    a = np.array(x)
    return (
        f"n = {len(a)}, median {np.median(a):.2f}, p90 {np.quantile(a, 0.9):.2f}, max {a.max():.2f}, "
        f"> 1.25x: {np.mean(a > 1.25):.1%}, < 0.8x: {np.mean(a < 0.8):.1%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--min-bs", type=int, default=48)
    args = ap.parse_args()
    files = {p.name: read(p) for p in trace_files(args.traces)}
    ref = decode_medians([s for _, s in files.values()])

    print("admission excess over the decode median (ms), by record:")
    before, counting = [], []
    for _, steps in files.values():
        for prev, cur in zip(steps, steps[1:]):
            if cur.prefill_tokens == 2 and prev.prefill_tokens == 0:
                for rec, out in ((prev, before), (cur, counting)):
                    m = ref.get((rec.depth, rec.bs // BIN))
                    if m is not None:
                        out.append((rec.step_us - m) / 1000)
    for name, x in (("before the counting record", before), ("the counting record", counting)):
        print(f"  {name}: n = {len(x)}, median {statistics.median(x):.1f}, mean {statistics.fmean(x):.1f}")

    print(f"\ndecode medians (ms) at bs >= {args.min_bs}, by batch size (bins of {BIN}):")
    for b in sorted({b for _, b in ref if (b + 1) * BIN > args.min_bs}):
        row = {d: ref[(d, b)] / 1000 for d in (0, 3) if (d, b) in ref}
        print(f"  bs {b * BIN}-{b * BIN + BIN - 1}: " + ", ".join(f"depth {d} {v:.1f}" for d, v in row.items()))

    for v in VERSIONS:
        lat: dict[int, list[float]] = {0: [], 3: []}
        for depths, steps in files.values():
            f = Featurizer(depths, version=v)
            for s in steps:
                f.update(s)
                if s.bs < args.min_bs:
                    continue
                b = s.bs // BIN
                for d in lat:
                    m = ref.get((d, b))
                    t = f.latency_us(d, s.bs)
                    if m is not None and t > 0:
                        lat[d].append(t / m)
        print(f"\nversion {v}: table / decode median, at every record with bs >= {args.min_bs}")
        print(f"  depth 0: {summary(lat[0])}")
        print(f"  depth 3: {summary(lat[3])}")


if __name__ == "__main__":
    main()
