"""Is depth 0 off? An EAGLE-3 server held at depth 0 against a plain SGLang server, on one GPU.

Runs on the device machine in one call (set-up, models, servers, loads), like ``run.py``, whose
set-up it reuses. Several servers run at once on the one GPU, each with its KV cache capped, and
the loads are interleaved across them (every repetition times each server at each concurrency,
in an order that rotates), so slow drift of the machine hits every server alike.

Servers (``--servers``):
  plain      SGLang without any ``--speculative-*`` flag: the bar.
  off        EAGLE-3 through ``sglang_hook.launch_server``, held at depth 0 by the hook's fixed
             fallback (no controller process), depth 0 as a plain decode (the off switch,
             ``sglang_hook/off_switch.py``), the drafter's extend kept.
  off-skip   the same, the drafter's extend skipped at depth 0 (``SPECDEPTH_OFF_DRAFT=skip``).
  legacy     the same server with SGLang's own depth 0 (``SPECDEPTH_OFF_PATH=sglang``): a verify.

Every request is greedy with random token-id prompts; requests with the same (repetition,
concurrency, index) are the same on every server, so outputs are compared token for token.
The default target (``--target-out-std 0.02``) makes each token depend on the whole context, so
identical outputs check every kernel on the path, attention included.

Writes (under ``--out``): ``summary.csv`` (``workload,concurrency,policy,rep,tok_s,tpot_ms_mean,
tpot_ms_p99,failed``: the policy is ``plain``, ``static:0``, ``static:0-skip``,
``static:0-sglang``), ``offswitch.json`` (per point, identity against plain, server facts) and
``res.tar.gz`` (logs), re-written after every point so a call cut short keeps what it measured.

Usage (device, repo root): python3 bench/h200/offswitch.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402  (set-up, model building and server processes, shared with run.py)
from loadgen import LoadSpec, run_load  # noqa: E402

SUMMARY_FIELDS = ("workload", "concurrency", "policy", "rep", "tok_s", "tpot_ms_mean", "tpot_ms_p99", "failed")
CUDA_GRAPH_BS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
DEPTHS = (0, 3)


@dataclass(frozen=True)
class Kind:
    """One kind of server: its policy name in ``summary.csv`` and how it differs."""

    policy: str
    speculative: bool
    env: dict[str, str] = field(default_factory=dict)


KINDS = {
    "plain": Kind("plain", False),
    "off": Kind("static:0", True, {"SPECDEPTH_OFF_PATH": "plain", "SPECDEPTH_OFF_DRAFT": "keep"}),
    "off-skip": Kind("static:0-skip", True, {"SPECDEPTH_OFF_PATH": "plain", "SPECDEPTH_OFF_DRAFT": "skip"}),
    "legacy": Kind("static:0-sglang", True, {"SPECDEPTH_OFF_PATH": "sglang"}),
}


class Server(run.Server):
    """A server of one :class:`Kind`, sharing the GPU with the others (KV capped)."""

    def __init__(self, label: str, kind: Kind, port: int, args: argparse.Namespace) -> None:
        super().__init__(run.ServerSpec(label, "draft_rand" if kind.speculative else None), port)
        self.kind = kind
        self.args = args

    def argv(self) -> list[str]:
        a = self.args
        common = ["--model-path", str(run.MODELS / "target"), "--host", "127.0.0.1", "--port", str(self.port),
                  "--mem-fraction-static", str(a.mem_fraction), "--max-total-tokens", str(a.max_total_tokens),
                  "--max-running-requests", str(max(a.conc)), "--context-length", "4096",
                  "--attention-backend", a.backend, "--sampling-backend", "pytorch",
                  "--cuda-graph-bs", *map(str, CUDA_GRAPH_BS), "--decode-log-interval", "40",
                  "--log-level", "info"]  # fmt: skip
        if not self.kind.speculative:
            return [sys.executable, "-m", "sglang.launch_server", *common]
        hook = ["--spec-controller", f"ipc:///tmp/specdepth-off-{self.spec.label}.sock",
                "--spec-depths", ",".join(map(str, DEPTHS)), "--spec-fallback", "0",
                "--spec-stale-ms", "200", "--spec-instance", f"h200-{self.spec.label}"]  # fmt: skip
        spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(run.MODELS / "draft_rand"),
                "--speculative-num-steps", str(max(DEPTHS)), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(max(DEPTHS) + 1)]  # fmt: skip
        return [sys.executable, "-m", "sglang_hook.launch_server", *hook, *common, *spec]


def facts(server: Server) -> dict[str, Any]:
    """What the server's log says about memory, graphs and the depth-0 path."""
    text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""

    def grab(pattern: str, limit: int = 6) -> list[str]:
        return [ln.strip()[-300:] for ln in text.splitlines() if re.search(pattern, ln)][:limit]

    return {
        "kv": grab(r"KV Cache is allocated|max_total_num_tokens|Post-capture KV|Memory pool end"),
        "graphs": grab(r"Capture (cuda|draft|CUDA).*end|Built adaptive runtime state", 12),
        "off_switch": grab(r"spec controller", 12),
        "errors": grab(r"Traceback|Error|error", 12),
        "switches": len(grab(r"Switch adaptive runtime state", 10_000)),
        "sglang_rule_lines": len(grab(r"Adaptive spec params updated", 10_000)),
    }


class Book:
    """``summary.csv`` + ``offswitch.json`` + logs, re-written into ``--out`` after every point."""

    def __init__(self, out: Path, res: run.Results) -> None:
        self.out = out
        self.res = res
        self.rows: list[dict[str, Any]] = []
        self.points: list[dict[str, Any]] = []
        self.outputs: dict[tuple[int, int, str], list[list[int]]] = {}

    def add(self, server: Server, rep: int, m: dict[str, Any]) -> None:
        c = m["concurrency"]
        self.outputs[(rep, c, server.spec.label)] = [r["output_ids"] for r in m["requests"]]
        row = {
            "workload": f"closed-{self.res.data['args']['input_tokens']}-{self.res.data['args']['output_tokens']}",
            "concurrency": c,
            "policy": server.kind.policy,
            "rep": rep,
            "tok_s": round(m["throughput_tok_s"], 1),
            "tpot_ms_mean": round(m["tpot_mean_ms"], 3),
            "tpot_ms_p99": round(m["tpot_p99_ms"], 3),
            "failed": m["failed"],
        }
        self.rows.append(row)
        point = {**row, "server": server.spec.label, "wall_s": round(m["wall_s"], 2), "errors": m["errors"],
                 "accept_len_mean": m["accept_len_mean"], "ttft_ms_mean": round(m["ttft_mean_ms"], 1)}  # fmt: skip
        plain = self.outputs.get((rep, c, "plain"))
        if plain is not None:
            for label in [lbl for (r, cc, lbl) in self.outputs if r == rep and cc == c and lbl != "plain"]:
                mine = self.outputs[(rep, c, label)]
                same = sum(a == b for a, b in zip(plain, mine))
                self.res.data.setdefault("identity", {})[f"{label} rep{rep} C={c}"] = [same, len(plain)]
        self.points.append(point)
        run.log(
            f"{server.spec.label:>9} rep {rep} C={c:<3} {row['tok_s']:9.1f} tok/s  tpot {row['tpot_ms_mean']:7.2f}"
            f"/{row['tpot_ms_p99']:7.2f} ms  failed {row['failed']}"
        )
        self.flush()

    def flush(self) -> None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=SUMMARY_FIELDS)
        w.writeheader()
        w.writerows(self.rows)
        (self.out / "summary.csv").write_text(buf.getvalue())
        self.res.data["points"] = self.points
        (self.out / "offswitch.json").write_text(json.dumps(self.res.data, indent=1, default=str))
        self.res.flush()


def table(rows: list[dict[str, Any]]) -> str:
    """Per concurrency: plain tok/s, and each policy's ratio to plain (mean of per-rep ratios)."""
    by: dict[tuple[int, str], dict[int, float]] = {}
    for r in rows:
        by.setdefault((int(r["concurrency"]), r["policy"]), {})[int(r["rep"])] = float(r["tok_s"])
    policies = sorted({p for _, p in by if p != "plain"})
    lines = ["| C | plain tok/s (reps) | " + " | ".join(f"{p} / plain: mean (min-max)" for p in policies) + " |"]
    lines.append("|---" * (2 + len(policies)) + "|")
    for c in sorted({c for c, _ in by}):
        plain = by.get((c, "plain"), {})
        cells = [f"{c}", " / ".join(f"{plain[r]:.0f}" for r in sorted(plain)) or "-"]
        for p in policies:
            mine = by.get((c, p), {})
            ratios = [mine[r] / plain[r] for r in sorted(mine) if r in plain and plain[r] > 0]
            cells.append(
                f"{statistics.fmean(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), n={len(ratios)}"
                if ratios
                else "-"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_kernels(server: Server, c: int, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """GPU kernel time by name over a few decode steps at concurrency ``c`` (torch profiler)."""
    import glob
    import gzip
    import urllib.request

    out_dir.mkdir(parents=True, exist_ok=True)
    box: dict[str, Any] = {}
    spec = LoadSpec(c, c, args.input_tokens, 256, seed=4242)
    th = threading.Thread(target=lambda: box.update(m=run_load(server.url, spec, timeout_s=120)))
    th.start()
    time.sleep(2.0)
    body = json.dumps({"output_dir": str(out_dir), "num_steps": 8, "activities": ["GPU"]}).encode()
    req = urllib.request.Request(server.url + "/start_profile", data=body, headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60).read()
    except Exception as exc:
        th.join()
        return {"error": f"start_profile: {exc}"}
    th.join()
    time.sleep(2.0)
    files = sorted(glob.glob(str(out_dir / "**" / "*.json*"), recursive=True))
    if not files:
        return {"error": "no trace written"}
    opener = gzip.open if files[-1].endswith(".gz") else open
    with opener(files[-1], "rt") as fh:
        trace = json.load(fh)
    kernels: dict[str, list[float]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev:
            kernels.setdefault(ev["name"][:90], []).append(float(ev["dur"]))
    total = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:14]
    return {
        "trace": os.path.basename(files[-1]),
        "gpu_us_total": round(total, 1),
        "top": [{"name": k, "us": round(sum(v), 1), "n": len(v)} for k, v in top],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--deadline-s", type=float, default=530.0, help="start no new point after this")
    parser.add_argument("--servers", default="plain,off,off-skip,legacy", help=f"comma list of {sorted(KINDS)}")
    parser.add_argument("--backend", default="triton", choices=("triton", "flashinfer"))
    parser.add_argument("--conc", default="1,4,16,64,128", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests-per-conc", type=int, default=2, help="requests per point = this x C (min 6)")
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--target-out-std", type=float, default=0.02)
    parser.add_argument("--mem-fraction", type=float, default=0.8)
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--profile", default="", help="comma list of servers to profile at C=64 if time is left")
    args = parser.parse_args()
    unknown = [s for s in args.servers.split(",") if s not in KINDS]
    if unknown:
        parser.error(f"unknown servers {unknown}; choose from {sorted(KINDS)}")

    args.out.mkdir(parents=True, exist_ok=True)
    deadline = run.T0 + args.deadline_s
    res = run.Results(args.out)
    res.data["device"] = run.device_info()
    res.data["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    book = Book(args.out, res)
    servers: list[Server] = []
    try:
        compiler = run.setup(res)
        compiler.wait()
        importer = threading.Thread(target=run.check_imports, args=(res,))
        importer.start()
        built = run.build_models(res, "8b", "rand", target_out_std=args.target_out_std)
        importer.join()
        res.flush()
        if not (built and res.data.get("imports_ok")):
            return 1
        for i, label in enumerate(args.servers.split(",")):
            server = Server(label, KINDS[label], 31000 + i, args)
            env = run._env()
            env.update(server.kind.env)
            server.start(env)
            servers.append(server)
            time.sleep(3.0)  # staggered: each measures free memory after the last one's weights
        ready = {}
        for server in servers:
            ok, why = server.wait_ready(max(10.0, min(400.0, deadline - time.time())))
            ready[server.spec.label] = why
            run.log(f"server {server.spec.label}: {why}")
        res.event("ready", servers=ready)
        live = [s for s in servers if ready[s.spec.label] == "ready"]
        for server in live:  # warm every batch shape once, outside the timed points
            for c in args.conc:
                run_load(server.url, LoadSpec(c, c, args.input_tokens, 16, seed=7 + c))
        res.event("warm")
        for rep in range(1, args.reps + 1):
            for c in args.conc:
                order = live[rep % len(live):] + live[: rep % len(live)] if live else []
                for server in order:
                    if time.time() > deadline:
                        res.event("skipped", server=server.spec.label, rep=rep, c=c)
                        continue
                    n = max(6, args.requests_per_conc * c)
                    spec = LoadSpec(c, n, args.input_tokens, args.output_tokens, seed=1000 * rep + c)
                    m = run_load(server.url, spec, timeout_s=max(30.0, deadline - time.time() + 60))
                    book.add(server, rep, m)
        for label in filter(None, args.profile.split(",")):
            server = next((s for s in live if s.spec.label == label), None)
            if server is not None and time.time() < deadline - 25:
                res.data.setdefault("profile", {})[label] = profile_kernels(server, 64, args, run.RES / f"prof_{label}")
                book.flush()
    finally:
        for server in servers:
            server.stop()
            res.data.setdefault("servers", {})[server.spec.label] = {"argv": " ".join(server.argv()), **facts(server)}
        res.event("done")
        book.flush()
        print("\n== identity against plain (same outputs / requests)")
        for key, (same, n) in sorted(res.data.get("identity", {}).items()):
            print(f"  {key}: {same}/{n}")
        print("\n== servers")
        for label, f in res.data.get("servers", {}).items():
            print(f"  {label}: kv={f['kv'][:3]} off={f['off_switch'][:3]} switches={f['switches']} "
                  f"rule_lines={f['sglang_rule_lines']} errors={f['errors'][:2]}")  # fmt: skip
        for label, p in res.data.get("profile", {}).items():
            print(f"\n== profile {label} at C=64: {json.dumps(p)[:1500]}")
        print("\n== throughput (tok/s), ratios to plain per repetition\n" + table(book.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
