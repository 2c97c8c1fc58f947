"""Turn a device run's ``res.tar.gz`` into the committed results, traces and sim-vs-real report.

Runs here (CPU), after ``run.py`` came back from the device:

1. unpacks the tarball (and any ``prev_*`` results a warm machine kept) and merges the runs;
2. writes ``tables.md`` / ``results.json``: throughput and mean/p99 TPOT per policy and C for
   each acceptance level, the measured acceptance, greedy-output identity across policies,
   the depth switches SGLang logged, the ``kill -9`` test;
3. copies the controller's recorded traces into ``env/example_traces/h200-real-<level>/``;
4. refits the simulator on them (``controller fit``) per acceptance level and runs the same
   policies in it (``controller bench``): step-latency MAPE and throughput per C, sim vs real.

Usage: python bench/h200/analyze.py bench/results/h200/raw/run{1,2,6}_res.tar.xz --ppo bench/results/h200/ppo2/ppo.zip
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONCURRENCY = (1, 4, 16, 64)
DEPTHS = "0,1,3,5"


def load(tarballs: list[Path], work: Path) -> tuple[list[dict], list[dict], list[tuple[str, Path]]]:
    """(summaries, per-request rows, (call, result folder)) of the tarballs, in call order.

    Every run and row gets ``call`` = ``call1``, ``call2``, ... after its tarball (one tarball =
    one machine: numbers from different ones are not side by side). A machine kept warm across
    device calls packs the earlier calls' results too (``prev_*``); each result folder counts
    once, under the first tarball that holds it.
    """
    if work.exists():
        shutil.rmtree(work)
    summaries, rows, folders = [], [], []
    seen: set[float] = set()
    for i, tar_path in enumerate(tarballs, 1):
        # runN_res.tar.* is device call N: the label survives leaving superseded calls out.
        num = re.match(r"run(\d+)_", tar_path.name)
        call = f"call{num.group(1) if num else i}"
        dest = work / call
        dest.mkdir(parents=True)
        with tarfile.open(tar_path) as tar:
            tar.extractall(dest, filter="data")
        for folder in sorted((p.parent for p in dest.glob("res/**/summary.json")), key=lambda p: p.name):
            summary = json.loads((folder / "summary.json").read_text())
            if summary.get("started_unix") in seen:
                continue
            seen.add(summary.get("started_unix"))
            for m in summary.get("runs", []):
                m["call"] = call
            summary["call"] = call
            summaries.append(summary)
            folders.append((call, folder))
            req = folder / "requests.jsonl"
            if req.exists():
                for line in req.read_text().splitlines():
                    if line.strip():
                        row = json.loads(line)
                        row["call"] = call
                        rows.append(row)
    return summaries, rows, folders


def acceptance(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per level: measured per-draft acceptance at each static depth (from SGLang's histograms)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for m in rows:
        pol = m["policy"]
        if not pol.startswith("static:") or pol == "static:0":
            continue
        k = int(pol.split(":")[1])
        hist = m.get("accepted_drafts_histogram") or []
        n = sum(hist)
        if n:
            mean_acc = sum(i * c for i, c in enumerate(hist)) / n
            key = f"depth{k}"
            prev = out[m["server"]].get(key + "_n", 0)
            cur = out[m["server"]].get(key + "_sum", 0.0)
            out[m["server"]][key + "_n"] = prev + n
            out[m["server"]][key + "_sum"] = cur + mean_acc * n
    final: dict[str, dict[str, float]] = {}
    for level, d in out.items():
        final[level] = {}
        for key in [k for k in d if k.endswith("_n")]:
            base = key[:-2]
            k = int(base[5:])
            mean = d[base + "_sum"] / d[key]
            final[level][f"mean_accepted_of_{k}"] = round(mean, 3)
            final[level][f"accept_fraction_depth{k}"] = round(mean / k, 3)
    return final


def greedy_identity(rows: list[dict]) -> dict[str, Any]:
    """For each level and C: do all policies (in all calls) return the same ids for the same prompt?"""
    by: dict[tuple[str, int, int], dict[str, tuple[int, ...]]] = defaultdict(dict)
    for m in rows:
        for r in m.get("requests", []):
            if r.get("ok"):
                key = (m["server"], m["concurrency"], r["idx"])
                by[key][f"{m['call']}:{m['policy']}"] = tuple(r["output_ids"])
    total = same = 0
    distinct_outputs: set[tuple[int, ...]] = set()
    mismatches = []
    for key, outs in by.items():
        if len(outs) < 2:
            continue
        total += 1
        distinct_outputs.update(outs.values())
        if len(set(outs.values())) == 1:
            same += 1
        elif len(mismatches) < 5:
            mismatches.append({"level": key[0], "c": key[1], "idx": key[2], "policies": sorted(outs)})
    distinct_tokens = {t for o in distinct_outputs for t in o}
    return {
        "prompts_compared": total,
        "identical_across_policies": same,
        "distinct_tokens_in_outputs": len(distinct_tokens),
        "mismatch_examples": mismatches,
    }


def off_policy(m: dict) -> int:
    """Verifies that accepted more drafts than ``static:k`` allows: steps not run at depth k.

    Visible only when acceptance is high (a fallback step at depth 5 accepting 5 drafts).
    """
    pol = m["policy"]
    if not pol.startswith("static:"):
        return 0
    k = int(pol.split(":")[1])
    return sum((m.get("accepted_drafts_histogram") or [])[k + 1 :])


def table(runs: list[dict], level: str, call: str) -> list[str]:
    cell: dict[tuple[str, int], dict] = {}
    mine = [m for m in runs if m["server"] == level and m["call"] == call]
    for m in mine:
        cell[(m["policy"], m["concurrency"])] = m
    policies = list(dict.fromkeys(m["policy"] for m in mine))
    head = "| policy | " + " | ".join(f"C={c} tok/s | TPOT mean / p99 ms" for c in CONCURRENCY) + " |"
    lines = [head, "|---" * (1 + 2 * len(CONCURRENCY)) + "|"]
    for pol in policies:
        cells = []
        for c in CONCURRENCY:
            m = cell.get((pol, c))
            if m is None:
                cells += ["-", "-"]
            else:
                note = f" ({m['failed']} failed)" if m["failed"] else ""
                if off_policy(m):
                    note += f" [{off_policy(m)} fallback steps]"
                cells += [
                    f"{m['throughput_tok_s']:.0f}{note}",
                    f"{m['tpot_mean_ms']:.2f} / {m['tpot_p99_ms']:.2f}",
                ]
        lines.append(f"| {pol} | " + " | ".join(cells) + " |")
    return lines


def copy_traces(folders: list[tuple[str, Path]], dest_root: Path) -> None:
    """Copy each level's controller traces to ``dest_root/h200-real-<level>/<call>-<policy>-<file>.gz``.

    Gzipped the way the bundled examples are (the trace readers take both; 7× smaller).
    """
    from env.example_traces.make import gzip_in_place

    for call, folder in folders:
        troot = folder / "traces"
        if not troot.is_dir():
            continue
        for f in sorted(troot.glob("*/*/*.msgpack")):
            level, policy = f.parent.parent.name, f.parent.name
            d = dest_root / f"h200-real-{level}"
            d.mkdir(parents=True, exist_ok=True)
            gzip_in_place(Path(shutil.copy(f, d / f"{call}-{policy}-{f.name}")))


def hook_cost(folders: list[tuple[str, Path]]) -> tuple[list[str], list[dict]]:
    """The hook's own time per decode step inside the GPU scheduler (``hookprof_<level>.jsonl``)."""

    def pct(v: list[float], q: float) -> float:
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))]

    rows = []
    for call, folder in folders:
        for f in sorted(folder.glob("hookprof_*.jsonl")):
            prof: dict[str, list[int]] = {}
            for line in f.read_text().splitlines():
                for k, v in json.loads(line).items():
                    if isinstance(v, list):
                        prof.setdefault(k, []).extend(v)
            if not prof.get("hook_ns"):
                continue
            wall = [x / 1000 for x in prof["hook_ns"]]
            # From call 23, blocks of records alternate with and without the profiler's CPU-clock
            # reads (SPECDEPTH_PROFILE_CPU_CLOCK=alternate); CPU times exist only with them.
            clock = prof.get("cpu_clock") or [1] * len(wall)
            cpu = [x / 1000 for x, on in zip(prof["hook_cpu_ns"], clock, strict=True) if on]
            refs = [x / 1000 for x, on in zip(prof["ref_cpu_ns"], clock, strict=True) if on]
            step = [float(x) for x in prof["step_us"] if x > 0]
            level = f.stem.removeprefix("hookprof_")
            # The hook logs its client-thread mode (from call 9); calls up to 6 ran it inline.
            log = folder / f"server_{level}.log"
            found = (
                re.findall(
                    r"client thread (on|off)(?:, tick (\d+) ms)?(?:\)| \()", log.read_text(errors="replace")
                )
                if log.exists()
                else []
            )
            by_bs = {
                bs: pct([float(t) for t, b in zip(prof["step_us"], prof["bs"], strict=True) if b == bs], 0.5)
                for bs in (1, 4, 16, 64)
                if any(b == bs for b in prof["bs"])
            }
            rows.append(
                {
                    "call": call,
                    "level": level,
                    # Call 8 ran the thread before its mode was logged: its CPU time shows it.
                    "client_thread": (found[0][0] + (f", tick {found[0][1]} ms" if found[0][1] else ""))
                    if found
                    else "on"
                    if any(prof.get("sender_cpu_ns", []))
                    else "off",
                    "step_p50_by_bs_us": by_bs,
                    "steps": len(wall),
                    "wall_p50_us": pct(wall, 0.5),
                    "wall_p99_us": pct(wall, 0.99),
                    "cpu_p50_us": pct(cpu, 0.5),
                    "cpu_p99_us": pct(cpu, 0.99),
                    "ref_cpu_p50_us": pct(refs, 0.5),
                    # Wall p50 / p99 and steps, with the CPU clock read around the windows and without.
                    "clock_split": [
                        (*_p50_p99(pct, v), len(v))
                        for want in (1, 0)
                        if (v := [w for w, on in zip(wall, clock, strict=True) if on == want])
                    ],
                    "step_p50_us": pct(step, 0.5) if step else float("nan"),
                    # By call site (wall p50): the record (of which the client's socket visit),
                    # the visits at the top of scheduler iterations. Older profiles lack them.
                    **{
                        f"{site}_p50_us": pct([x / 1000 for x in prof[f"{site}_ns"]], 0.5)
                        for site in ("rec", "send", "poll", "wrap", "sender_cpu", "lag")
                        if prof.get(f"{site}_ns")
                    },
                    "sender_cpu_p99_us": pct([x / 1000 for x in prof.get("sender_cpu_ns") or [0]], 0.99),
                    # The tail's make-up: hook wall time by batch size, on steps whose window
                    # held one scheduler iteration, and without garbage collections (from call 14).
                    "wall_by_bs_us": {
                        bs: (pct(v, 0.5), pct(v, 0.99))
                        for bs in (1, 4, 16, 64)
                        if (v := [w for w, b in zip(wall, prof["bs"], strict=True) if b == bs])
                    },
                    # None on a replica of one rank (from call 23): no iteration tops are hooked.
                    "one_iteration": _p50_p99(
                        pct, [w for w, n in zip(wall, prof["polls"], strict=True) if n == 1]
                    )
                    if any(prof["polls"])
                    else None,
                    # Per scheduler iteration that processed a batch result (from call 15).
                    "per_iteration": _p50_p99(pct, [x / 1000 for x in prof.get("iter_ns", [])]),
                    "iterations": len(prof.get("iter_ns", [])),
                    # The top 1% of steps: the longest single window's share of their hook time,
                    # and its site (from call 19): one slow window, or many cold ones?
                    "tail_window": _tail_window(pct, wall, prof),
                    "record_by_wait": _record_by_wait(prof),
                    "gc_steps": sum(1 for g in prof.get("gc_ns", []) if g > 0) if prof.get("gc_ns") else None,
                    "no_gc": _p50_p99(pct, [w - g / 1000 for w, g in zip(wall, prof["gc_ns"], strict=True)])
                    if prof.get("gc_ns")
                    else None,
                }
            )
    # "socket" is the client's visit to ZeroMQ until call 6; from call 8 the hand-over to the
    # client thread, whose own CPU time (off the scheduler thread) has its own column.
    lines = ["### the hook's time per decode step, inside the GPU scheduler (entry rank)", "",
             "| call | level | client thread | steps | wall p50 / p99 µs | CPU p50 / p99 µs | record / socket or"
             " hand-over / iteration-top / wrapper p50 µs | client thread CPU p50 / p99 µs, record→send p50 µs"
             " | step p50 µs | hook / step | step p50 µs at bs 1 / 4 / 16 / 64 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        sites = " / ".join(
            f"{r[k]:.1f}" if k in r else "–"
            for k in ("rec_p50_us", "send_p50_us", "poll_p50_us", "wrap_p50_us")
        )
        thread = (
            f"{r['sender_cpu_p50_us']:.1f} / {r['sender_cpu_p99_us']:.1f}, {r['lag_p50_us']:.1f}"
            if r["client_thread"].startswith("on") and "sender_cpu_p50_us" in r
            else "–"
        )
        by_bs = " / ".join(
            f"{r['step_p50_by_bs_us'][bs]:.0f}" if bs in r["step_p50_by_bs_us"] else "–"
            for bs in (1, 4, 16, 64)
        )
        lines.append(
            f"| {r['call']} | {r['level']} | {r['client_thread']} | {r['steps']} | "
            f"{r['wall_p50_us']:.1f} / {r['wall_p99_us']:.1f} | {r['cpu_p50_us']:.1f} / {r['cpu_p99_us']:.1f} | "
            f"{sites} | {thread} | {r['step_p50_us']:.0f} | {100 * r['wall_p50_us'] / r['step_p50_us']:.2f}% | "
            f"{by_bs} |"
        )
    lines += ["", "### the hook's wall time per decode step: its tail", "",
              "| call | level | p50 / p99 µs at bs 1 / 4 / 16 / 64 | steps of one scheduler iteration p50 / p99 |"
              " steps with a GC in the hook's windows | p50 / p99 without the GC's time |"
              " per scheduler iteration with a batch result (decode or prefill): n, p50 / p99 |"
              " top 1% of steps: the longest window's share, its site (record / top / wrapper) |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        by_bs = " · ".join(
            f"{r['wall_by_bs_us'][bs][0]:.1f} / {r['wall_by_bs_us'][bs][1]:.1f}"
            if bs in r["wall_by_bs_us"]
            else "–"
            for bs in (1, 4, 16, 64)
        )
        one = r["one_iteration"]
        one_cell = "– (no iteration tops)" if one is None else f"{one[0]:.1f} / {one[1]:.1f}"
        gc_steps = "–" if r["gc_steps"] is None else f"{r['gc_steps']} of {r['steps']}"
        no_gc = "–" if r["no_gc"] is None else f"{r['no_gc'][0]:.1f} / {r['no_gc'][1]:.1f}"
        it = r["per_iteration"]
        per_it = f"{r['iterations']}, {it[0]:.1f} / {it[1]:.1f}" if r["iterations"] else "–"
        tw = r["tail_window"]
        tail = "–" if tw is None else f"{tw[0]:.0%}, {tw[1]} / {tw[2]} / {tw[3]}"
        lines.append(
            f"| {r['call']} | {r['level']} | {by_bs} | {one_cell} | {gc_steps} | {no_gc} | {per_it} | {tail} |"
        )
    split = [r for r in rows if len(r["clock_split"]) == 2]
    if split:
        lines += ["", "### the profiler's own clock: the hook's wall time per decode step, blocks of 32 records"
                  " with and without the thread-CPU clock's reads (a syscall each) around its windows", "",
                  "| call | level | with: steps, p50 / p99 µs | without: steps, p50 / p99 µs | p50 / p99 without ÷ with |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in split:
            (a50, a99, an), (b50, b99, bn) = r["clock_split"]
            lines.append(
                f"| {r['call']} | {r['level']} | {an}, {a50:.1f} / {a99:.1f} | {bn}, {b50:.1f} / {b99:.1f} | "
                f"{b50 / a50:.2f} / {b99 / a99:.2f} |"
            )
    lines += ["", "### the record's window against the step's length: within a batch-size bucket, steps split"
              " into thirds by step time (the scheduler thread's wait on the GPU grows with it)", "",
              "| call | level | batch sizes | steps | step p50 µs, shortest / longest third | record window p50 µs,"
              " shortest / longest third | hand-over p50 µs, shortest / longest third |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for lo, hi, n, steps, rec, send in r["record_by_wait"]:
            lines.append(
                f"| {r['call']} | {r['level']} | {lo}-{hi} | {n} | {steps[0]:.0f} / {steps[1]:.0f} | "
                f"{rec[0]:.1f} / {rec[1]:.1f} | {send[0]:.1f} / {send[1]:.1f} |"
            )
    return lines + [""], rows


def _record_by_wait(prof: dict[str, list[int]]) -> list[tuple[Any, ...]]:
    """Per batch-size bucket: the record window's and the hand-over's p50 (µs) on the shortest and
    the longest third of its steps by step time; a step's record runs after the scheduler thread
    waited on the GPU for about that step, so a cost that grows with the wait shows here."""
    if not prof.get("rec_ns") or not prof.get("send_ns"):  # profiles before call 11
        return []
    rows = list(zip(prof["rec_ns"], prof["send_ns"], prof["step_us"], prof["bs"], strict=True))
    out = []
    for lo, hi in ((1, 1), (2, 4), (5, 16), (17, 32), (33, 64)):
        sel = sorted((r for r in rows if lo <= r[3] <= hi and r[2] > 0), key=lambda r: r[2])
        k = len(sel) // 3
        if k < 10:
            continue
        thirds = (sel[:k], sel[-k:])

        def med(i: int, scale: float, parts: tuple[list[Any], ...] = thirds) -> tuple[float, float]:
            short, long = (statistics.median(r[i] for r in part) / scale for part in parts)
            return short, long

        out.append((lo, hi, len(sel), med(2, 1.0), med(0, 1000.0), med(1, 1000.0)))
    return out


def _tail_window(
    pct: Any, wall: list[float], prof: dict[str, list[int]]
) -> tuple[float, int, int, int] | None:
    """Over the top 1% of steps by hook time: the mean share of the longest window, and how
    many of those windows were the record's, an iteration top's, the wrapper's."""
    from sglang_hook.profiler import PROFILE_SITES  # max_window_site is an index into it

    longest, site = prof.get("max_window_ns"), prof.get("max_window_site")
    if not longest or not site:
        return None
    cut = pct(wall, 0.99)
    top = [i for i, w in enumerate(wall) if w >= cut and w > 0]
    share = sum(longest[i] / 1000 / wall[i] for i in top) / len(top)
    kinds = [PROFILE_SITES.index(name) for name in ("rec", "poll", "wrap")]
    return (share, *(sum(1 for i in top if site[i] == k) for k in kinds))


def _p50_p99(pct: Any, values: list[float]) -> tuple[float, float]:
    return (pct(values, 0.5), pct(values, 0.99)) if values else (float("nan"), float("nan"))


def controller(*args: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "controller.cli", *args], capture_output=True, text=True, cwd=REPO
    )
    if p.returncode != 0:
        return f"FAILED rc={p.returncode}: {p.stderr.strip()[-800:]}"
    return p.stdout


BS_BUCKETS = {1: (1, 1), 4: (2, 4), 16: (5, 16), 64: (17, 64)}


def step_mape_per_c(sim_json: Path, traces: Path) -> dict[int, tuple[float, int]]:
    """Step-latency MAPE of the fitted model on the traces' steps, by batch-size bucket of each C."""
    from env.fit import load_steps, step_mape
    from env.params import SimParams

    params = SimParams.from_json(sim_json)
    steps = [s for v in load_steps(str(traces)).values() for s in v]
    out = {}
    for c, (lo, hi) in BS_BUCKETS.items():
        sub = [s for s in steps if lo <= s.bs <= hi]
        if sub:
            out[c] = (step_mape(params.latency, sub), len(sub))
    return out


def sim_vs_real(
    level: str, traces: Path, out: Path, runs: list[dict], ppo: Path | None
) -> tuple[list[str], dict]:
    sim_json = out / f"sim_{level}.json"
    fit_text = controller("fit", "--traces", str(traces), "--out", str(sim_json))
    report: dict[str, Any] = {"fit_stdout": fit_text}
    rep_path = sim_json.with_suffix(".report.json")
    if rep_path.exists():
        report["fit"] = json.loads(rep_path.read_text())
    lines = [f"### level `{level}`: simulator refitted on this level's traces ({traces.name})", "",
             "```", fit_text.strip(), "```", ""]  # fmt: skip
    if sim_json.exists():
        per_c = step_mape_per_c(sim_json, traces)
        report["step_mape_per_c"] = {str(c): {"mape_pct": m, "steps": n} for c, (m, n) in per_c.items()}
        lines += ["| C (batch sizes) | steps | step-latency MAPE % (fit on all) |", "|---|---|---|"]
        for c, (m, n) in per_c.items():
            lo, hi = BS_BUCKETS[c]
            lines.append(f"| {c} (bs {lo}-{hi}) | {n} | {m:.1f} |")
        lines.append("")
    real: dict[tuple[str, int], float] = {}
    for m in runs:  # later calls override earlier ones (call 2 re-measured with the warm-up fix)
        if m["server"] == level and not off_policy(m):
            real[(m["policy"], m["concurrency"])] = m["throughput_tok_s"]
    lines += ["| policy | C | real tok/s | sim tok/s | sim error % |", "|---|---|---|---|---|"]
    report["throughput"] = []
    for pol in sorted({p for p, _ in real}):
        if pol == "sglang-adaptive":
            spec = "builtin:sglang-adaptive"
        elif pol.startswith("static:"):
            spec = "builtin:" + pol
        elif pol == "ppo" and ppo is not None:
            spec = str(ppo)
        else:
            continue
        jpath = out / f"simbench_{level}_{pol.replace(':', '-')}.json"
        controller("bench", "--sim", str(sim_json), "--policy", spec, "--concurrency",
                   ",".join(map(str, CONCURRENCY)), "--depths", DEPTHS, "--duration-s", "60",
                   "--workload", "closed:{C}@prompt=256,output=128", "--json", str(jpath))  # fmt: skip
        if not jpath.exists():
            continue
        for r in json.loads(jpath.read_text())["results"]:
            c = r["concurrency"]
            if (pol, c) in real:
                err = 100.0 * (r["throughput_tok_s"] - real[(pol, c)]) / real[(pol, c)]
                report["throughput"].append(
                    {
                        "policy": pol,
                        "c": c,
                        "real": real[(pol, c)],
                        "sim": r["throughput_tok_s"],
                        "err_pct": err,
                    }
                )
                lines.append(
                    f"| {pol} | {c} | {real[(pol, c)]:.0f} | {r['throughput_tok_s']:.0f} | {err:+.1f} |"
                )
    errs = [abs(x["err_pct"]) for x in report["throughput"]]
    if errs:
        lines.append(
            f"\nmean |throughput error| {sum(errs) / len(errs):.1f}% over {len(errs)} (policy, C) points"
        )
    lines.append("")
    return lines, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tarballs", type=Path, nargs="+", help="res.tar.gz of each device call, in order")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/h200")
    parser.add_argument("--traces-root", type=Path, default=REPO / "env/example_traces")
    parser.add_argument("--ppo", type=Path, default=REPO / "bench/results/h200/ppo2/ppo.zip")
    parser.add_argument("--no-sim", action="store_true")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    summaries, rows, folders = load(args.tarballs, Path("/tmp/h200/analyze"))
    runs = [m for s in summaries for m in s.get("runs", [])]
    levels = list(dict.fromkeys(m["server"] for m in runs))
    calls = list(dict.fromkeys(m["call"] for m in runs))
    kill9 = next((s["kill9"] for s in summaries if s.get("kill9")), None)
    result: dict[str, Any] = {
        "devices": {s["call"]: s.get("device") for s in summaries},
        "models": next((s["models"] for s in summaries if s.get("models")), None),
        "acceptance": acceptance([m for m in runs if not off_policy(m)]),
        "greedy_identity": greedy_identity(rows),
        "kill9": kill9,
        "servers": [
            dict(e, call=s["call"])
            for s in summaries
            for e in s.get("events", [])
            if e.get("what") == "server"
        ],
        "policy_switches": [
            dict(e, call=s["call"])
            for s in summaries
            for e in s.get("events", [])
            if e.get("what") == "policy_done"
        ],
        "runs": runs,
    }
    md, result["hook_cost"] = hook_cost(folders)
    for level in levels:
        for call in calls:
            if any(m["server"] == level and m["call"] == call for m in runs):
                md += [f"### level `{level}`, {call}", ""] + table(runs, level, call) + [""]
    if not args.no_sim:
        copy_traces(folders, args.traces_root)
        # The committed raw tarballs leave the traces out (they are in the example folders,
        # gzipped): refit on every trace of each level found there.
        traces = {
            level: args.traces_root / f"h200-real-{level}"
            for level in levels
            if (args.traces_root / f"h200-real-{level}").is_dir()
        }
        result["sim_vs_real"] = {}
        for level, tdir in traces.items():
            lines, rep = sim_vs_real(level, tdir, args.out, runs, args.ppo)
            md += lines
            result["sim_vs_real"][level] = rep
    (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (args.out / "tables.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(
        json.dumps({k: result[k] for k in ("acceptance", "greedy_identity", "kill9")}, indent=1, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
