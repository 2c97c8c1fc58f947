"""A deployment's step latency against real step records, per (depth, batch-size bin).

Run: ``python bench/deployment_vs_traces.py [--deployment NAME|sim.json] [--traces DIR ...]
[--off-path verify|plain|deployment] [--by-context] [--json OUT]`` (defaults: ``h200-llama8b`` against
``env/example_traces/h200-real-{rand,same,noisy}``, SGLang 0.5.17 + EAGLE-3 on one H200).

For every prefill-free decode step of the traces it evaluates the deployment's latency model
(``env.latency.step_times_us``) and prints, per (depth, batch-size bin), the real median step
time, the predicted median and the median of the per-step ratio predicted / real, then the
MAPE over all those steps and over the speculative (k > 0) ones. ``--by-context`` also splits
each row by cached tokens per sequence (below 1k, 1k-8k, 8k-24k, 24k and more), for traces of
long prompts (``env/example_traces/h200-real-longctx`` with ``--off-path deployment``: those
servers ran the off switch).

Depth 0: the servers that recorded ``h200-real-*`` ran SGLang's own depth 0 (a width-1 verify
and the draft extend), not the off switch. ``--off-path verify`` (the default) prices their
depth-0 steps that way, with the deployment's ``v0_*`` terms (which the bundled H200
deployments solve from the off switch's throughput ratios); ``deployment`` keeps the
deployment's own depth-0 path (the off switch on the bundled ones), which is not what those
servers ran.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import longctx_extrapolation  # a sibling script: bench/ is this script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
CTX_BINS = tuple((lo, hi) for lo, hi, _ in longctx_extrapolation.CTX_BINS)
"""``--by-context``'s bins of cached tokens per sequence, inclusive: the long-context fit's."""
TRACES = tuple(str(ROOT / "env" / "example_traces" / f"h200-real-{lvl}") for lvl in ("rand", "same", "noisy"))


def table(deployment: str, traces: list[str], off_path: str = "verify", by_context: bool = False) -> dict:
    """The comparison (``env.fit.trace_step_table``) of ``deployment`` over all ``traces``."""
    from env.deployments import resolve
    from env.fit import load_steps, trace_step_table

    lp = resolve(deployment).latency
    if off_path != "deployment":
        lp = replace(lp, off_path=off_path)
    steps = [s for d in traces for recs in [load_steps(d)] for v in recs.values() for s in v]
    out = trace_step_table(lp, steps, ctx_bins=CTX_BINS) if by_context else trace_step_table(lp, steps)
    out.update(deployment=deployment, traces=[str(t) for t in traces], off_path=lp.off_path)
    return out


def markdown(t: dict) -> str:
    by_ctx = len({r["ctx_lo"] for r in t["rows"]}) > 1
    lines = [
        f"{t['deployment']} against {len(t['traces'])} trace folder(s), {t['n']} prefill-free steps "
        f"(depth 0 priced as off_path {t['off_path']!r})",
        "",
        "| depth |" + (" ctx / seq |" if by_ctx else "") + " batch | steps | real ms | predicted ms | predicted / real |",
        "|---|" + ("---|" if by_ctx else "") + "---|---|---|---|---|",
    ]
    for r in t["rows"]:
        ctx = f" {r['ctx_lo']}-{min(r['ctx_hi'], 1 << 20)} |" if by_ctx else ""
        lines.append(
            f"| {r['depth']} |{ctx} {r['bs_lo']}-{r['bs_hi']} | {r['n']} | {r['real_ms']:.2f} | "
            f"{r['pred_ms']:.2f} | {r['ratio']:.3f} |"
        )
    lines += ["", f"MAPE: all steps {t['mape_pct']:.1f}%, k > 0 {t['mape_spec_pct']:.1f}%"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="h200-llama8b", help="a bundled deployment's name or a sim.json path")
    ap.add_argument("--traces", nargs="+", default=list(TRACES), help="trace folders (runs/*.msgpack[.gz])")
    ap.add_argument(
        "--off-path",
        choices=("verify", "plain", "deployment"),
        default="verify",
        help="how the traced servers ran depth 0 (h200-real-*: SGLang's own, 'verify')",
    )
    ap.add_argument("--by-context", action="store_true", help="also split the rows by cached tokens per sequence")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args(argv)
    t = table(args.deployment, args.traces, args.off_path, args.by_context)
    print(markdown(t))
    if args.json:
        Path(args.json).write_text(json.dumps(t, indent=1) + "\n")


if __name__ == "__main__":
    main()
