"""Turn the ``realgpu.py`` calls' results into the README table and the issue's done-criteria.

Runs here (CPU, stdlib only) on the folders the device calls returned, each holding that
call's ``summary.csv`` and (optionally) ``offswitch.json``. Repetition numbers are unique
across calls (``realgpu.py --first-rep``), so every ratio below is taken inside one
repetition, that is inside one call on one machine, and then summarised over repetitions.

Per (workload, C, policy): tok/s and mean TPOT as mean and min-max over repetitions; the ratio
of tok/s to ``plain`` and to the best static depth (the ``static:K`` with the highest mean tok/s
at that workload and C), each taken per repetition. Criteria, for each controller policy
(``ppo``, ``ppo-retrained``):

  plain       closed-loop workloads: tok/s >= 0.99 x plain at every C (mean ratio)
  static      closed-loop workloads: >= 0.99 x the best static depth at every C
  sglang      closed-loop workloads: >= 1.00 x both SGLang rules at every C
  open        the shifting trace: mean TPOT below, and tok/s >= 0.99 x, every other policy
  failed      no failed request in any row (every policy, every workload)
  identity    greedy outputs of every request equal to ``plain``'s (from ``out_hash``)

A criterion with nothing to judge (a workload not measured) says ``n/a``, never ``yes``. Calls
measured on different GPUs (``offswitch.json``'s ``device``) are refused: report each apart.

``--metric steady`` judges the same criteria on each point's throughput while all C clients
were busy (``steady_tok_s`` in ``offswitch.json``, ``loadgen.steady_throughput``) instead of
the whole point's: short closed-loop points are mostly ramp and drain. Points without it
(calls before it existed, open-loop points) are left out.

Usage: python bench/h200/realgpu_report.py CALL_DIR... [--metric steady] [--csv merged.csv] [--md table.md]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIELDS = ("workload", "concurrency", "policy", "rep", "tok_s", "tpot_ms_mean", "tpot_ms_p99", "failed")
CONTROLLERS = ("ppo", "ppo-retrained")
SGLANG_RULES = ("sglang-adaptive-default", "sglang-adaptive-tuned")
PLAIN_BAR = 0.99
STATIC_BAR = 0.99
SGLANG_BAR = 1.0
OPEN_TOK_BAR = 0.99
MEASURED = ("closed", "long", "open")  # workload prefixes of the proof (accept/resume are diagnostics)
STATIC = re.compile(r"static:(\d+)")  # a static depth (not static:0-skip and the like)


def _row(r: dict[str, Any], tok_s: Any) -> dict[str, Any]:
    """A ``summary.csv`` row (or an ``offswitch.json`` point), typed, with ``tok_s`` as given."""
    return {"workload": r["workload"], "concurrency": int(r["concurrency"]), "policy": r["policy"],
            "rep": int(r["rep"]), "tok_s": float(tok_s), "tpot_ms_mean": float(r["tpot_ms_mean"]),
            "tpot_ms_p99": float(r["tpot_ms_p99"]), "failed": int(r["failed"])}  # fmt: skip


def _points_file(p: Path) -> Path:
    """A call's ``offswitch.json``: in its folder, or beside its ``summary.csv``."""
    return p / "offswitch.json" if p.is_dir() else p.with_name("offswitch.json")


def _points(paths: Iterable[Path]) -> Iterable[dict[str, Any]]:
    """The proof's points of the calls' ``offswitch.json`` (calls without one add none)."""
    for p in paths:
        f = _points_file(p)
        if f.exists():
            yield from (pt for pt in json.loads(f.read_text()).get("points", []) if pt["workload"].startswith(MEASURED))


def read_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The rows of ``summary.csv`` files (or folders holding one), typed; the proof's workloads only."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        f = p / "summary.csv" if p.is_dir() else p
        with open(f, newline="") as fh:
            rows += [_row(r, r["tok_s"]) for r in csv.DictReader(fh) if r["workload"].startswith(MEASURED)]
    return rows


def read_steady_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """:func:`read_rows`' rows with ``tok_s`` = the point's ``steady_tok_s``, from the calls'
    ``offswitch.json``; points without it are left out."""
    return [_row(pt, pt["steady_tok_s"]) for pt in _points(paths) if pt.get("steady_tok_s") is not None]


def read_hashes(paths: Iterable[Path]) -> dict[tuple[str, int, int, str], list[str]]:
    """Per (workload, C, rep, policy): each request's output hash, from the calls' ``offswitch.json``."""
    return {
        (pt["workload"], int(pt["concurrency"]), int(pt["rep"]), pt["policy"]): pt["out_hash"]
        for pt in _points(paths)
        if "out_hash" in pt
    }


def read_devices(paths: Iterable[Path]) -> dict[str, str]:
    """Per call folder, the GPU its ``offswitch.json`` names (``nvidia-smi``'s first field)."""
    out: dict[str, str] = {}
    for p in paths:
        f = _points_file(p)
        if f.exists():
            smi = str(json.loads(f.read_text()).get("device", {}).get("nvidia_smi", ""))
            out[str(p)] = smi.split(",")[0].strip() or "unknown"
    return out


@dataclass
class Cell:
    """One (workload, C, policy): per-repetition values and ratios."""

    tok_s: dict[int, float] = field(default_factory=dict)
    tpot: dict[int, float] = field(default_factory=dict)
    to_plain: dict[int, float] = field(default_factory=dict)
    to_static: dict[int, float] = field(default_factory=dict)
    failed: int = 0


def _spread(values: Iterable[float], fmt: str = "{:.3f}") -> str:
    v = list(values)
    if not v:
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(statistics.fmean(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"


def cells(rows: list[dict[str, Any]]) -> tuple[dict[tuple[str, int, str], Cell], dict[tuple[str, int], str]]:
    """Cells per (workload, C, policy), and the best static depth per (workload, C)."""
    out: dict[tuple[str, int, str], Cell] = defaultdict(Cell)
    for r in rows:
        cell = out[(r["workload"], r["concurrency"], r["policy"])]
        cell.tok_s[r["rep"]] = r["tok_s"]
        cell.tpot[r["rep"]] = r["tpot_ms_mean"]
        cell.failed += r["failed"]
    best: dict[tuple[str, int], str] = {}
    for (w, c, p), cell in out.items():
        if STATIC.fullmatch(p):
            cur = best.get((w, c))
            if cur is None or statistics.fmean(cell.tok_s.values()) > statistics.fmean(
                out[(w, c, cur)].tok_s.values()
            ):
                best[(w, c)] = p
    for (w, c, _p), cell in out.items():
        plain = out.get((w, c, "plain"))
        static = out.get((w, c, best[(w, c)])) if (w, c) in best else None
        for rep, v in cell.tok_s.items():
            if plain is not None and plain.tok_s.get(rep):
                cell.to_plain[rep] = v / plain.tok_s[rep]
            if static is not None and static.tok_s.get(rep):
                cell.to_static[rep] = v / static.tok_s[rep]
    return dict(out), best


def _paired(a: Cell, b: Cell) -> list[float]:
    return [a.tok_s[r] / b.tok_s[r] for r in a.tok_s if r in b.tok_s and b.tok_s[r] > 0]


def criteria(
    rows: list[dict[str, Any]], hashes: dict[tuple[str, int, int, str], list[str]] | None = None
) -> dict[str, dict[str, Any]]:
    """Each criterion (module docstring) per controller policy: ``holds`` (True/False/None for
    n/a) and ``why`` (the points that miss, or what was compared)."""
    table, best = cells(rows)
    out: dict[str, dict[str, Any]] = {}
    closed_keys = sorted({(w, c) for (w, c, _) in table if not w.startswith("open")})
    open_keys = sorted({(w, c) for (w, c, _) in table if w.startswith("open")})
    for ctl in CONTROLLERS:
        if not any(p == ctl for (_, _, p) in table):
            continue
        res: dict[str, Any] = {}
        miss_plain, miss_static, miss_sglang, judged = [], [], [], 0
        for w, c in closed_keys:
            mine = table.get((w, c, ctl))
            if mine is None:
                continue
            judged += 1
            if mine.to_plain and statistics.fmean(mine.to_plain.values()) < PLAIN_BAR:
                miss_plain.append(f"{w} C={c}: {statistics.fmean(mine.to_plain.values()):.3f}")
            if mine.to_static and statistics.fmean(mine.to_static.values()) < STATIC_BAR:
                miss_static.append(
                    f"{w} C={c}: {statistics.fmean(mine.to_static.values()):.3f} of {best[(w, c)]}"
                )
            for rule in SGLANG_RULES:
                other = table.get((w, c, rule))
                ratios = _paired(mine, other) if other else []
                if ratios and statistics.fmean(ratios) < SGLANG_BAR:
                    miss_sglang.append(f"{w} C={c}: {statistics.fmean(ratios):.3f} of {rule}")
        has_plain = any(table[(w, c, ctl)].to_plain for w, c in closed_keys if (w, c, ctl) in table)
        has_static = any(table[(w, c, ctl)].to_static for w, c in closed_keys if (w, c, ctl) in table)
        has_sglang = any((w, c, r) in table for w, c in closed_keys for r in SGLANG_RULES)
        res["plain"] = _verdict(judged and has_plain, miss_plain)
        res["static"] = _verdict(judged and has_static, miss_static)
        res["sglang"] = _verdict(judged and has_sglang, miss_sglang)
        miss_open, judged_open = [], 0
        for w, c in open_keys:
            mine = table.get((w, c, ctl))
            if mine is None:
                continue
            for (w2, c2, p), other in table.items():
                if (w2, c2) != (w, c) or p in CONTROLLERS:
                    continue
                judged_open += 1
                tpot_mine, tpot_other = (
                    statistics.fmean(mine.tpot.values()),
                    statistics.fmean(other.tpot.values()),
                )
                ratios = _paired(mine, other)
                tok = statistics.fmean(ratios) if ratios else None
                if tpot_mine >= tpot_other or (tok is not None and tok < OPEN_TOK_BAR):
                    miss_open.append(
                        f"{w} vs {p}: TPOT {tpot_mine:.2f} vs {tpot_other:.2f} ms, tok/s ratio {tok}"
                    )
        res["open"] = _verdict(judged_open > 0, miss_open)
        out[ctl] = res
    failed = [
        f"{r['workload']} C={r['concurrency']} {r['policy']} rep {r['rep']}: {r['failed']}"
        for r in rows
        if r["failed"]
    ]
    out["all"] = {"failed": _verdict(bool(rows), failed)}
    if hashes is not None:
        out["all"]["identity"] = identity(hashes)
    return out


def identity(hashes: dict[tuple[str, int, int, str], list[str]]) -> dict[str, Any]:
    """Requests whose greedy output differs from ``plain``'s on the same (workload, C, rep)."""
    compared = differing = 0
    where: list[str] = []
    for (w, c, rep, p), mine in sorted(hashes.items()):
        plain = hashes.get((w, c, rep, "plain"))
        if p == "plain" or plain is None:
            continue
        diff = sum(a != b for a, b in zip(mine, plain)) + abs(len(mine) - len(plain))
        compared += len(plain)
        differing += diff
        if diff:
            where.append(f"{w} C={c} rep {rep} {p}: {diff}/{len(plain)}")
    return {"holds": (differing == 0) if compared else None, "compared": compared, "differing": differing,
            "why": where[:40]}  # fmt: skip


def _verdict(judged: Any, misses: list[str]) -> dict[str, Any]:
    return {"holds": (not misses) if judged else None, "why": misses}


def markdown(rows: list[dict[str, Any]], crit: dict[str, dict[str, Any]]) -> str:
    """The README table: per workload, C and policy, tok/s, TPOT and the two ratios."""
    table, best = cells(rows)
    lines: list[str] = []
    for w in sorted({k[0] for k in table}):
        lines += [f"### {w}", "", "| C | policy | reps | tok/s mean (min-max) | TPOT ms mean (min-max) | "
                  "÷ plain | ÷ best static | failed |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in sorted({k[1] for k in table if k[0] == w}):
            for p in sorted({k[2] for k in table if k[:2] == (w, c)}, key=_order):
                cell = table[(w, c, p)]
                mark = " (best static)" if best.get((w, c)) == p else ""
                lines.append(
                    f"| {c} | {p}{mark} | {len(cell.tok_s)} | {_spread(cell.tok_s.values(), '{:.0f}')} | "
                    f"{_spread(cell.tpot.values(), '{:.2f}')} | {_spread(cell.to_plain.values())} | "
                    f"{_spread(cell.to_static.values())} | {cell.failed} |"
                )
        lines.append("")
    lines += [
        "### Done-criteria",
        "",
        "| policy | criterion | holds | where it misses |",
        "|---|---|---|---|",
    ]
    for who, res in crit.items():
        for name, v in res.items():
            holds = {True: "yes", False: "**no**", None: "n/a"}[v["holds"]]
            lines.append(f"| {who} | {name} | {holds} | {'; '.join(v['why'][:6])} |")
    return "\n".join(lines) + "\n"


def _order(policy: str) -> tuple[int, str]:
    head = ["plain", *SGLANG_RULES]
    if policy in head:
        return (head.index(policy), policy)
    m = STATIC.fullmatch(policy)
    if m:
        return (10, f"{int(m.group(1)):03d}")
    if policy in CONTROLLERS:
        return (30 + CONTROLLERS.index(policy), policy)
    return (20, policy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "calls", type=Path, nargs="+", help="call folders (summary.csv [+ offswitch.json]) or csv files"
    )
    parser.add_argument(
        "--metric", choices=("point", "steady"), default="point",
        help="tok/s of the whole point (summary.csv), or while all C clients were busy (offswitch.json)",
    )  # fmt: skip
    parser.add_argument("--csv", type=Path, help="write the merged summary.csv here")
    parser.add_argument("--md", type=Path, help="write the markdown table and criteria here")
    parser.add_argument("--json", type=Path, help="write the criteria as JSON here")
    args = parser.parse_args(argv)
    rows = read_rows(args.calls) if args.metric == "point" else read_steady_rows(args.calls)
    if not rows:
        print(f"realgpu_report: error: no {args.metric} rows in {[str(c) for c in args.calls]}", file=sys.stderr)
        return 2
    seen: dict[tuple[str, int, str, int], int] = {}
    for r in rows:
        key = (r["workload"], r["concurrency"], r["policy"], r["rep"])
        seen[key] = seen.get(key, 0) + 1
    dup = [k for k, n in seen.items() if n > 1]
    if dup:
        print(f"realgpu_report: error: repetitions measured twice (give each call its own --first-rep): {dup[:5]}",
              file=sys.stderr)  # fmt: skip
        return 2
    gpus = read_devices(args.calls)
    if len(set(gpus.values())) > 1:  # an H100's ratios are not an H200's: one table per device
        print(f"realgpu_report: error: calls from different GPUs, report them apart: {gpus}", file=sys.stderr)
        return 2
    crit = criteria(rows, read_hashes(args.calls))
    md = markdown(rows, crit)
    if args.metric == "steady":
        md = "tok/s while all C clients were busy (`steady_tok_s`), not over whole points\n\n" + md
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(
                sorted(rows, key=lambda r: (r["workload"], r["concurrency"], r["rep"], _order(r["policy"])))
            )
    if args.md:
        args.md.write_text(md)
    if args.json:
        args.json.write_text(json.dumps(crit, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
