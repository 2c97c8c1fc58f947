"""Fit the latency model on short-context step records, price the long-context ones (call AQ).

Run: ``python bench/longctx_extrapolation.py [--tar TAR] [--held-out TAR ...] [--out DIR] [--json OUT]`` (default:
``bench/results/realgpu/h100/longctx/traces-aq.tar``, one SGLang 0.5.17 EAGLE-3 server on an
H100 through the hook, off switch ``kv``, closed loop at 256-token prompts, then prompts of
4096, 16384 and 32768 tokens; ``bench/results/realgpu/h100/longctx/README.md``).

1. For each split of :data:`SPLITS` (below 1,024 cached tokens per sequence: the closed
   stage; below 8,192: with the 4k points), write each trace file into ``DIR/NAME/below``,
   ``above`` and ``all`` with only those steps (by ``ctx_tokens / bs``), its other records
   kept. The trace files alone do not split the call: the harness's long-prompt warm-up ran
   while a closed-stage controller was live, and the long stage's files hold a few steps of
   2-token probe requests.
2. Fit ``below`` (and, once, ``all``) with ``env.fit.fit_sim`` as ``controller fit --traces
   DIR/NAME/below --off-path plain --off-draft kv --copy-tb-s 2.96`` runs it (the server ran the
   hook's off switch, ``--spec-off-draft kv``, on an H100); the fits go to ``DIR/NAME/fit.json`` and
   ``DIR/fit-all.json``.
3. Price every prefill-free decode step of each part with each fit
   (``env.fit.trace_step_table``, as ``bench/deployment_vs_traces.py --off-path deployment``
   does), per (depth, context bin, batch bin): steps, real median step ms, predicted median,
   the median per-step ratio predicted / real, the row's MAPE; then the MAPE over all steps,
   depth 0 and depth > 0, and the worst row (the median ratio farthest from 1; a row's MAPE
   also counts the records after an idle gap, which measure more than a step).
4. ``--held-out``: price the long steps (at least :data:`LONG_MIN_CTX` cached tokens per
   sequence) of other calls' traces, which no fit saw, with the fit on all and the fit below
   8,192 (calls AS and AT: ``traces-as.tar``, ``traces-at.tar`` beside the default).
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import msgpack

from env.latency import kv_floor_us_per_tok

ROOT = Path(__file__).resolve().parents[1]
TAR = ROOT / "bench" / "results" / "realgpu" / "h100" / "longctx" / "traces-aq.tar"
LONG_MIN_CTX = 1024
"""Context per sequence (tokens) from which a step is long: the closed stage's steps stay under
400 (256-token prompts, 128 output tokens), the long stage's from about 4100."""
FIT_UP_TO = 8192
"""The second fit's split: the short steps and the 4k ones below it, the 16k and 32k above."""
CTX_BINS = ((0, LONG_MIN_CTX - 1, "<1k"), (LONG_MIN_CTX, 8191, "4k"), (8192, 24575, "16k"), (24576, 1 << 30, "32k"))
BS_BINS = ((1, 1), (2, 4), (5, 8), (9, 19), (20, 47), (48, 64))


def split_traces(src: Path, out: Path, at: int) -> dict[str, int]:
    """Write each trace file of ``src`` into ``out/below``, ``out/above`` and ``out/all`` with
    only those steps (by ``ctx_tokens / bs`` against ``at``) and every other record; returns
    the step counts per part."""
    from controller.traces import iter_records, trace_files

    n = {"below": 0, "above": 0}
    for part in ("below", "above", "all"):
        (out / part).mkdir(parents=True, exist_ok=True)
    for f in trace_files(src):
        parts: dict[str, list[bytes]] = {"below": [], "above": [], "all": []}
        for r in iter_records(f):
            frame = msgpack.packb(r)
            if r["t"] == "step":
                part = "above" if r["ctx_tokens"] / max(r["bs"], 1) >= at else "below"
                n[part] += 1
                parts[part].append(frame)
                parts["all"].append(frame)
            else:
                for frames in parts.values():
                    frames.append(frame)
        name = f.name.removesuffix(".gz")  # written plain: readers take both
        for part, frames in parts.items():
            (out / part / name).write_bytes(b"".join(frames))
    return n


def price(lp: Any, traces: Path) -> dict[str, Any]:
    """``lp``'s step times against every prefill-free decode step of ``traces``
    (``env.fit.trace_step_table``), per (depth, context bin, batch bin)."""
    from env.fit import load_steps, trace_step_table

    steps = [s for part in load_steps(str(traces)).values() for s in part]
    return trace_step_table(lp, steps, bins=BS_BINS, ctx_bins=tuple((lo, hi) for lo, hi, _ in CTX_BINS))


def _ctx(row: dict[str, Any]) -> str:
    return next(name for lo, _, name in CTX_BINS if lo == row["ctx_lo"])


def _bs(row: dict[str, Any]) -> str:
    return f"{row['bs_lo']}" if row["bs_lo"] == row["bs_hi"] else f"{row['bs_lo']}-{row['bs_hi']}"


def markdown(title: str, t: dict[str, Any]) -> str:
    w = t["worst"]
    lines = [
        f"{title}: {t['n']} prefill-free steps",
        "",
        "| depth | ctx / seq | batch | steps | real ms | predicted ms | predicted / real | MAPE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in t["rows"]:
        lines.append(
            f"| {r['depth']} | {_ctx(r)} | {_bs(r)} | {r['n']} | {r['real_ms']:.2f} | {r['pred_ms']:.2f} | "
            f"{r['ratio']:.3f} | {r['mape_pct']:.1f}% |"
        )
    lines += [
        "",
        f"MAPE: all steps {t['mape_pct']:.1f}%, k = 0 {t['mape_k0_pct']:.1f}%, k > 0 {t['mape_spec_pct']:.1f}%; "
        f"worst row: depth {w['depth']}, ctx {_ctx(w)}, batch {_bs(w)} ({w['n']} steps): "
        f"{w['real_ms']:.2f} ms real, {w['pred_ms']:.2f} predicted, MAPE {w['mape_pct']:.1f}%",
    ]
    return "\n".join(lines)


H100_COPY_TB_S = 2.96
"""The H100 SXM's copy bandwidth, assumed: its 3.35 TB/s peak at the share the H200's profile
measured of its own (4.24 of 4.8)."""


H100_COPY_FLOOR_US_PER_TOK = kv_floor_us_per_tok(32 * 4096, 32, H100_COPY_TB_S)
"""One token of one layer's KV (4 KiB) copied at :data:`H100_COPY_TB_S`, µs: the fits' floor."""


def fit(traces: Path, out: Path) -> Any:
    """``controller fit --traces traces --out out --off-path plain --off-draft kv --copy-tb-s
    2.96`` (the calls ran on an H100): the fitted params (also written to ``out``)."""
    from env.fit import fit_sim

    params, _ = fit_sim(str(traces), [], off_path="plain", off_draft="kv", copy_tb_s=H100_COPY_TB_S)
    params.to_json(str(out))
    return params


def _coeffs(params: Any) -> dict[str, Any]:
    """The fit's latency coefficients and its acceptance population, for the tables and JSON."""
    return {
        **{k: v for k, v in params.latency.to_dict().items() if k != "rel_se"},
        "acceptance": {k: v for k, v in params.acceptance.to_dict().items() if k != "rel_se"},
    }


SPLITS = (("short", LONG_MIN_CTX), ("to4k", FIT_UP_TO))
"""The fits: below 1,024 tokens per sequence (the closed stage) and below 8,192 (with the 4k
points), each priced on the steps above its split."""


def fit_below(traces: Path, out: Path, at: int) -> dict[str, Any]:
    """Split ``traces`` at ``at`` cached tokens per sequence into ``out``, fit below
    (``out/fit.json``) and price both parts: ``steps``, ``beyond``, ``in_sample``, ``fit``."""
    steps = split_traces(traces, out, at)
    params = fit(out / "below", out / "fit.json")
    return {
        "steps": steps,
        "beyond": price(params.latency, out / "above"),
        "in_sample": price(params.latency, out / "below"),
        "fit": _coeffs(params),
    }


def run(tar: Path, out: Path, splits: tuple[tuple[str, int], ...] = SPLITS) -> dict[str, Any]:
    """Each of ``splits`` (:func:`fit_below` under ``out/NAME``), then the fit on every step."""
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tar) as tf:
            tf.extractall(tmp, filter="data")
        for name, at in splits:
            res[name] = fit_below(Path(tmp) / "traces", out / name, at)
    all_params = fit(out / splits[0][0] / "all", out / "fit-all.json")
    res["all"] = {
        "in_sample": price(all_params.latency, out / splits[0][0] / "all"),
        "beyond": price(all_params.latency, out / splits[0][0] / "above"),
        "fit": _coeffs(all_params),
    }
    return res


def held_out(tars: list[Path], fits: dict[str, Path]) -> dict[str, Any]:
    """The long steps (at least :data:`LONG_MIN_CTX` cached tokens per sequence) of ``tars``,
    other calls' traces, priced with each of ``fits`` (name: sim.json): ``{tar stem: {name:
    table}}``."""
    from env.params import SimParams

    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tar in tars:
            src = Path(tmp) / tar.stem
            with tarfile.open(tar) as tf:
                tf.extractall(src, filter="data")
            split_traces(src / "traces", src / "split", LONG_MIN_CTX)
            res[tar.stem] = {
                name: price(SimParams.from_json(str(f)).latency, src / "split" / "above") for name, f in fits.items()
            }
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tar", default=str(TAR), help="the call's traces.tar (traces/*.msgpack.gz)")
    ap.add_argument("--out", help="write the split folders and the fits here (default: a temporary folder)")
    ap.add_argument("--json", help="also write the tables and fitted coefficients as JSON here")
    ap.add_argument("--held-out", nargs="*", default=[], metavar="TAR",
                    help="other calls' traces.tar: price their long steps with the fits (e.g. traces-as.tar traces-at.tar)")  # fmt: skip
    args = ap.parse_args(argv)
    for tar in [args.tar, *args.held_out]:
        if not Path(tar).is_file():
            ap.error(f"no such traces tar: {tar}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        res = run(Path(args.tar), out)
        if args.held_out:
            fits = {"all": out / "fit-all.json", "to4k": out / "to4k" / "fit.json"}
            res["held_out"] = held_out([Path(t) for t in args.held_out], fits)
    for name, at in SPLITS:
        c = res[name]["steps"]
        print(f"split at {at} cached tokens per sequence: {c['below']} steps below, {c['above']} above\n")
        print(markdown(f"fit below {at}, priced above", res[name]["beyond"]) + "\n")
        print(markdown(f"fit below {at}, in sample", res[name]["in_sample"]) + "\n")
    print(markdown("fit on all, in sample", res["all"]["in_sample"]) + "\n")
    print(markdown(f"fit on all, its steps above {SPLITS[0][1]}", res["all"]["beyond"]) + "\n")
    keys = ("oh_us", "oh_spec_us", "dec_kv1_us_per_tok", "dec_kv_us_per_tok", "dec_walk_us_per_tok",
            "verify_seq_us", "verify_ctx_us_per_tok")  # fmt: skip
    for name in [n for n, _ in SPLITS] + ["all"]:
        acc = res[name]["fit"]["acceptance"]
        print(f"fit {name}: " + ", ".join(f"{k} {res[name]['fit'][k]:.4g}" for k in keys)
              + "; acceptance " + ", ".join(f"{k} {acc[k]:.3g}" for k in ("alpha", "beta", "sigma", "p_zero", "ctx_logit")))  # fmt: skip
    for stem, by_fit in res.get("held_out", {}).items():
        for name, table in by_fit.items():
            print("\n" + markdown(f"held out: {stem}'s long steps, priced by the fit {name}", table))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
