"""Where a closed-loop point's time went, read from the hook's step records of a device call.

A realgpu/offswitch call times each (policy, C) point from the client; the hook's trace of the
same point says what the server did meanwhile. Per point (a run of steps between idle gaps of
more than ``--gap-ms``), this prints:

- ``tok/s``: output tokens (batch + accepted drafts) over the summed step time;
- ``full``: the same over the steps that ran at 90% of the point's largest batch or more, and
  the share of the point's time they took: the rest is the ramp and the drain, when fewer than
  C requests were left;
- ``decode``: the median step at the full batch without an admission, and ``admit``: the mean
  extra time per admission (a step whose record carries ``prefill_tokens``, with the step before
  it: under the overlap scheduler an admission's time can land in the record before the one
  that counts its tokens), against two such decode steps; mean and median. An admission whose
  record starts after a gap (:func:`after_idle`: the scheduler idled, so its prefill ran
  before the record's own launch, untimed) is left out: at one request every admission is;
- ``first draft accepted``: the share of requests whose first draft token was accepted, on the
  drafted steps right after a depth-0 step (a resume) and on the other drafted steps. With the
  off switch's ``kv`` drafter resumed cold the first proposal after a resume comes from a stale
  hidden state (``bench/results/realgpu/offswitch/README.md``); ``controller fit`` reads it from the traces
  (``env.fit.resume_acceptance``); and, for the resumes whose depth-0 run has a drafted step
  before it and one after the resume, the same share on the step before, the resume and the
  step after (``resume_pairs``): the resumes against their neighbours, in the same phase of
  the load and the mix. Cold (``SPECDEPTH_OFF_RESUME=cold``) the middle one is 0; warm, as its
  neighbours.

With ``--by-batch`` it prints instead, per point, where the whole run's step time went by the
batch a step ran (an open-loop run has no full batch to speak of): the median decode step (no
admission in it or the step before) in each batch band of :data:`BANDS`, and the steps that
carry an admission: how many, their summed time, and the prefilled tokens. Two servers' runs of
one trace then read side by side at equal batches.

Traces carry no plain server unless it ran through the hook's launcher with a recording
controller (``plain-rec`` in ``offswitch.KINDS``). Usage: ``python bench/h200/trace_points.py
TRACE.msgpack.gz [...]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.traces import iter_records, start_key  # noqa: E402
from env.fit import resume_acceptance  # noqa: E402


def idle_ms(prev: dict, step: dict) -> float:
    """How long the server idled between step ``prev``'s end and ``step``'s start (busy steps
    start where the one before ended: 0)."""
    return (step["ts_ns"] - step["step_us"] * 1000 - prev["ts_ns"]) / 1e6


def points(steps: list[dict], gap_ms: float) -> list[list[dict]]:
    """The trace's steps split where the server idled longer than ``gap_ms`` between steps."""
    out: list[list[dict]] = [[]]
    for prev, s in zip([None, *steps], steps):
        if prev is not None and idle_ms(prev, s) > gap_ms and out[-1]:
            out.append([])
        out[-1].append(s)
    return [p for p in out if p]


def _first_accepted(step: dict) -> float:
    return statistics.fmean(min(a, 1) for a in step["accept"])


def resume_pairs(point: list[dict]) -> tuple[int, float, float, float]:
    """(resumes, and the mean share of requests whose first draft token was accepted on the
    drafted step before each resume's depth-0 run, on the resume, and on the drafted step
    after it): every resume with both neighbours drafted."""
    rows = []
    for i in range(1, len(point) - 1):
        s = point[i]
        if not (s["depth"] > 0 and point[i - 1]["depth"] == 0 and s["accept"]):
            continue
        j = i - 1
        while j >= 0 and point[j]["depth"] == 0:
            j -= 1
        after = point[i + 1]
        if j >= 0 and point[j]["accept"] and after["depth"] > 0 and after["accept"]:
            rows.append((_first_accepted(point[j]), _first_accepted(s), _first_accepted(after)))
    if not rows:
        return 0, float("nan"), float("nan"), float("nan")
    return len(rows), *(statistics.fmean(r[k] for r in rows) for k in range(3))  # type: ignore[return-value]


def clean_steps(point: list[dict]) -> list[int]:
    """Indices of the decode steps with no admission in them or in the step before (under the
    overlap scheduler an admission's time can land in the record before the one that counts its
    tokens)."""
    admit = [s["prefill_tokens"] > 0 for s in point]
    return [i for i in range(len(point)) if not admit[i] and (i == 0 or not admit[i - 1])]


IDLE_GAP_US = 500
"""A record that starts this long after the one before ended follows an idle scheduler: the hook
timed it from its own launch (``Scheduler.on_idle``), so an admission before it is not in it."""


def after_idle(point: list[dict], i: int) -> bool:
    """Whether step ``i`` starts :data:`IDLE_GAP_US` or more after step ``i - 1`` ended."""
    return idle_ms(point[i - 1], point[i]) >= IDLE_GAP_US / 1000


def describe(point: list[dict]) -> dict[str, Any]:
    c = max(s["bs"] for s in point)
    tokens = [s["bs"] + sum(s["accept"]) for s in point]
    us = [float(s["step_us"]) for s in point]
    full = [i for i, s in enumerate(point) if s["bs"] >= 0.9 * c]
    clean = set(clean_steps(point))
    decode = [us[i] for i in full if i in clean]
    base = statistics.median(decode) if decode else float("nan")
    admits = [
        i for i in range(1, len(point))
        if point[i]["prefill_tokens"] > 0 and point[i]["bs"] >= 0.9 * c and not after_idle(point, i)
    ]  # fmt: skip
    extra = [us[i] + us[i - 1] - 2 * base for i in admits]
    first, n_first, other, n_other = resume_acceptance([[(s["depth"], s["accept"]) for s in point]])
    return {
        "c": c,
        "steps": len(point),
        "tok_s": sum(tokens) / sum(us) * 1e6,
        "full_tok_s": sum(tokens[i] for i in full) / sum(us[i] for i in full) * 1e6 if full else float("nan"),
        "full_share": sum(us[i] for i in full) / sum(us),
        "decode_ms": base / 1e3,
        "admissions": len(admits),
        "admit_ms": statistics.fmean(extra) / 1e3 if extra else float("nan"),
        "admit_p50_ms": statistics.median(extra) / 1e3 if extra else float("nan"),
        "depths": {d: n / len(full) for d, n in sorted(Counter(point[i]["depth"] for i in full).items())},
        "resumed": (first, n_first),
        "later": (other, n_other),
        "pairs": resume_pairs(point),
    }


BANDS = ((1, 16), (17, 32), (33, 64), (65, 96), (97, 128), (129, 256))
"""Batch bands of ``--by-batch`` (running requests, both ends included)."""


def by_batch(point: list[dict]) -> dict[str, Any]:
    """Where a run's step time went by batch (module docstring, ``--by-batch``)."""
    us = [float(s["step_us"]) for s in point]
    admit = [s["prefill_tokens"] > 0 for s in point]
    clean = clean_steps(point)
    bands = {}
    for lo, hi in BANDS:
        band = [us[i] for i in clean if lo <= point[i]["bs"] <= hi]
        bands[(lo, hi)] = (statistics.median(band) / 1e3, len(band)) if band else (float("nan"), 0)
    return {
        "steps": len(point),
        "time_s": sum(us) / 1e6,
        "decode_s": sum(us[i] for i in clean) / 1e6,
        "admissions": sum(admit),
        "admit_s": sum(u for u, a in zip(us, admit) if a) / 1e6,
        "prefill_tokens": sum(s["prefill_tokens"] for s in point),
        "bands": bands,
    }


def print_points(rows: list[tuple[str, dict[str, Any]]]) -> None:
    """The default table: one row per point, :func:`describe`'s figures."""
    print(
        "| trace | C | steps | tok/s | at full batch: tok/s | share of time | decode ms | admissions "
        "| ms per admission, mean / median | depths at full batch | first draft accepted: resumed / later (steps) "
        "| ... before / at / after each resume (resumes) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, d in rows:
        print(
            f"| {name} | {d['c']} | {d['steps']} | {d['tok_s']:.0f} | {d['full_tok_s']:.0f} "
            f"| {d['full_share']:.2f} | {d['decode_ms']:.1f} | {d['admissions']} "
            f"| {d['admit_ms']:.1f} / {d['admit_p50_ms']:.1f} "
            f"| {', '.join(f'{k}: {v:.2f}' for k, v in d['depths'].items() if v >= 0.005)} "
            f"| {d['resumed'][0]:.2f} ({d['resumed'][1]}) / {d['later'][0]:.2f} ({d['later'][1]}) "
            f"| {d['pairs'][1]:.2f} / {d['pairs'][2]:.2f} / {d['pairs'][3]:.2f} ({d['pairs'][0]}) |"
        )


def print_by_batch(rows: list[tuple[str, dict[str, Any]]]) -> None:
    """The ``--by-batch`` table: one row per point, :func:`by_batch`'s figures."""
    heads = " | ".join(f"decode ms at {lo}-{hi} (steps)" for lo, hi in BANDS)
    print(f"| trace | steps | step time s | clean decode s | admission steps | their time s | prefilled tokens | {heads} |")
    print("|---|" + "---|" * (6 + len(BANDS)))
    for name, d in rows:
        bands = " | ".join(f"{ms:.2f} ({n})" if n else "" for ms, n in d["bands"].values())
        print(
            f"| {name} | {d['steps']} | {d['time_s']:.2f} | {d['decode_s']:.2f} | {d['admissions']} "
            f"| {d['admit_s']:.2f} | {d['prefill_tokens']} | {bands} |"
        )


def label(path: Path) -> str:
    """``<policy>-<instance>-<start ns>.msgpack.gz`` without its start (which names the
    controller run, not the server), so two servers' traces of one policy read apart."""
    return start_key(path)[1]


def runs(paths: list[Path], gap_ms: float, min_steps: int) -> Iterator[tuple[str, list[dict]]]:
    """(label, steps) of every run of at least ``min_steps`` steps in the traces, in order."""
    for path in paths:
        steps = [r for r in iter_records(path) if r.get("t") == "step"]
        yield from ((label(path), p) for p in points(steps, gap_ms) if len(p) >= min_steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--gap-ms", type=float, default=150.0, help="idle time that separates two points")
    parser.add_argument("--min-steps", type=int, default=50, help="leave out shorter runs (priming, probes)")
    parser.add_argument("--by-batch", action="store_true",
                        help="where each run's step time went by batch band, and its admissions (open-loop runs)")  # fmt: skip
    args = parser.parse_args(argv)
    found = runs(args.traces, args.gap_ms, args.min_steps)
    if args.by_batch:
        print_by_batch([(name, by_batch(p)) for name, p in found])
    else:
        print_points([(name, describe(p)) for name, p in found])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
