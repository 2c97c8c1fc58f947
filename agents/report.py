"""Eval outputs: the target checks, ``report.md``, ``results.json`` and the PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from controller.baselines import BASELINES


def _score(results: dict[str, Any], spec: str, policy: str) -> float:
    return float(results["workloads"][spec]["policies"][policy]["score"]["mean"])


def _ratio(results: dict[str, Any], spec: str, a: str, b: str) -> float:
    """score(a) / score(b) on ``spec``; NaN when b scored nothing (e.g. no request completed)."""
    den = _score(results, spec, b)
    num = _score(results, spec, a)
    return num / den if den > 0 and math.isfinite(den) and math.isfinite(num) else float("nan")


def check_targets(results: dict[str, Any], learned: str = "ppo") -> list[dict[str, Any]]:
    """The issue's targets for policy ``learned``, each with its measured value and margin."""
    wls = results["workloads"]
    pols = next(iter(wls.values()))["policies"] if wls else {}
    if learned not in pols:
        return []
    statics = [p for p in pols if p.startswith("static:")]
    adaptive = [p for p in BASELINES if p in pols]
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, threshold: float, detail: str) -> None:
        out.append(
            {
                "name": name,
                "value": value,
                "threshold": threshold,
                "passed": bool(value >= threshold),
                "detail": detail,
            }
        )

    closed = [s for s, w in wls.items() if w["family"] == "closed"]
    if closed and statics:
        ratios = {}
        for s in closed:
            best = max(statics, key=lambda p: _score(results, s, p))
            ratios[s] = (_ratio(results, s, learned, best), best)
        worst = min(ratios, key=lambda s: _nan_last(ratios[s][0]))
        add(
            "closed loop: PPO / best static, worst C",
            ratios[worst][0],
            0.99,
            f"worst at {worst} (best static there: {ratios[worst][1]})",
        )
        if "static:0" in pols:
            r0 = {s: _ratio(results, s, learned, "static:0") for s in closed}
            w0 = min(r0, key=lambda s: _nan_last(r0[s]))
            add("closed loop: PPO / static:0, worst C", r0[w0], 1.0, f"worst at {w0}")
        c1 = next((s for s in closed if wls[s]["x"] == 1.0), None)
        if c1 is not None:
            add("C=1: PPO / best static", ratios[c1][0], 0.99, f"best static at C=1: {ratios[c1][1]}")
    ns = [s for s, w in wls.items() if w["family"] == "nonstationary"]
    if ns and adaptive:
        per = {b: float(np.nanmean([_ratio(results, s, learned, b) for s in ns])) for b in adaptive}
        best_b = min(per, key=lambda b: _nan_last(per[b]))
        add(
            "non-stationary: PPO / best adaptive baseline, mean over workloads",
            per[best_b],
            1.03,
            "per baseline: " + ", ".join(f"{b} {v:.3f}" for b, v in per.items()),
        )
    if adaptive:
        worst_r, where = float("inf"), ""
        for s in wls:
            for b in adaptive:
                r = _ratio(results, s, learned, b)
                if r < worst_r:
                    worst_r, where = r, f"{b} on {s}"
        add("any workload: PPO / each adaptive baseline, worst", worst_r, 0.99, where)
    if "oracle" in pols:
        vs_oracle = {s: _ratio(results, s, learned, "oracle") for s in wls}
        w = min(vs_oracle, key=lambda s: _nan_last(vs_oracle[s]))
        add(
            "PPO / oracle, worst workload",
            vs_oracle[w],
            0.95,
            f"worst at {w}; mean {np.nanmean(list(vs_oracle.values())):.3f}",
        )
    return out


def _nan_last(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


def _fmt(stats: dict[str, Any], key: str, digits: int = 0) -> str:
    s = stats[key]
    half = (s["ci95"][1] - s["ci95"][0]) / 2
    return f"{s['mean']:.{digits}f} ± {half:.{digits}f}"


def write_eval_outputs(results: dict[str, Any], out: Path, notes: str = "") -> Path:
    """Write ``results.json``, ``report.md`` and plots into ``out``; returns the report path."""
    learned = "ppo" if any("ppo" in w["policies"] for w in results["workloads"].values()) else None
    results["targets"] = check_targets(results, learned) if learned else []
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plots = _plots(results, out)
    lines = [
        f"# Evaluation: {results['sim']}",
        "",
        f"Depths {results['depths']}; seeds {results['seeds']} (the same for every policy); "
        f"capacity ≈ {results.get('capacity_req_s', 0):.2f} req/s; wall time {results.get('wall_s', 0):.0f} s.",
        "Scores: closed loop → throughput (tokens/s); open loop → per-request decode speed (1000 / mean TPOT, "
        "tokens/s). Values are mean ± 95% CI half-width over seeds.",
        "",
    ]
    if results["targets"]:
        lines += ["## Targets", "", "| target | value | threshold | met |", "|---|---|---|---|"]
        for t in results["targets"]:
            mark = "yes" if t["passed"] else f"**no** (short by {t['threshold'] - t['value']:.3f})"
            lines.append(
                f"| {t['name']} ({t['detail']}) | {t['value']:.3f} | {t['threshold']:.2f} | {mark} |"
            )
        lines.append("")
    if notes:
        lines += [notes, ""]
    fams = [
        ("closed", "Closed loop"),
        ("poisson", "Open loop (Poisson)"),
        ("nonstationary", "Non-stationary"),
    ]
    for fam, title in fams:
        specs = [s for s, w in results["workloads"].items() if w["family"] == fam]
        if not specs:
            continue
        pols = list(results["workloads"][specs[0]]["policies"])
        lines += [f"## {title}", ""]
        key = results["workloads"][specs[0]]["score_metric"] if fam != "nonstationary" else "score"
        lines.append("| policy | " + " | ".join(results["workloads"][s]["label"] or s for s in specs) + " |")
        lines.append("|---|" + "---|" * len(specs))
        for p in pols:
            cells = []
            for s in specs:
                st = results["workloads"][s]["policies"][p]
                best = max(results["workloads"][s]["policies"].values(), key=lambda x: x["score"]["mean"])
                cell = _fmt(st, "score" if key == "score" else key)
                cells.append(f"**{cell}**" if st is best else cell)
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")
        if fam != "closed":
            lines.append("Mean / p99 TPOT (ms):")
            lines.append("")
            lines.append(
                "| policy | " + " | ".join(results["workloads"][s]["label"] or s for s in specs) + " |"
            )
            lines.append("|---|" + "---|" * len(specs))
            for p in pols:
                cells = [
                    f"{results['workloads'][s]['policies'][p]['tpot_ms_mean']['mean']:.2f} / "
                    f"{results['workloads'][s]['policies'][p]['tpot_ms_p99']['mean']:.2f}"
                    for s in specs
                ]
                lines.append(f"| {p} | " + " | ".join(cells) + " |")
            lines.append("")
        lines.append("Workload specs: " + ", ".join(f"`{s}`" for s in specs))
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def _plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    wls = results["workloads"]
    closed = sorted((w["x"], s) for s, w in wls.items() if w["family"] == "closed")
    if closed:
        fig, ax = plt.subplots(1, 2, figsize=(13, 5))
        pols = list(wls[closed[0][1]]["policies"])
        xs = [c for c, _ in closed]
        for p in pols:
            ys = [wls[s]["policies"][p]["throughput_tok_s"]["mean"] for _, s in closed]
            style = "-" if p in ("ppo", "oracle") else "--" if p.startswith("static") else ":"
            ax[0].plot(xs, ys, style, marker="o", ms=3, label=p, lw=2.2 if p == "ppo" else 1.2)
            base = (
                [wls[s]["policies"]["static:0"]["throughput_tok_s"]["mean"] for _, s in closed]
                if "static:0" in pols
                else None
            )
            if base:
                ax[1].plot(
                    xs,
                    np.array(ys) / np.array(base),
                    style,
                    marker="o",
                    ms=3,
                    label=p,
                    lw=2.2 if p == "ppo" else 1.2,
                )
        for a in ax:
            a.set_xscale("log")
            a.set_xlabel("concurrency C (closed loop)")
            a.grid(alpha=0.3)
        ax[0].set_ylabel("throughput (tokens/s)")
        ax[1].set_ylabel("throughput / static:0")
        ax[1].legend(fontsize=7, ncol=2)
        fig.suptitle(f"{results['sim']}: throughput vs concurrency")
        fig.tight_layout()
        paths.append(out / "throughput_vs_concurrency.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    pois = sorted((w["x"], s) for s, w in wls.items() if w["family"] == "poisson")
    if pois:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        pols = list(wls[pois[0][1]]["policies"])
        xs = [x for x, _ in pois]
        for p in pols:
            for i, key in enumerate(("tpot_ms_mean", "tpot_ms_p99")):
                ys = [wls[s]["policies"][p][key]["mean"] for _, s in pois]
                ax[i].plot(xs, ys, marker="o", ms=3, label=p, lw=2.2 if p == "ppo" else 1.0)
        ax[0].set_ylabel("mean TPOT (ms)")
        ax[1].set_ylabel("p99 TPOT (ms)")
        for a in ax:
            a.set_xlabel("offered load (fraction of capacity)")
            a.grid(alpha=0.3)
        ax[1].legend(fontsize=7, ncol=2)
        fig.suptitle(f"{results['sim']}: TPOT vs load (open loop)")
        fig.tight_layout()
        paths.append(out / "tpot_vs_load.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for spec, per in results.get("traces", {}).items():
        fig, ax = plt.subplots(len(per) + 1, 1, figsize=(12, 2.2 * (len(per) + 1)), sharex=True)
        first = next(iter(per.values()))
        ax[0].plot(first["t_s"], first["bs"], color="gray", lw=0.8)
        ax[0].set_ylabel("batch size")
        for i, (p, tr) in enumerate(per.items(), start=1):
            sc = ax[i].scatter(tr["t_s"], tr["depth"], c=tr["bs"], s=3, cmap="viridis")
            ax[i].set_ylabel(f"depth\n{p}")
            ax[i].set_yticks(results["depths"])
        fig.colorbar(sc, ax=ax, label="batch size", fraction=0.02)
        ax[-1].set_xlabel("simulated time (s)")
        fig.suptitle(f"{results['sim']}: depth chosen vs batch size over time ({spec})")
        paths.append(out / "depth_vs_batch_over_time.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
        break
    return paths
