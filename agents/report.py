"""Eval outputs: the target checks, ``report.md``, ``results.json`` and the PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from controller.baselines import BASELINES

# Privileged policies (agents.evaluate.REFERENCES): labelled references, never competitors.
REFERENCES = ("oracle", "goodput-exact")
HEADROOM_MIN = 1.05


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    """The report's "Targets" section: each target's value, threshold and whether it is met."""
    if not targets:
        return []
    lines = ["## Targets", "", "| target | value | threshold | met |", "|---|---|---|---|"]
    for t in targets:
        mark = "yes" if t["passed"] else f"**no** (short by {t['threshold'] - t['value']:.3f})"
        lines.append(f"| {t['name']} ({t['detail']}) | {t['value']:.3f} | {t['threshold']:.3f} | {mark} |")
    return [*lines, ""]


def _write_report(out: Path, lines: list[str], plots: list[Path]) -> Path:
    """``out/report.md``: the lines, then the plots section."""
    if plots:
        lines = [*lines, "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def ci95(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and Student-t 95% confidence interval of the mean."""
    x = np.asarray(values, dtype=float)
    m = float(x.mean())
    if len(x) < 2:
        return m, m, m
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return m, m - half, m + half


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
    adaptive = [p for p in (*BASELINES, "goodput-fit") if p in pols]
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


def _scores_line(results: dict[str, Any], open_loop: str) -> str:
    """What the scores are, by the run's objective (``results["objective"]``)."""
    objective = results.get("objective", "throughput")
    own = sorted({w["objective"] for w in results.get("workloads", {}).values() if w.get("objective")})
    also = (
        f" Scenarios marked ({', '.join(own)}) are scored by their own objective: goodput under its TPOT target."
        if own
        else ""
    )
    if objective == "throughput":
        return f"Objective throughput. Scores: closed loop → throughput (tokens/s); open loop → {open_loop}.{also}"
    target = objective.split(":", 1)[1]
    return (
        f"Objective {objective}. Scores: goodput under the TPOT target, tokens/s of the completed requests "
        f"whose TPOT is at most {target} ms (the others count 0), closed and open loop alike.{also}"
    )


def _warm_line(results: dict[str, Any]) -> str:
    """The report's note that the run simulated the hook's warm resume (``--warm-resume``)."""
    if not results.get("config", {}).get("warm_resume"):
        return ""
    return " Every deployment runs the hook's warm resume (`--warm-resume`: one more depth-0 step before drafting resumes)."


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
        f"capacity ≈ {results.get('capacity_req_s', 0):.2f} req/s; wall time {results.get('wall_s', 0):.0f} s."
        + _warm_line(results),
        _scores_line(results, "per-request decode speed (1000 / mean TPOT, tokens/s)")
        + " Values are mean ± 95% CI half-width over seeds.",
        "",
    ]
    lines += targets_table(results["targets"])
    if notes:
        lines += [notes, ""]
    hr = [(s, w["headroom"]) for s, w in results["workloads"].items() if w.get("headroom") is not None]
    if hr:
        lines += [
            "Headroom (the clairvoyant oracle's score over the best static depth's) per workload: "
            + ", ".join(f"{results['workloads'][s]['label'] or s} {h:.3f}" for s, h in hr)
            + ". `oracle` and `goodput-exact` (the simulator's exact latency model) are privileged "
            "references, not competitors.",
            "",
        ]
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
    return _write_report(out, lines, plots)


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


# --------------------------------------------------------------------------- suites


def is_learned(name: str) -> bool:
    return name == "ppo" or name.startswith("ppo:")


def realistic(pols: Any) -> list[str]:
    """The competitors a real deployment could run: neither learned here nor privileged."""
    return [p for p in pols if not is_learned(p) and p not in REFERENCES]


def _values(w: dict[str, Any], p: str) -> np.ndarray:
    return np.asarray(w["policies"][p]["score"]["values"], dtype=float)


def paired_ratio(w: dict[str, Any], a: str, b: str) -> tuple[float, float, float]:
    """score(a)/score(b) seed by seed (common random numbers): mean and 95% CI."""
    va, vb = _values(w, a), _values(w, b)
    ok = vb > 0
    if not ok.any():
        return float("nan"), float("nan"), float("nan")
    return ci95(list(va[ok] / vb[ok]))


def _best(w: dict[str, Any], names: list[str]) -> str:
    return max(names, key=lambda p: w["policies"][p]["score"]["mean"])


def _ratio_cell(ratios: dict[str, float], key: str) -> str:
    """One ratio for a table, or "—" where the run had nothing to divide by (no baselines)."""
    v = ratios.get(key)
    return "—" if v is None else f"{v:.3f}"


def suite_ratios(results: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """scenario → policy → ratios of mean scores: ``best_realistic``, ``best_static``,
    ``static0``, ``oracle``, ``goodput-exact`` (the ones that exist)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for s, w in results["workloads"].items():
        pols = list(w["policies"])
        comp = realistic(pols)
        statics = [p for p in pols if p.startswith("static:")]
        dens: dict[str, float] = {}
        if comp:
            dens["best_realistic"] = w["policies"][_best(w, comp)]["score"]["mean"]
        if statics:
            dens["best_static"] = w["policies"][_best(w, statics)]["score"]["mean"]
        for ref, key in (("static:0", "static0"), ("oracle", "oracle"), ("goodput-exact", "goodput-exact")):
            if ref in pols:
                dens[key] = w["policies"][ref]["score"]["mean"]
        out[s] = {
            p: {
                k: (w["policies"][p]["score"]["mean"] / d if d > 0 else float("nan")) for k, d in dens.items()
            }
            for p in pols
        }
    return out


def check_suite_targets(results: dict[str, Any], learned: str = "ppo") -> list[dict[str, Any]]:
    """The suite's done-criteria for policy ``learned`` (see docs/results.md)."""
    wls = results["workloads"]
    ratios = suite_ratios(results)
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, threshold: float, detail: str, strict: bool = False) -> None:
        ok = value > threshold if strict else value >= threshold
        out.append(
            {"name": name, "value": value, "threshold": threshold, "passed": bool(ok), "detail": detail}
        )

    hr = {s: w["headroom"] for s, w in wls.items() if w.get("headroom") is not None}
    if hr:
        n_ok = sum(h >= HEADROOM_MIN for h in hr.values())
        add(
            "scenarios with headroom ≥ 5% (fraction)",
            n_ok / len(hr),
            0.5,
            f"{n_ok} of {len(hr)}; smallest {min(hr.values()):.3f}, largest {max(hr.values()):.3f}",
        )
    have = [s for s in wls if learned in wls[s]["policies"]]
    if not have:
        return out

    def worst(key: str, among: list[str]) -> tuple[float, str]:
        vals = {s: ratios[s][learned].get(key, float("nan")) for s in among}
        s = min(vals, key=lambda x: _nan_last(vals[x]))
        return vals[s], s

    v, s = worst("best_static", have)
    add("PPO / best static depth, worst scenario", v, 0.99, f"at {s}")
    v, s = worst("best_realistic", have)
    add("PPO / every realistic baseline, worst scenario", v, 0.99, f"at {s}")
    hard = [x for x in have if wls[x].get("shifting") or wls[x].get("overload")]
    if hard:
        vals = [ratios[x][learned].get("best_realistic", float("nan")) for x in hard]
        v, s = worst("best_realistic", hard)
        add(
            "shifting/overload scenarios: PPO / best realistic baseline, worst",
            v,
            1.03,
            f"at {s}; mean over {len(hard)} scenarios {np.nanmean(vals):.3f}",
        )
    comp = realistic(wls[have[0]]["policies"])
    worsts = {p: min(ratios[x][p]["best_realistic"] for x in have if p in ratios[x]) for p in comp}
    if worsts:
        b = max(worsts, key=lambda p: worsts[p])
        v_ppo = min(ratios[x][learned]["best_realistic"] for x in have)
        add(
            "PPO's worst case / best realistic, above every baseline's worst case",
            v_ppo,
            worsts[b],
            f"best baseline worst case: {b} {worsts[b]:.3f}",
            strict=True,
        )
    if all("static0" in ratios[x][learned] for x in have):
        v, s = worst("static0", have)
        add("PPO / static:0, worst scenario", v, 0.99, f"at {s}")
    return out


def write_suite_outputs(results: dict[str, Any], out: Path) -> Path:
    """A suite's ``results.json``, ``report.md`` and plots into ``out``; returns the report."""
    wls = results["workloads"]
    learned = "ppo" if any("ppo" in w["policies"] for w in wls.values()) else None
    results["targets"] = check_suite_targets(results, learned or "ppo")
    ratios = suite_ratios(results)
    results["robustness"] = robustness(results, ratios)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plots = _suite_plots(results, ratios, out)
    n_seeds = len(results["seeds"])
    lines = [
        f"# Evaluation: suite `{results['suite']}`",
        "",
        f"Depths {results['depths']}; {n_seeds} held-out seeds {results['seeds']} (the same for every "
        "policy); every (scenario, seed) runs on a world drawn around the deployment's fit, and "
        "`goodput-fit` gets the fit. "
        + _scores_line(results, "1000 / mean TPOT (tokens/s per request)")
        + f" Wall time {results.get('wall_s', 0):.0f} s."
        + _warm_line(results),
        "",
        "References (privileged, not competitors): `oracle` (clairvoyant greedy: true acceptance and "
        "latency of the next step), `goodput-exact` (goodput with the world's exact latency model). "
        "Realistic competitors: every static depth, "
        + ", ".join(f"`{b}`" for b in BASELINES)
        + " (`goodput` as `controller serve` serves it: measured latencies), `goodput-fit` "
        "(the fitted latency model).",
        "",
    ]
    lines += targets_table(results["targets"])
    if results.get("missing"):
        lines += ["## Missing", ""]
        lines += [
            f"- `{m['scenario']}`: deployment `{m['deployment']}` — {m['reason']}" for m in results["missing"]
        ]
        lines.append("")
    lines += _suite_table(results, ratios)
    lines += _robustness_table(results)
    lines += ["## Scores (mean ± 95% CI over seeds)", ""]
    pols = _all_policies(wls)
    lines.append("| scenario | " + " | ".join(pols) + " |")
    lines.append("|---|" + "---|" * len(pols))
    for s, w in wls.items():
        best = max(w["policies"].values(), key=lambda x: x["score"]["mean"])
        cells = []
        for p in pols:
            if p not in w["policies"]:
                cells.append("—")
                continue
            st = w["policies"][p]
            digits = 1 if st["score"]["mean"] < 100 else 0
            cell = _fmt(st, "score", digits)
            cells.append(f"**{cell}**" if st is best else cell)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "Specs (rates resolved against each scenario's capacity):", ""]
    lines += [f"- `{s}`: `{w['spec']}` ({w['label']})" for s, w in wls.items()]
    for s, w in wls.items():
        if w.get("missing_policies"):
            lines.append(f"- `{s}`: not run: {', '.join(w['missing_policies'])}")
    lines.append("")
    return _write_report(out, lines, plots)


def _all_policies(wls: dict[str, Any]) -> list[str]:
    pols: list[str] = []
    for w in wls.values():
        pols += [p for p in w["policies"] if p not in pols]
    return pols


def _suite_table(results: dict[str, Any], ratios: dict[str, Any]) -> list[str]:
    wls = results["workloads"]
    pols = _all_policies(wls)
    learned = [p for p in pols if is_learned(p)]
    comp = [p for p in pols if p not in learned and p not in REFERENCES]
    lines = [
        "## Per scenario: ratio to the best realistic competitor",
        "",
        "Headroom = oracle / best static depth. `ppo` columns: mean-score ratio, then the seed-paired "
        "ratio's 95% CI (a difference inside it is not a result).",
        "",
    ]
    head = ["scenario", "shift", "overload", "headroom", "best static", "best realistic"]
    head += [f"{p} / best static" for p in learned] + [f"{p} / best realistic (CI)" for p in learned]
    head += [p for p in comp if not p.startswith("static:")] + list(REFERENCES)
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---|" + "---|" * (len(head) - 1))
    for s, w in wls.items():
        statics = [p for p in w["policies"] if p.startswith("static:")]
        rc = realistic(w["policies"])
        hr = w.get("headroom")
        row = [
            f"{s} ({w['objective']})" if w.get("objective") else s,
            "yes" if w.get("shifting") else "",
            "yes" if w.get("overload") else "",
            f"{hr:.3f}" if hr is not None else "—",
            _best(w, statics) if statics else "—",
            _best(w, rc) if rc else "—",
        ]
        for p in learned:
            row.append(_ratio_cell(ratios[s].get(p, {}), "best_static"))
        for p in learned:
            if p in ratios[s] and rc:
                _, lo, hi = paired_ratio(w, p, _best(w, rc))
                row.append(f"{ratios[s][p]['best_realistic']:.3f} ({lo:.3f}–{hi:.3f})")
            else:
                row.append("—")
        for p in [*[p for p in comp if not p.startswith("static:")], *REFERENCES]:
            row.append(_ratio_cell(ratios[s].get(p, {}), "best_realistic"))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


def robustness(results: dict[str, Any], ratios: dict[str, Any]) -> dict[str, dict[str, float]]:
    """policy → worst and mean over the suite of its ratio to the best realistic competitor,
    the oracle, goodput-exact and static:0."""
    out: dict[str, dict[str, float]] = {}
    for p in _all_policies(results["workloads"]):
        row: dict[str, float] = {"scenarios": 0}
        for key in ("best_realistic", "oracle", "goodput-exact", "static0"):
            vals = [ratios[s][p][key] for s in ratios if p in ratios[s] and key in ratios[s][p]]
            vals = [v for v in vals if math.isfinite(v)]
            if vals:
                row[f"{key}_worst"] = float(min(vals))
                row[f"{key}_mean"] = float(np.mean(vals))
                row["scenarios"] = len(vals)
        out[p] = row
    return out


def _robustness_table(results: dict[str, Any]) -> list[str]:
    rob = results["robustness"]
    lines = [
        "## Robustness across the suite",
        "",
        "Worst and mean over the scenarios each policy ran of its score ratio to the best realistic "
        "competitor there, to the references, and to no speculation.",
        "",
        "| policy | kind | vs best realistic: worst | mean | vs oracle: worst | mean | vs goodput-exact: worst "
        "| mean | vs static:0: worst | mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(row: dict[str, float], key: str) -> str:
        return f"{row[key]:.3f}" if key in row else "—"

    for p, row in rob.items():
        kind = "learned" if is_learned(p) else "reference" if p in REFERENCES else "realistic"
        cells = [f(row, f"{k}_{m}") for k in ("best_realistic", "oracle", "goodput-exact", "static0")
                 for m in ("worst", "mean")]  # fmt: skip
        lines.append(f"| {p} | {kind} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _suite_plots(results: dict[str, Any], ratios: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = results["workloads"]
    if not wls:
        return []
    paths: list[Path] = []
    scen = list(wls)
    pols = _all_policies(wls)
    grid = np.full((len(pols), len(scen)), np.nan)
    for j, s in enumerate(scen):
        for i, p in enumerate(pols):
            if p in ratios[s] and "best_realistic" in ratios[s][p]:
                grid[i, j] = ratios[s][p]["best_realistic"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(scen), 1.0 + 0.4 * len(pols)))
    im = ax.imshow(np.clip(grid, 0.8, 1.1), cmap="RdYlGn", vmin=0.8, vmax=1.1, aspect="auto")
    ax.set_xticks(range(len(scen)), scen, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(pols)), pols, fontsize=7)
    for i in range(len(pols)):
        for j in range(len(scen)):
            if math.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=5.5)
    fig.colorbar(im, ax=ax, label="score / best realistic competitor", fraction=0.03)
    ax.set_title(f"suite {results['suite']}: each policy vs the best realistic competitor")
    fig.tight_layout()
    paths.append(out / "suite_ratios.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    hr = [(s, w["headroom"]) for s, w in wls.items() if w.get("headroom") is not None]
    if hr:
        fig, ax = plt.subplots(figsize=(1.0 + 0.5 * len(hr), 4))
        ax.bar(
            range(len(hr)),
            [h for _, h in hr],
            color=["tab:green" if h >= HEADROOM_MIN else "tab:gray" for _, h in hr],
        )
        ax.axhline(HEADROOM_MIN, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(hr)), [s for s, _ in hr], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("oracle / best static depth")
        ax.set_ylim(0.95, max(1.1, max(h for _, h in hr) + 0.02))
        ax.set_title("headroom per scenario")
        fig.tight_layout()
        paths.append(out / "headroom.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
