"""``controller fit`` and ``controller bench``: the simulator's two commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from controller.errors import ConfigError

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,128,250"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``fit`` and ``bench`` to the ``controller`` CLI."""
    p = subparsers.add_parser(
        "fit",
        help="fit the simulator to traces and/or latency profiles",
        description=(
            "Fit the simulator's latency, acceptance and workload models to a trace folder and/or "
            "latency-profile CSVs; write sim.json and print the fit report (held-out errors)."
        ),
    )
    p.add_argument("--traces", metavar="DIR", help="folder of recorded traces (runs/*.msgpack)")
    p.add_argument(
        "--profile", metavar="CSV", action="append", default=[], help="latency profile CSV (repeatable)"
    )
    p.add_argument("--out", metavar="SIM_JSON", required=True, help="where to write the fitted parameters")
    p.add_argument("--holdout", metavar="CSV", help="profile CSV to predict (rows held out of the fit)")
    p.add_argument(
        "--predictions", metavar="OUT_CSV", help="with --holdout: write its rows plus predicted_ms"
    )
    p.add_argument(
        "--off-path",
        choices=("plain", "verify"),
        help="how the traced server ran depth 0: plain (the off switch) or verify (SGLang's own "
        "width-1 verify, servers without the off switch); default: as the base deployment (plain)",
    )
    p.add_argument(
        "--off-draft",
        choices=("kv", "keep", "skip"),
        help="what the traced server's drafter did at depth 0 (its --spec-off-draft; kv is the hook's "
        "default); default: as the base deployment (kv; the committed example traces ran keep)",
    )
    p.add_argument(
        "--passes-from",
        metavar="SIM_JSON",
        help="keep this fit's pass terms (another server's, same GPU and model) and fit only the traces' "
        "per-step overheads and admissions; for records that cannot tell passes from overheads, e.g. a "
        "plain server's through the hook's launcher (with --off-draft skip: it has no drafter)",
    )
    p.add_argument(
        "--copy-tb-s",
        type=float,
        metavar="TB_S",
        help="the traced GPU's memory copy bandwidth in TB/s: no KV read is fitted faster than copying at it "
        "(default: the base deployment's, an H200's measured 4.24; an H100 SXM copies about 2.96, its 3.35 "
        "peak at the H200's measured share)",
    )
    p.set_defaults(func=_cmd_fit)

    b = subparsers.add_parser(
        "bench",
        help="closed-loop benchmark of a policy in the simulator",
        description=(
            "Closed-loop benchmark (the seed's parallel benchmark): for each concurrency C, C clients "
            "each send a request when their previous one completes; prints tok/s and mean TPOT per C."
        ),
    )
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--deployment", help="bundled deployment: h200-llama8b, h200-llama8b-longctx, h200-70b or seed"
    )
    src.add_argument("--sim", metavar="SIM_JSON", help="a fitted sim.json")
    b.add_argument("--policy", required=True, help="policy spec: builtin:NAME or a PPO zip")
    b.add_argument(
        "--concurrency", default=DEFAULT_CONCURRENCY, help=f"comma list (default {DEFAULT_CONCURRENCY})"
    )
    b.add_argument("--depths", default="0,1,2,3,5", help="allowed depths (default 0,1,2,3,5)")
    b.add_argument("--duration-s", type=float, default=300.0, help="simulated seconds per C (default 300)")
    b.add_argument("--workload", default="closed:{C}", help="workload template, {C} = concurrency")
    b.add_argument("--action-delay", type=int, default=1, help="steps between a record and its decision")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", metavar="OUT_JSON", help="also write the results as JSON")
    b.set_defaults(func=_cmd_bench)


def _cmd_fit(args: argparse.Namespace) -> int:
    from env.fit import fit_sim, predict_profile
    from env.params import SimParams

    if args.predictions and not args.holdout:
        raise ConfigError("--predictions needs --holdout")
    base = None
    if args.passes_from:
        if args.profile:
            raise ConfigError("--passes-from and --profile both give the pass terms: give one")
        if not args.traces:
            raise ConfigError("--passes-from needs --traces (the overheads to fit)")
        base = SimParams.from_json(args.passes_from)
    params, report = fit_sim(
        args.traces, args.profile, base=base, off_path=args.off_path, off_draft=args.off_draft,
        pin_passes=base is not None, copy_tb_s=args.copy_tb_s,
    )  # fmt: skip
    params.to_json(args.out)
    report_path = Path(args.out).with_suffix(".report.json")
    report_path.write_text(json.dumps(report.to_dict(), indent=1, default=str) + "\n")
    print(report)
    print(f"wrote {args.out} and {report_path}")
    if args.holdout:
        out, mape = predict_profile(params, args.holdout)
        if args.predictions:
            out.to_csv(args.predictions, index=False)
            print(f"wrote {args.predictions} ({len(out)} rows)")
        print(f"held-out profile {args.holdout}: MAPE per component")
        for comp, m in sorted(mape.items()):
            print(f"  {comp:<20}{m:>8.2f}%")
    return 0


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--{what}: a comma-separated list of integers, got {text!r}") from None
    if not vals:
        raise ConfigError(f"--{what}: empty list")
    return vals


def _cmd_bench(args: argparse.Namespace) -> int:
    from controller.registry import make_factory
    from env.deployments import load_deployment
    from env.params import SimParams
    from env.runner import simulate

    params = load_deployment(args.deployment) if args.deployment else SimParams.from_json(args.sim)
    conc = _parse_ints(args.concurrency, "concurrency")
    depths = tuple(_parse_ints(args.depths, "depths"))
    if any(c < 1 for c in conc):
        raise ConfigError("--concurrency: every C must be >= 1")
    if "{C}" not in args.workload and len(conc) > 1:
        raise ConfigError("--workload: with several concurrencies the template must contain {C}")
    factory = make_factory(args.policy, depths)
    results = []
    print(
        f"deployment {params.name}, policy {args.policy}, depths {list(depths)}, {args.duration_s:g} s per C"
    )
    print(f"{'C':>5}{'tok/s':>11}{'TPOT ms':>10}{'p99 ms':>9}{'reqs':>7}  depth mix")
    for c in conc:
        r = simulate(
            params,
            args.workload.replace("{C}", str(c)),
            factory(depths),
            depths=depths,
            seed=args.seed,
            duration_s=args.duration_s,
            action_delay=args.action_delay,
        )
        total = max(sum(r.depth_hist.values()), 1)
        mix = " ".join(f"{d}:{n / total:.0%}" for d, n in sorted(r.depth_hist.items()))
        print(
            f"{c:>5}{r.throughput_tok_s:>11.1f}{r.tpot_ms_mean:>10.2f}{r.tpot_ms_p99:>9.2f}{r.n_requests:>7}  {mix}"
        )
        results.append(
            {
                "concurrency": c,
                "throughput_tok_s": r.throughput_tok_s,
                "tpot_ms_mean": r.tpot_ms_mean,
                "tpot_ms_p99": r.tpot_ms_p99,
                "n_requests": r.n_requests,
                "depth_hist": {str(k): v for k, v in sorted(r.depth_hist.items())},
            }
        )
    if args.json:
        meta = {
            "deployment": params.name,
            "policy": args.policy,
            "depths": list(depths),
            "duration_s": args.duration_s,
        }
        Path(args.json).write_text(json.dumps({"results": results, "meta": meta}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
