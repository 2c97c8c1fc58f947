"""Keep a device call's results in the tree at once, before anything else is read from them.

Nothing outside the checkout outlives the development machine, and the device's files come
back outside it: calls AE-AG (2026-12-07) were lost so, with their traces, before anything
was committed. This writes what a later session needs to check a claim, small enough to
commit after every call (the tree and ``.h200pack`` travel together under 64 MiB, so the
traces themselves stay out):

- ``call-NAME.csv``: the call's ``summary.csv``, byte for byte;
- ``points-NAME.json``: its ``offswitch.json`` (every point, the arguments, the device, the
  resume and open-trace analyses) without the per-request output hashes (``out_hash``: the
  bulk of it; the identity check they serve is in the reply and in ``realgpu_report.py``);
- ``traces-NAME.md``, where the call returned ``traces.tar`` (``traces2.tar``, ...):
  ``trace_points.py``'s two tables over every trace in them, each point's summary and
  ``--by-batch``, with the command that printed them.

Refuses to overwrite a file it would write (``--force`` does), so a second call kept under
the same name cannot replace the first.

Usage: python bench/h200/keep_call.py CALL_DIR --into bench/results/realgpu/h100/drawn --name open-ae [--gap-ms 1000]
then ``git add`` what it lists and commit.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trace_points  # noqa: E402


def without_hashes(call: dict[str, Any]) -> dict[str, Any]:
    """``offswitch.json`` with every point's ``out_hash`` left out, everything else as it came."""
    points = [{k: v for k, v in p.items() if k != "out_hash"} for p in call.get("points", [])]
    return {**call, "points": points} if "points" in call else dict(call)


def trace_tables(tars: list[Path], gap_ms: float, min_steps: int) -> str:
    """Both of ``trace_points``' tables over every trace in ``tars``, as Markdown."""
    with tempfile.TemporaryDirectory() as tmp:
        for tar in tars:
            with tarfile.open(tar) as t:
                t.extractall(tmp, filter="data")
        files = sorted(Path(tmp).rglob("*.msgpack*"))
        found = list(trace_points.runs(files, gap_ms, min_steps))  # read once, for both tables
    out = [f"{len(files)} trace files from {', '.join(t.name for t in tars)}.", ""]
    tables = (  # (the flags that print it, its printer, each point's figures)
        ([], trace_points.print_points, trace_points.describe),
        (["--by-batch"], trace_points.print_by_batch, trace_points.by_batch),
    )
    for extra, print_table, figures in tables:
        args = ["--gap-ms", f"{gap_ms:g}", "--min-steps", str(min_steps), *extra]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_table([(name, figures(p)) for name, p in found])
        out += [f"    python bench/h200/trace_points.py <traces> {' '.join(args)}", "", printed.getvalue()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("call", type=Path, help="the folder the device tool returned (files_at)")
    parser.add_argument("--into", type=Path, required=True, help="the results folder the call belongs to")
    parser.add_argument("--name", required=True, help="the call's name in file names, e.g. open-ae")
    parser.add_argument("--gap-ms", type=float, default=150.0,
                        help="idle time that separates two points in the traces (open-loop runs: 1000)")  # fmt: skip
    parser.add_argument("--min-steps", type=int, default=50, help="leave out shorter runs (priming, probes)")
    parser.add_argument("--force", action="store_true", help="overwrite files already kept under this name")
    args = parser.parse_args(argv)

    summary, points = args.call / "summary.csv", args.call / "offswitch.json"
    if not summary.is_file():
        parser.error(f"{summary} not found: is {args.call} a device call's folder?")
    tars = sorted(args.call.glob("traces*.tar"))
    targets = {
        "csv": args.into / f"call-{args.name}.csv",
        "points": args.into / f"points-{args.name}.json",
        "traces": args.into / f"traces-{args.name}.md",
    }
    wanted = ["csv"] + (["points"] if points.is_file() else []) + (["traces"] if tars else [])
    taken = [str(targets[k]) for k in wanted if targets[k].exists()]
    if taken and not args.force:
        parser.error(f"already kept: {', '.join(taken)} (another --name, or --force)")

    args.into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(summary, targets["csv"])
    if "points" in wanted:
        call = without_hashes(json.loads(points.read_text()))
        targets["points"].write_text(json.dumps(call, indent=1) + "\n")
    if "traces" in wanted:
        print(f"reading {len(tars)} trace archive(s) ...", file=sys.stderr)
        targets["traces"].write_text(f"# Step records of call {args.name}\n\n" + trace_tables(tars, args.gap_ms, args.min_steps))
    for k in wanted:
        print(f"kept {targets[k]} ({targets[k].stat().st_size:,} bytes)")
    missing = [name for k, name in (("points", "offswitch.json"), ("traces", "traces*.tar")) if k not in wanted]
    if missing:
        print(f"not in the call: {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
