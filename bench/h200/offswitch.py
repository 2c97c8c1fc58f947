"""Is depth 0 off? An EAGLE-3 server held at depth 0 against a plain SGLang server, on one GPU.

Runs on the device machine in one call (set-up, models, servers, loads), like ``run.py``, whose
set-up it reuses. Several servers run at once on the one GPU, each with its KV cache capped, and
the loads are interleaved across them (every repetition times each server at each concurrency,
in an order that rotates), so slow drift of the machine hits every server alike.

Servers (``--servers``):
  plain      SGLang without any ``--speculative-*`` flag: the bar.
  plain2     a second plain server, timed and compared like the others: the spread of the
             ratios and of greedy identity between two identical servers.
  off        EAGLE-3 through ``sglang_hook.launch_server``, held at depth 0 by the hook's fixed
             fallback (no controller process), depth 0 as a plain decode (the off switch,
             ``sglang_hook/off_switch.py``) with its default drafter mode, keys and values
             only (``--spec-off-draft kv``); its first 60 depth-0 steps (in the warm-up) also
             run SGLang's whole extend and log how far the two writes are apart
             (``SPECDEPTH_OFF_DRAFT_CHECK``).
  off-keep   the same, the drafter's whole extend kept at depth 0 (``--spec-off-draft keep``).
  off-skip   the same, the drafter's extend skipped at depth 0 (``--spec-off-draft skip``).
  off-inline ``off`` with the hook's client on the scheduler thread asked for by name
             (``--spec-client-thread off``), which is its default.
  off-thread ``off`` with the client on a thread of its own (``--spec-client-thread on``), which
             looks at its queue every millisecond while records flow.
  off-tick0  ``off-thread`` woken per record instead (``SPECDEPTH_CLIENT_TICK_MS=0``).
  off-cold   ``off`` with drafting resumed at once from the stub proposal
             (``SPECDEPTH_OFF_RESUME=cold``), not after one more depth-0 step.
  legacy     the same server with SGLang's own depth 0 (``--spec-off-path sglang``): a verify.
  plain-rec  the plain server started through the hook's launcher, no speculation: with
             ``--record`` its steps are recorded like the hook servers' (admissions included).

With ``--record`` each hook server (and ``plain-rec``) gets a recording controller serving
``static:0`` and the traces come back in ``traces.tar`` (``bench/h200/trace_points.py`` reads
them: where each point's time went, what an admission cost).

With ``--sample`` the listed servers start with ``stacksample/`` on their ``PYTHONPATH``, and
after the warm-up each one's scheduler stacks are sampled for ``--sample-s`` seconds at each
``--sample-conc`` under drawn lengths: ``stacks`` in ``offswitch.json`` ranks the functions
by their share of the scheduler's wall time and its µs per output token, and the log prints
them beside plain's.

Every request is greedy with random token-id prompts; requests with the same (repetition,
concurrency, index) are the same on every server, so outputs are compared token for token.
The default target (``--target-out-std 0.02``) makes each token depend on the whole context, so
identical outputs check every kernel on the path, attention included.

Writes (under ``--out``): ``summary.csv`` (``workload,concurrency,policy,rep,tok_s,tpot_ms_mean,
tpot_ms_p99,failed``: the policy is ``plain``, ``static:0``, ``static:0-keep``, ``static:0-skip``,
``static:0-sglang``), ``offswitch.json`` (per point, identity against plain, server facts) and
``res.tar.gz`` (logs), re-written after every point so a call cut short keeps what it measured.

Usage (device, repo root): python3 bench/h200/offswitch.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import policyswap  # noqa: E402  (the recording controllers of --record)
import run  # noqa: E402  (set-up, model building and server processes, shared with run.py)
from loadgen import LoadSpec, run_load, start_load  # noqa: E402

SUMMARY_FIELDS = (
    "workload",
    "concurrency",
    "policy",
    "rep",
    "tok_s",
    "tpot_ms_mean",
    "tpot_ms_p99",
    "failed",
)
CUDA_GRAPH_BS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
DEPTHS = (0, 3)


@dataclass(frozen=True)
class Kind:
    """One kind of server: its policy name in ``summary.csv`` and how it differs."""

    policy: str
    speculative: bool
    flags: tuple[str, ...] = ()  # the launcher's --spec-off-* flags
    sglang_rule: str = ""  # "default" / "tuned": SGLang's own adaptive rule, no hook
    env: tuple[tuple[str, str], ...] = ()  # added to the server's environment
    recorded: bool = False  # not speculative, but through the hook's launcher: its steps are recorded

    @property
    def hook(self) -> bool:
        """Started through ``sglang_hook.launch_server`` (a controller can drive it)."""
        return (self.speculative and not self.sglang_rule) or self.recorded


# The hook's default off switch; its first 60 depth-0 steps (in the warm-up) also run SGLang's
# whole extend and log how far the two writes are apart.
KV_FLAGS = ("--spec-off-path", "plain", "--spec-off-draft", "kv")
KV_CHECK = ("SPECDEPTH_OFF_DRAFT_CHECK", "60")
THREAD_FLAGS = (*KV_FLAGS, "--spec-client-thread", "on")  # the off switch, its client on a thread
KINDS = {
    "plain": Kind("plain", False),
    "plain2": Kind("plain-control", False),  # a second plain server: the noise floor of every ratio
    # plain SGLang through the hook's launcher: with --record, its decode steps (and the steps
    # that admitted requests) are in a trace like the speculative servers', for trace_points.py
    "plain-rec": Kind("plain-rec", False, recorded=True),
    "off": Kind("static:0", True, KV_FLAGS, env=(KV_CHECK,)),
    # kv with each depth-0 step's drafter update stored at once (the default owes up to 16)
    "off-lean": Kind("static:0-lean", True, KV_FLAGS, env=(KV_CHECK, ("SPECDEPTH_OFF_DRAFT_DEFER", "1"))),
    # kv with SGLang's whole drafter extend for a depth-0 prefill: the default until call I
    # (2026-12-06), which made the KV-only prefill extend the default
    "off-sglprefill": Kind("static:0-sglprefill", True, KV_FLAGS, env=(KV_CHECK, ("SPECDEPTH_OFF_PREFILL", "sglang"))),
    # the KV-only prefill extend asked for by name: the same server as `off` since call I, kept
    # so that the commands of calls F, H and I still run
    "off-pkv": Kind("static:0-pkv", True, KV_FLAGS, env=(KV_CHECK, ("SPECDEPTH_OFF_PREFILL", "kv"))),
    # kv with drafting resumed at once from the zeroed proposal (the default until 2026-12-06):
    # its first drafted step after depth 0 accepts nothing
    "off-cold": Kind("static:0-cold", True, KV_FLAGS, env=(KV_CHECK, ("SPECDEPTH_OFF_RESUME", "cold"))),
    # ``off`` with the hook's client inline asked for by name, as call AI (2026-12-07) ran it
    # against ``off`` when ``off`` still had the client thread; inline is the default since
    "off-inline": Kind("static:0-inline", True, (*KV_FLAGS, "--spec-client-thread", "off"), env=(KV_CHECK,)),
    # ``off`` with the client on a thread of its own that looks at its queue every 1 ms (the
    # default until call AI), and woken per record instead (``SPECDEPTH_CLIENT_TICK_MS=0``)
    "off-thread": Kind("static:0-thread", True, THREAD_FLAGS, env=(KV_CHECK,)),
    "off-tick0": Kind("static:0-tick0", True, THREAD_FLAGS, env=(KV_CHECK, ("SPECDEPTH_CLIENT_TICK_MS", "0"))),
    "off-keep": Kind("static:0-keep", True, ("--spec-off-path", "plain", "--spec-off-draft", "keep")),
    "off-skip": Kind("static:0-skip", True, ("--spec-off-path", "plain", "--spec-off-draft", "skip")),
    "legacy": Kind("static:0-sglang", True, ("--spec-off-path", "sglang")),
    # SGLang's rule as users run it: --speculative-adaptive alone (its default tiers, depths 1/3/7
    # and 0 from batch 64), and with the launcher's tiers (every depth at every batch size).
    "sglang-default": Kind("sglang-adaptive-default", True, sglang_rule="default"),
    "sglang-tuned": Kind("sglang-adaptive-tuned", True, sglang_rule="tuned"),
}


class Server(run.Server):
    """A server of one :class:`Kind`, sharing the GPU with the others (KV capped)."""

    def __init__(self, label: str, kind: Kind, port: int, args: argparse.Namespace) -> None:
        draft = getattr(args, "draft", "draft_rand")
        super().__init__(run.ServerSpec(label, draft if kind.speculative else None), port)
        self.kind = kind
        self.args = args
        self.depths: tuple[int, ...] = tuple(getattr(args, "depths", DEPTHS))
        self.endpoint = f"ipc:///tmp/specdepth-off-{label}.sock"

    def start(self, env: dict[str, str]) -> None:
        super().start({**env, **dict(self.kind.env)})

    def controller_swap(self, pack: policyswap.TracePack) -> policyswap.ControllerSwap:
        """One controller at a time on this hook server's endpoint, its traces recorded under
        ``pack.records/<label>`` and packed as each controller stops (that folder only: another
        server's controller may still be writing its own)."""
        records = pack.records / self.spec.label
        return policyswap.ControllerSwap(
            self.endpoint, run.RES, records, run._env(),
            poke=lambda: run_load(self.url, LoadSpec(1, 1, 64, 16, seed=999), timeout_s=30),
            label=self.spec.label, on_stop=lambda: pack.add_new(records),
        )  # fmt: skip

    def argv(self) -> list[str]:
        a = self.args
        common = ["--model-path", str(run.MODELS / "target"), "--host", "127.0.0.1", "--port", str(self.port),
                  "--mem-fraction-static", str(a.mem_fraction), "--max-total-tokens", str(a.max_total_tokens),
                  "--max-running-requests", str(max(a.conc)), "--context-length", str(getattr(a, "context", 4096)),
                  "--attention-backend", a.backend, "--sampling-backend", "pytorch",
                  "--cuda-graph-bs", *map(str, CUDA_GRAPH_BS), "--decode-log-interval", "40",
                  "--log-level", "info"]  # fmt: skip
        if a.no_prefill_graph:
            common.append("--disable-prefill-cuda-graph")
        if not self.kind.speculative:
            if self.kind.recorded:
                hook = ["--spec-controller", self.endpoint, "--spec-stale-ms", "200",
                        "--spec-instance", f"h200-{self.spec.label}"]  # fmt: skip
                return [sys.executable, "-m", "sglang_hook.launch_server", *hook, *common]
            return [sys.executable, "-m", "sglang.launch_server", *common]
        steps = (
            7 if self.kind.sglang_rule == "default" else max(self.depths)
        )  # SGLang's default tiers reach 7
        spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(run.MODELS / self.spec.draft),
                "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(steps + 1)]  # fmt: skip
        if self.kind.sglang_rule:
            spec.append("--speculative-adaptive")
            if self.kind.sglang_rule == "tuned":
                cfg = run.RES / f"adaptive_{self.spec.label}.json"
                cfg.write_text(json.dumps({"1": {"candidate_steps": list(self.depths)}}))
                spec += ["--speculative-adaptive-config", str(cfg)]
            return [sys.executable, "-m", "sglang.launch_server", *common, *spec]
        hook = ["--spec-controller", self.endpoint,
                "--spec-depths", ",".join(map(str, self.depths)), "--spec-fallback", "0",
                "--spec-stale-ms", "200", "--spec-instance", f"h200-{self.spec.label}", *self.kind.flags]  # fmt: skip
        return [sys.executable, "-m", "sglang_hook.launch_server", *hook, *common, *spec]


def drawn_warmup(c: int, input_tokens: int, output_tokens: int, output_sigma: float, mix: str = "") -> LoadSpec:
    """An untimed point like the timed ones at ``c`` (2c requests, drawn output lengths).

    A warm-up of ``c`` requests that finish together never runs the drain's batch sizes or
    staggered admissions. Without this point the first hook server's first timed repetition at
    64 requests ran lowest in calls AJ-AN (in AL: about 1.1 s of 70-190 ms steps, most at batch
    sizes the warm-up never ran); with it, not in AO. ``realgpu.py`` warms with it too."""
    return LoadSpec(c, max(6, 2 * c), input_tokens, output_tokens, seed=500 + c,
                    output_sigma=output_sigma or 0.7, mix=mix)  # fmt: skip


def call_traces(out: Path) -> policyswap.TracePack:
    """This call's recorded traces (a folder per call: a warm machine keeps the last call's),
    packed into ``out/traces.tar``."""
    return policyswap.TracePack(run.ROOT / f"traces_{int(run.T0)}", out)


def facts(server: Server) -> dict[str, Any]:
    """What the server's log says about memory, graphs and the depth-0 path."""
    text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""

    def grab(pattern: str, limit: int = 6) -> list[str]:
        return [ln.strip()[-300:] for ln in text.splitlines() if re.search(pattern, ln)][:limit]

    return {
        "kv": grab(r"KV Cache is allocated|max_total_num_tokens|Post-capture KV|Memory pool end"),
        "graphs": grab(r"Capture (cuda|draft|CUDA).*end|Built adaptive runtime state", 12),
        "off_switch": grab(r"spec controller", 20),
        # the hook logs how depth 0 ran when its scheduler goes idle after work: the last line
        "off_counters": [ln.strip()[-300:] for ln in text.splitlines() if "off switch so far" in ln][-1:],
        "errors": grab(r"Traceback|Error|error", 12),
        "switches": len(grab(r"Switch adaptive runtime state", 10_000)),
        "sglang_rule_lines": len(grab(r"Adaptive spec params updated", 10_000)),
    }


class Book:
    """``summary.csv`` + ``offswitch.json`` + logs, re-written into ``--out`` after every point.

    ``qualify`` (default): a workload name gets ``-<input>-<output>-<backend>`` from the run's
    args; ``realgpu.py`` turns it off and names its workloads in full.
    """

    def __init__(self, out: Path, res: run.Results, qualify: bool = True) -> None:
        self.out = out
        self.res = res
        self.qualify = qualify
        self.rows: list[dict[str, Any]] = []
        self.points: list[dict[str, Any]] = []
        self.outputs: dict[tuple[str, int, int, str], list[str]] = {}  # output hashes per request

    def add(self, server: Server, rep: int, m: dict[str, Any], policy: str = "", workload: str = "") -> None:
        c = m["concurrency"]
        policy = policy or server.kind.policy
        args = self.res.data["args"]
        name = workload or "closed"
        if self.qualify:
            out = args["output_tokens"]
            sigma = args.get("output_sigma", 0.0)
            name = f"{name}-{args['input_tokens']}-{out}{f'~{sigma:g}' if sigma else ''}-{args['backend']}"
        compared = not workload or not workload.startswith(("switch", "accept", "resume"))
        hashes = [output_hash(r["output_ids"]) for r in m["requests"]]
        if compared:  # the same requests on every policy: greedy outputs compare one by one
            self.outputs[(name, rep, c, policy)] = hashes
        row = {
            "workload": name,
            "concurrency": c,
            "policy": policy,
            "rep": rep,
            "tok_s": round(m["throughput_tok_s"], 1),
            "tpot_ms_mean": round(m["tpot_mean_ms"], 3),
            "tpot_ms_p99": round(m["tpot_p99_ms"], 3),
            "failed": m["failed"],
        }
        self.rows.append(row)
        point = {**row, "server": server.spec.label, "wall_s": round(m["wall_s"], 2), "errors": m["errors"],
                 "accept_len_mean": m["accept_len_mean"], "ttft_ms_mean": round(m["ttft_mean_ms"], 1),
                 "hist": m["accepted_drafts_histogram"], "mix": m.get("mix", ""),
                 "steady_tok_s": None if m.get("steady_tok_s") is None else round(m["steady_tok_s"], 1),
                 "steady_s": None if m.get("steady_s") is None else round(m["steady_s"], 2)}  # fmt: skip
        if compared:  # per request, a short hash of its output: identity across calls (analysis)
            point["out_hash"] = hashes
        plain = self.outputs.get((name, rep, c, "plain"))
        if plain is not None and compared:
            for label in [
                p for (w, r, cc, p) in self.outputs if (w, r, cc) == (name, rep, c) and p != "plain"
            ]:
                mine = self.outputs[(name, rep, c, label)]
                same = sum(a == b for a, b in zip(plain, mine))
                key = f"{label} rep{rep} C={c}" if self.qualify else f"{name} {label} rep{rep} C={c}"
                self.res.data.setdefault("identity", {})[key] = [same, len(plain)]
        self.points.append(point)
        run.log(
            f"{server.spec.label:>9} {policy:>24} rep {rep} C={c:<3} {row['tok_s']:9.1f} tok/s  "
            f"tpot {row['tpot_ms_mean']:7.2f}/{row['tpot_ms_p99']:7.2f} ms  failed {row['failed']}"
            + (f"  steady {point['steady_tok_s']:9.1f} tok/s over {point['steady_s']:.1f} s" if point["steady_tok_s"] else "")
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


def output_hash(ids: list[int]) -> str:
    """A short hash of one request's output token ids (equal outputs, equal hashes)."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:12]


def table(rows: list[dict[str, Any]], key: str = "tok_s") -> str:
    """Per concurrency: plain tok/s, and each policy's ratio to plain (mean of per-rep ratios).
    ``key``: ``tok_s`` (the whole point) or, from the points, ``steady_tok_s`` (while all C
    clients were busy; rows without it are left out)."""
    by: dict[tuple[int, str], dict[int, float]] = {}
    for r in rows:
        if r.get(key) is not None:
            by.setdefault((int(r["concurrency"]), r["policy"]), {})[int(r["rep"])] = float(r[key])
    policies = sorted({p for _, p in by if p != "plain"})
    lines = [
        "| C | plain tok/s (reps) | " + " | ".join(f"{p} / plain: mean (min-max)" for p in policies) + " |"
    ]
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


SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "aten::item",
              "aten::_local_scalar_dense", "aten::nonzero", "cudaStreamWaitEvent")  # fmt: skip


def timeline(events: list[dict[str, Any]], steps: int, python: dict[Any, list[tuple[float, float, str]]]) -> dict[str, Any]:
    """Where a profiled step's wall time goes on the GPU: the span of its GPU work, the part
    busy, the idle gaps; the work launched outside CUDA graphs (eager kernels, copies, memsets);
    and, when the trace has Python stacks, which code launched the work that ended each gap
    longer than 20 us (the GPU was waiting for that launch)."""
    launches: dict[Any, dict[str, Any]] = {}
    for ev in events:
        if ev.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in ev:
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = ev
    gpu = sorted(
        (float(ev["ts"]), float(ev["dur"]), str(ev.get("name", ""))[:70], (ev.get("args") or {}).get("correlation"))
        for ev in events
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev
    )
    if not gpu:
        return {}
    busy, end = 0.0, gpu[0][0]
    gaps: list[tuple[float, Any]] = []
    eager: dict[str, list[float]] = {}
    for ts, dur, name, corr in gpu:
        if ts > end:
            gaps.append((ts - end, corr))
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
        if str(launches.get(corr, {}).get("name", "")) != "cudaGraphLaunch":
            eager.setdefault(name, []).append(dur)
    span = end - gpu[0][0]
    waited: dict[str, list[float]] = {}
    for gap, corr in gaps:
        if gap < 20.0:
            continue
        ev = launches.get(corr)
        key = str(ev.get("name", "?"))[:30] if ev else "?"
        if ev is not None:
            ts = float(ev["ts"])
            frames = sorted(
                (dur, fname) for start, dur, fname in python.get(ev.get("tid"), []) if start <= ts <= start + dur
            )
            key += " <- " + " <- ".join(f for _, f in frames[:4] if "torch/" not in f)[:300]
        waited.setdefault(key, []).append(gap)
    top_eager = sorted(eager.items(), key=lambda kv: -sum(kv[1]))[:30]
    return {
        "span_us_per_step": round(span / steps, 1),
        "busy_us_per_step": round(busy / steps, 1),
        "idle_us_per_step": round((span - busy) / steps, 1),
        "gaps_over_20us_per_step": round(sum(g for g, _ in gaps if g >= 20.0) / steps, 1),
        "eager_ops_per_step": round(sum(len(v) for v in eager.values()) / steps, 1),
        "eager_us_per_step": round(sum(sum(v) for v in eager.values()) / steps, 1),
        "eager_top": [{"name": k, "n": round(len(v) / steps, 1), "us": round(sum(v) / steps, 1)} for k, v in top_eager],
        "waited_for": [
            {"launch": k, "n": len(v), "us_per_step": round(sum(v) / steps, 1)}
            for k, v in sorted(waited.items(), key=lambda kv: -sum(kv[1]))[:10]
        ],
    }


def summarize_trace(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """GPU kernel time by name; CPU runtime calls (launches, graph launches, syncs) per step; and
    for each blocking call, the innermost Python frames around it (when the trace has stacks)."""
    events = trace.get("traceEvents", [])
    kernels: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {}
    python: dict[Any, list[tuple[float, float, str]]] = {}
    for ev in events:
        cat, name = ev.get("cat"), str(ev.get("name", ""))
        if "dur" not in ev:
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.setdefault(name[:90], []).append(float(ev["dur"]))
        elif cat in ("cuda_runtime", "cuda_driver", "cpu_op"):
            if cat != "cpu_op" or any(s in name for s in SYNC_NAMES):
                runtime.setdefault(name[:60], []).append(float(ev["dur"]))
        elif cat == "python_function":
            python.setdefault(ev.get("tid"), []).append((float(ev["ts"]), float(ev["dur"]), name[:110]))
    where: dict[str, list[float]] = {}
    for ev in events:
        name = str(ev.get("name", ""))
        if (
            ev.get("cat") in ("cuda_runtime", "cpu_op")
            and "dur" in ev
            and any(s in name for s in SYNC_NAMES[:5])
        ):
            ts, frames = float(ev["ts"]), []
            for start, dur, fname in python.get(ev.get("tid"), []):
                if start <= ts <= start + dur:
                    frames.append((dur, fname))
            frames.sort()
            key = name[:30] + " <- " + " <- ".join(f for _, f in frames[:4] if "torch/" not in f)[:400]
            where.setdefault(key, []).append(float(ev["dur"]))
    total = sum(sum(v) for v in kernels.values())
    # Enough names that two servers' lists can be diffed kernel by kernel: a depth-0 step's
    # extra work is many small kernels, each far below the top dozen.
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:60]
    return {
        "timeline": timeline(events, steps, python),
        "steps": steps,
        "gpu_us_per_step": round(total / steps, 1),
        "gpu_ops_per_step": round(sum(len(v) for v in kernels.values()) / steps, 1),
        "kernels": [{"name": k, "us_per_step": round(sum(v) / steps, 1), "n": len(v)} for k, v in top],
        "runtime_per_step": {
            k: {"n": round(len(v) / steps, 1), "us": round(sum(v) / steps, 1)}
            for k, v in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:14]
        },
        "blocking_calls": [
            {"where": k, "n": len(v), "us": round(sum(v), 1)}
            for k, v in sorted(where.items(), key=lambda kv: -sum(kv[1]))[:10]
        ],
    }


def profile(
    server: Server, c: int, args: argparse.Namespace, out_dir: Path, steps: int = 6, with_stack: bool = True
) -> dict[str, Any]:
    """Profile ``steps`` decode steps at concurrency ``c`` with SGLang's torch-profiler endpoint.

    Python stacks name the code behind each blocking call and GPU gap, but tracing Python slows
    the scheduler's CPU side; the timeline of a profile without them is the faithful one."""
    import glob
    import gzip
    import urllib.request

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = (  # drawn lengths: admissions keep coming during the profiled steps
        LoadSpec(c, 4 * c, args.input_tokens, args.output_tokens, seed=4242, output_sigma=args.output_sigma)
        if args.output_sigma > 0
        else LoadSpec(c, c, args.input_tokens, 256, seed=4242)
    )
    join = start_load(server.url, spec, timeout_s=120)
    time.sleep(1.5)
    body = {"output_dir": str(out_dir), "num_steps": steps, "activities": ["CPU", "GPU"], "with_stack": with_stack}
    req = urllib.request.Request(
        server.url + "/start_profile",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(req, timeout=60).read()
    except Exception as exc:
        join()
        return {"error": f"start_profile: {exc}"}
    join()
    # The trace is written after the last profiled step, asynchronously, and a trace with Python
    # stacks takes long to write: read it once its size has stopped changing.
    files: list[str] = []
    size = -1
    for _ in range(120):
        files = sorted(glob.glob(str(out_dir / "**" / "*.json*"), recursive=True))
        now = os.path.getsize(files[-1]) if files else -1
        if files and now == size:
            break
        size = now
        time.sleep(1.0)
    if not files:
        return {"error": "no trace written"}
    try:
        opener: Any = gzip.open if files[-1].endswith(".gz") else open
        with opener(files[-1], "rt") as fh:
            trace = json.load(fh)
        summary = summarize_trace(trace, steps)
    except Exception as exc:  # a profile is a diagnostic: the call's points matter more
        return {"error": f"{type(exc).__name__}: {exc}", "trace": os.path.basename(files[-1])}
    return {"trace": os.path.basename(files[-1]), "c": c, "with_stack": with_stack, **summary}


def profiles(live: list[Server], args: argparse.Namespace, res: Any, book: Book, deadline: float) -> None:
    """``--profile`` servers at each ``--profile-conc``: all without Python stacks first (the
    faithful timings), then, with ``--profile-stack``, with them; none started within 25 s of
    the deadline."""
    for c in args.profile_conc:
        for with_stack in (False, True) if args.profile_stack else (False,):
            for label in filter(None, args.profile.split(",")):
                server = next((s for s in live if s.spec.label == label), None)
                if server is not None and time.time() < deadline - 25:
                    key = f"{label}@c{c}" + ("+stack" if with_stack else "")
                    t0 = time.time()
                    res.data.setdefault("profile", {})[key] = got = profile(
                        server, c, args, run.RES / f"prof_{key.replace('@', '_').replace('+', '_')}",
                        steps=args.profile_steps, with_stack=with_stack,
                    )  # fmt: skip
                    got["wall_s"] = round(time.time() - t0, 1)
                    res.event("profiled", key=key, s=got["wall_s"], error=got.get("error"))
                    book.flush()


STACKS = HERE / "stacksample"  # the sitecustomize that samples a server's Python stacks


def stack_dir(label: str) -> Path:
    """Where server ``label``'s sampler writes its windows (its ``SPECDEPTH_STACK_DIR``)."""
    return run.RES / f"stacks_{label}"


def scheduler_windows(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``stacksample``'s windows of a scheduler process among ``paths`` (``.json`` or
    ``.json.gz``): each window's bookkeeping, and its main thread's microseconds per
    collapsed stack, summed over the windows."""
    import gzip

    windows: list[dict[str, Any]] = []
    stacks: dict[str, int] = {}
    for path in sorted(paths):
        opener: Any = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as fh:
            rec = json.load(fh)
        if "scheduler" not in rec.get("cmdline", ""):
            continue
        windows.append({k: rec.get(k) for k in ("pid", "seconds", "samples", "sched_ms", "gc", "affinity", "loadavg")})
        for thread, per in rec["threads"].items():
            if thread.startswith("MainThread#"):
                for stack, us in per.items():
                    stacks[stack] = stacks.get(stack, 0) + us
    return windows, stacks


def stack_summary(out_dir: Path, tok_s: float, top: int = 45) -> dict[str, Any]:
    """The scheduler's main thread from ``stacksample``'s windows under ``out_dir``: each
    function's share of the samples that have it on the stack (inclusive) and at the top
    (self), with the µs per output token that share is at the window's ``tok_s``."""
    inclusive: dict[str, int] = {}  # microseconds, as the sampler weighs its samples
    leaf: dict[str, int] = {}
    stacks: dict[str, int] = {}
    windows, main = scheduler_windows(list(out_dir.glob("*.json")))
    total = sum(main.values())
    for stack, n in main.items():
        frames, line = stack.rsplit(":", 1)
        names = frames.split(";")
        for name in set(names):
            inclusive[name] = inclusive.get(name, 0) + n
        leaf[f"{names[-1]}:{line}"] = leaf.get(f"{names[-1]}:{line}", 0) + n
        short = ";".join(x.rsplit("/", 1)[-1] for x in names[-7:]) + ":" + line
        stacks[short] = stacks.get(short, 0) + n
    if not total:
        return {"error": "no scheduler samples", "windows": windows}
    us = 1e6 / tok_s if tok_s > 0 else 0.0

    def rank(d: dict[str, int], k: int) -> list[dict[str, Any]]:
        rows = sorted(d.items(), key=lambda kv: -kv[1])[:k]
        return [
            {"name": n, "share": round(c / total, 4), "us_per_tok": round(c / total * us, 2)} for n, c in rows
        ]

    return {"sampled_s": round(total / 1e6, 2), "windows": windows, "tok_s": round(tok_s, 1), "us_per_tok": round(us, 2),
            "inclusive": rank(inclusive, 4 * top), "self": rank(leaf, top), "stacks": rank(stacks, top)}  # fmt: skip


def sample_stacks(
    live: list[Server], args: argparse.Namespace, res: Any, book: Book, deadline: float
) -> None:
    """``--sample`` servers: ``--sample-s`` seconds of their scheduler's stacks at each
    ``--sample-conc``, under a load of drawn lengths that outlasts the window."""
    for c in args.sample_conc:
        for label in filter(None, args.sample.split(",")):
            server = next((s for s in live if s.spec.label == label), None)
            if server is None or time.time() > deadline - args.sample_s - 15:
                continue
            out_dir = stack_dir(label)
            for old in out_dir.glob("*.json"):
                old.unlink()
            n = max(4 * c, int((args.sample_s + 6) * 30))  # ~25 requests/s at C=64 on an H100
            spec = LoadSpec(c, n, args.input_tokens, args.output_tokens, seed=7777 + c,
                            output_sigma=args.output_sigma or 0.7)  # fmt: skip
            join = start_load(server.url, spec, timeout_s=120)
            time.sleep(2.0)
            (out_dir / "on").touch()
            t0 = time.time()
            time.sleep(args.sample_s)
            (out_dir / "on").unlink()
            m = join()
            # the window's rate: tokens over the load's whole wall is close while the load outlasts it
            tok_s = float(m.get("steady_tok_s") or m.get("throughput_tok_s") or 0.0)
            time.sleep(1.5)  # the sampler writes its window when the trigger goes
            key = f"{label}@c{c}"
            res.data.setdefault("stacks", {})[key] = got = stack_summary(out_dir, tok_s)
            got["load_wall_s"] = round(float(m.get("wall_s", 0.0)), 1)
            res.event("sampled", key=key, s=round(time.time() - t0, 1), sampled_s=got.get("sampled_s"))
            book.flush()


def kernel_diff(profiles: dict[str, Any], base: str = "plain", top: int = 12) -> list[dict[str, Any]]:
    """Each profiled server against ``base`` at the same C, kernel by kernel: GPU µs and launches
    per step, and the kernels whose time differs most (a depth-0 step's extra work is many small
    kernels, none of them in the top dozen by time)."""
    out = []
    for key, got in sorted(profiles.items()):
        label, _, c = key.partition("@")
        ref = profiles.get(f"{base}@{c}")
        if label == base or "+stack" in c or not ref or "kernels" not in got or "kernels" not in ref:
            continue
        mine = {k["name"]: k for k in got["kernels"]}
        theirs = {k["name"]: k for k in ref["kernels"]}
        steps, base_steps = got.get("steps") or 1, ref.get("steps") or 1
        rows = [
            {"name": name,
             "us": mine.get(name, {}).get("us_per_step", 0.0), "base_us": theirs.get(name, {}).get("us_per_step", 0.0),
             "n": round(mine.get(name, {}).get("n", 0) / steps, 1),
             "base_n": round(theirs.get(name, {}).get("n", 0) / base_steps, 1)}
            for name in set(mine) | set(theirs)
        ]  # fmt: skip
        rows.sort(key=lambda r: -abs(r["us"] - r["base_us"]))
        out.append({
            "server": label, "base": base, "c": c,
            "gpu_us": got.get("gpu_us_per_step"), "base_gpu_us": ref.get("gpu_us_per_step"),
            "ops": got.get("gpu_ops_per_step"), "base_ops": ref.get("gpu_ops_per_step"),
            "kernels": rows[:top],
        })  # fmt: skip
    return out


def print_stacks(stacks: dict[str, Any]) -> None:
    """Each sampled server's heaviest functions, in µs per output token, beside the plain
    server's at the same C (the difference is what the server spends that plain does not)."""
    for key, got in stacks.items():
        label, c = key.split("@")
        base = stacks.get(f"plain@{c}", {})
        ref = {r["name"]: r["us_per_tok"] for r in base.get("inclusive", [])}
        print(f"\n== stacks {key}: {got.get('sampled_s')} s sampled, {got.get('us_per_tok')} us/token "
              f"(plain {base.get('us_per_tok')}) {got.get('error', '')}")  # fmt: skip
        for w in got.get("windows", []):
            print(f"   window pid {w['pid']}: sched ms (on cpu, waiting, slices) {w.get('sched_ms')} gc {w.get('gc')} "
                  f"cpus {len(w.get('affinity') or [])} loadavg {w.get('loadavg')}")  # fmt: skip
        for r in got.get("inclusive", [])[:40]:
            print(
                f"   incl {r['share']:6.1%} {r['us_per_tok']:8.2f} us/tok  plain {ref.get(r['name'], 0.0):8.2f}  {r['name'][-110:]}"
            )
        for r in got.get("self", [])[:20]:
            print(f"   self {r['share']:6.1%} {r['us_per_tok']:8.2f} us/tok  {r['name'][-120:]}")


def switch_cost(book: Book, server: Server, args: argparse.Namespace, deadline: float) -> None:
    """Depth 0 and 3 held, and switched at every step, by a scripted controller: the switch's cost."""
    import subprocess

    endpoint = f"ipc:///tmp/specdepth-off-{server.spec.label}.sock"
    for schedule in ("static:0", "static:3", "alternate:0,3"):
        if time.time() > deadline - 20:
            book.res.event("skipped_switch", schedule=schedule)
            return
        log = run.RES / f"scripted_{server.spec.label}_{schedule.replace(':', '-').replace(',', '-')}.log"
        rec = log.with_suffix(".jsonl")
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "scripted_controller.py"), "--bind", endpoint, "--schedule", schedule,
                 "--record", str(rec)], env=run._env(), stdout=fh, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                for _ in range(20):  # until the hook has said hello to this controller
                    run_load(server.url, LoadSpec(1, 1, 64, 16, seed=999))
                    if "hello from" in log.read_text(errors="replace"):
                        break
                for c in (16, 64):
                    spec = LoadSpec(c, 2 * c, args.input_tokens, args.output_tokens, seed=5000 + c)
                    m = run_load(server.url, spec, timeout_s=120)
                    book.add(server, 0, m, policy=f"scripted-{schedule}", workload="switch")
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        depths = (
            [json.loads(ln)["depth"] for ln in rec.read_text().splitlines()[-400:]] if rec.exists() else []
        )
        switches = sum(a != b for a, b in zip(depths, depths[1:]))
        book.res.data.setdefault("switch", {})[schedule] = {
            "steps": len(depths),
            "switches_in_last": switches,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--deadline-s", type=float, default=530.0, help="start no new point after this")
    parser.add_argument(
        "--servers", default="plain,off,off-skip,legacy", help=f"comma list of {sorted(KINDS)}"
    )
    parser.add_argument("--backend", default="triton", choices=("triton", "flashinfer"))
    parser.add_argument("--conc", default="1,4,16,64,128", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--requests-per-conc", type=int, default=2, help="requests per point = this x C (min 6)"
    )
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128, help="per request (the median with --output-sigma)")
    parser.add_argument(
        "--output-sigma", type=float, default=0.0,
        help="> 0 draws each request's output length log-normally (requests then finish at different "
        "steps and admissions are steady, not waves; the workload name gets ~SIGMA); 0 fixes it",
    )  # fmt: skip
    parser.add_argument("--target-out-std", type=float, default=0.02)
    parser.add_argument("--mem-fraction", type=float, default=0.8)
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--profile", default="", help="comma list of servers to profile (after the points if time is left)")
    parser.add_argument(
        "--profile-conc", type=lambda s: [int(x) for x in s.split(",")], default=[16],
        help="concurrencies to profile at (comma list), without Python stacks (the timing)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-stack", action="store_true",
        help="also profile each with Python stacks (names the code behind each GPU gap; slow: in call F "
        "the stacked profiles of three servers at C = 64 used more than 300 s)",
    )  # fmt: skip
    parser.add_argument("--profile-steps", type=int, default=6, help="decode steps per profile")
    parser.add_argument(
        "--profile-first", action="store_true",
        help="profile right after the warm-up, before the timed points (default: after them, if time is left)",
    )  # fmt: skip
    parser.add_argument(
        "--sample", default="",
        help="servers whose scheduler stacks are sampled (stacksample/) after the warm-up, before the points",
    )  # fmt: skip
    parser.add_argument("--sample-conc", default="64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--sample-s", type=float, default=12.0, help="seconds sampled per server and C")
    parser.add_argument("--switch", default="", help="server to time static:0, static:3 and alternate:0,3 on")
    parser.add_argument(
        "--record", action="store_true",
        help="a recording controller (static:0) on each hook server and plain-rec; traces in traces.tar",
    )  # fmt: skip
    parser.add_argument(
        "--warm-drawn", action=argparse.BooleanOptionalAction, default=True,
        help="also warm each server with an untimed point of drawn lengths at each C (drawn_warmup; "
        "default on)",
    )  # fmt: skip
    parser.add_argument(
        "--no-prefill-graph",
        action="store_true",
        help="--disable-prefill-cuda-graph on every server (saves ~100 s of start-up; decode unchanged)",
    )
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
    swaps: list[policyswap.ControllerSwap] = []
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
            if label in args.sample.split(","):
                stack_dir(label).mkdir(parents=True, exist_ok=True)
                env["SPECDEPTH_STACK_DIR"] = str(stack_dir(label))
                env["PYTHONPATH"] = f"{STACKS}:{env['PYTHONPATH']}"
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
        if args.record:
            pack = call_traces(args.out)
            for server in live:
                if server.kind.hook:
                    swap = server.controller_swap(pack)
                    swaps.append(swap)
                    got = swap.use("static:0")
                    run.log(f"recording controller on {server.spec.label}: {got.why}")
        for server in live:  # warm every batch shape once, outside the timed points
            for c in args.conc:
                run_load(server.url, LoadSpec(c, c, args.input_tokens, 16, seed=7 + c))
                if args.warm_drawn:
                    run_load(server.url, drawn_warmup(c, args.input_tokens, args.output_tokens, args.output_sigma))
        res.event("warm")
        sample_stacks(live, args, res, book, deadline)  # short (about 20 s a server): before the points
        if args.profile_first:  # a call cut short keeps its profiles rather than its last points
            profiles(live, args, res, book, deadline)
        for rep in range(1, args.reps + 1):
            for c in args.conc:
                order = live[rep % len(live) :] + live[: rep % len(live)] if live else []
                for server in order:
                    if time.time() > deadline:
                        res.event("skipped", server=server.spec.label, rep=rep, c=c)
                        continue
                    n = max(6, args.requests_per_conc * c)
                    spec = LoadSpec(c, n, args.input_tokens, args.output_tokens, seed=1000 * rep + c,
                                    output_sigma=args.output_sigma)  # fmt: skip
                    m = run_load(server.url, spec, timeout_s=max(30.0, deadline - time.time() + 60))
                    book.add(server, rep, m)
        if args.switch:
            server = next((s for s in live if s.spec.label == args.switch), None)
            if server is not None:
                switch_cost(book, server, args, deadline)
        if not args.profile_first:
            profiles(live, args, res, book, deadline)
    finally:
        for swap in swaps:  # each packs its traces into traces.tar as it stops
            swap.stop()
        for server in servers:
            server.stop()
            res.data.setdefault("servers", {})[server.spec.label] = {
                "argv": " ".join(server.argv()),
                **facts(server),
            }
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
            t = p.get("timeline", {})
            print(f"\n== profile {label}: gpu {p.get('gpu_us_per_step')} us/step; " + json.dumps(
                {k: v for k, v in t.items() if k not in ("eager_top", "waited_for")}))
            for e in t.get("eager_top", [])[:10]:
                print(f"   eager {e['n']:5.1f}/step {e['us']:7.1f} us  {e['name']}")
            for w in t.get("waited_for", [])[:6]:
                print(f"   waited {w['us_per_step']:7.1f} us/step (n={w['n']}) for {w['launch'][:240]}")
        for d in kernel_diff(res.data.get("profile", {})):
            print(f"\n== kernels {d['server']} against {d['base']} at {d['c']}: gpu {d['gpu_us']} / {d['base_gpu_us']} "
                  f"us a step, {d['ops']} / {d['base_ops']} kernels and copies a step")  # fmt: skip
            for k in d["kernels"]:
                print(f"   {k['us']:8.1f} / {k['base_us']:8.1f} us  n {k['n']:5.1f} / {k['base_n']:5.1f}  {k['name'][:80]}")
        print_stacks(res.data.get("stacks", {}))
        closed = [r for r in book.rows if r["workload"].startswith("closed")]
        print("\n== throughput (tok/s), ratios to plain per repetition\n" + table(closed))
        steady = [p for p in book.points if p["workload"].startswith("closed")]
        print("\n== while all C clients were busy (steady_tok_s), ratios to plain per repetition\n"
              + table(steady, key="steady_tok_s"))  # fmt: skip
        for r in book.rows:
            if r["workload"].startswith("switch"):
                print(
                    f"switch C={r['concurrency']:<3} {r['policy']:>24} {r['tok_s']:9.1f} tok/s tpot {r['tpot_ms_mean']:.2f} ms"
                )
        print(f"switch schedules as sent: {res.data.get('switch')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
