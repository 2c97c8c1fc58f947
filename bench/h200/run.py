"""The whole H200 run in one device call: set-up, models, SGLang servers, measurements.

Runs on the device machine under the image's ``python3`` (stdlib + aiohttp; SGLang 0.5.17 and
the rest come from ``.h200pack/site.tar.xz``, see ``pack_wheels.sh``). Every call of the
device tool gets a fresh machine, so each plan does its own set-up; results are written as
they complete (``$OUT/res.tar.gz`` is re-packed after every server) and a plan can be resumed
by naming only the stages not done yet (``--only``).

Plans:
  probe   check the carried packages, build the models, find an EAGLE-3 + adaptive server
          configuration that starts with CUDA graphs, measure each draft's acceptance.
  full    (see ``full_plan``) static depths, sglang-adaptive and the controller at C = 1, 4,
          16, 64 for each acceptance level, greedy-output identity, controller kill -9.

Usage (device, repo root): python3 bench/h200/run.py --plan probe --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from build_models import POSITIONS  # noqa: E402
from loadgen import LoadSpec, run_load, start_load  # noqa: E402

ROOT = Path(os.environ.get("H200_ROOT", "/root"))
SITE = ROOT / "site"
MODELS = ROOT / "models"
RES = ROOT / "res"
T0 = time.time()
LEVEL_ENV: dict[str, dict[str, str]] = {}  # --level-env


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- results


class Results:
    """``summary.json`` plus logs under RES, re-packed into ``$OUT/res.tar.gz`` on ``flush``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {"started_unix": T0, "events": [], "runs": []}
        self.done: set[tuple[str, str]] = set()
        if (RES / "summary.json").exists():
            # A warm machine kept an earlier call's results: keep them, and do not redo their runs.
            prev = RES / f"prev_{int(T0)}"
            prev.mkdir(parents=True)
            for f in RES.iterdir():
                if f != prev and not f.name.startswith("prev_"):
                    shutil.move(str(f), prev / f.name)
            old = json.loads((prev / "summary.json").read_text())
            count: dict[tuple[str, str], int] = {}
            for m in old.get("runs", []):
                key = (m["server"], m["policy"])
                count[key] = count.get(key, 0) + (m["failed"] == 0)
            self.done = {k for k, n in count.items() if n >= 4}
            self.data["previous"] = {
                "folder": prev.name,
                "done": sorted(self.done),
                "kill9": old.get("kill9"),
            }
        RES.mkdir(parents=True, exist_ok=True)

    def event(self, what: str, **kw: Any) -> None:
        self.data["events"].append({"t_s": round(time.time() - T0, 1), "what": what, **kw})
        self.save()

    def save(self) -> None:
        (RES / "summary.json").write_text(json.dumps(self.data, indent=1, default=str))

    def flush(self) -> None:
        self.save()
        tmp = ROOT / "res.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(RES, arcname="res")
        shutil.move(tmp, self.out / "res.tar.gz")
        shutil.copy(RES / "summary.json", self.out / "summary.json")


# --------------------------------------------------------------------------- set-up


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{SITE}:{REPO}:{ROOT / 'ep'}"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["SGLANG_DISABLE_REQUEST_LOGGING"] = "1"
    return env


def setup(res: Results) -> subprocess.Popen[bytes]:
    """Unpack the carried packages; compile them in the background (returned process)."""
    tic = time.time()
    if (SITE / "sglang" / "__init__.py").exists() and (ROOT / "ep").is_dir():
        res.event("unpacked", s=0.0, reused=True)  # a warm machine kept the last call's files
        return subprocess.Popen(["true"])
    SITE.mkdir(parents=True, exist_ok=True)
    if shutil.which("xz"):
        cmd = f"xz -T0 -dc {REPO}/.h200pack/site.tar.xz | tar -C {SITE} -xf -"
        subprocess.run(cmd, shell=True, check=True)
    else:
        with tarfile.open(REPO / ".h200pack/site.tar.xz", "r:xz") as tar:
            tar.extractall(SITE)
    with tarfile.open(REPO / ".h200pack/tokenizer.tar.xz", "r:xz") as tar:
        tar.extractall(ROOT)
    # The entry point that lets SGLang's load_plugins() find our hook: a dist-info on the path.
    ep = ROOT / "ep/specdepth-0.1.0.dist-info"
    ep.mkdir(parents=True, exist_ok=True)
    (ep / "METADATA").write_text("Metadata-Version: 2.1\nName: specdepth\nVersion: 0.1.0\n")
    (ep / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nspec_controller = sglang_hook.plugin:register\n\n"
        "[console_scripts]\ncontroller = controller.cli:main\n"
    )
    res.event("unpacked", s=round(time.time() - tic, 1))
    return subprocess.Popen(
        [sys.executable, "-m", "compileall", "-q", "-j16", str(SITE)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def device_info() -> dict[str, Any]:
    q = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError as exc:
        out = f"no nvidia-smi: {exc}"
    info: dict[str, Any] = {"nvidia_smi": out, "python": sys.version.split()[0], "nproc": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    info["uname"] = " ".join(os.uname())
    return info


def check_imports(res: Results) -> bool:
    code = (
        "import sglang, transformers, tokenizers, zmq, msgpack, sgl_kernel;"
        "import importlib.metadata as m;"
        "print(sglang.__version__, transformers.__version__, tokenizers.__version__, zmq.__version__,"
        " msgpack.version, [e.name for e in m.entry_points(group='sglang.srt.plugins')])"
    )
    tic = time.time()
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    res.data["imports_ok"] = p.returncode == 0
    res.event(
        "imports", ok=p.returncode == 0, s=round(time.time() - tic, 1), out=(p.stdout + p.stderr)[-1500:]
    )
    log(f"imports rc={p.returncode}: {p.stdout.strip()} {p.stderr.strip()[-500:]}")
    return p.returncode == 0


def build_models(
    res: Results, shape: str, drafts: str, target_out_std: float = 0.002, testbed: bool = False
) -> bool:
    tic = time.time()
    if (MODELS / "build.json").exists():
        build = json.loads((MODELS / "build.json").read_text())
        have = {k[len("draft_") : -len("_self_map_fraction")] for k in build if k.startswith("draft_")}
        same_target = (
            build.get("target_out_std", 0.002) == target_out_std
            and build.get("testbed", False) == testbed
            and build.get("positions") == POSITIONS
        )
        if build.get("shape") == shape and set(drafts.split(",")) <= have and same_target:
            res.data["models"] = build
            res.event("models", ok=True, s=0.0, reused=True)
            return True
    p = subprocess.run(
        [sys.executable, str(HERE / "build_models.py"), "--out", str(MODELS), "--shape", shape,
         "--drafts", drafts, "--tokenizer", str(ROOT / "tokenizer"), "--target-out-std", str(target_out_std),
         *(["--testbed"] if testbed else [])],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
    )  # fmt: skip
    build = {}
    if (MODELS / "build.json").exists():
        build = json.loads((MODELS / "build.json").read_text())
    res.data["models"] = build
    res.event("models", ok=p.returncode == 0, s=round(time.time() - tic, 1), err=p.stderr[-1500:])
    log(f"models rc={p.returncode} {json.dumps(build)} {p.stderr[-800:]}")
    return p.returncode == 0


# --------------------------------------------------------------------------- servers


@dataclass
class ServerSpec:
    """One SGLang server: which draft, which flags; ``label`` names its logs."""

    label: str
    draft: str | None  # None: no speculation
    steps: int = 5
    candidates: tuple[int, ...] = (0, 1, 3, 5)
    cuda_graph: bool = True
    cuda_graph_bs: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    adaptive: bool = True
    extra: list[str] = field(default_factory=list)
    launcher: list[str] = field(default_factory=lambda: ["-m", "sglang.launch_server"])


class Server:
    def __init__(self, spec: ServerSpec, port: int) -> None:
        self.spec = spec
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = RES / f"server_{spec.label}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        s = self.spec
        a = [sys.executable, *s.launcher, "--model-path", str(MODELS / "target"), "--host", "127.0.0.1",
             "--port", str(self.port), "--mem-fraction-static", "0.55", "--attention-backend", "triton",
             "--sampling-backend", "pytorch", "--max-running-requests", "64", "--context-length", "4096",
             "--decode-log-interval", "20", "--log-level", "info"]  # fmt: skip
        if s.cuda_graph:
            a += ["--cuda-graph-bs", *map(str, s.cuda_graph_bs)]
        else:
            a += ["--disable-cuda-graph"]
        if s.draft is not None:
            a += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(MODELS / s.draft),
                  "--speculative-num-steps", str(s.steps), "--speculative-eagle-topk", "1",
                  "--speculative-num-draft-tokens", str(s.steps + 1)]  # fmt: skip
            if s.adaptive:
                cfg = RES / f"adaptive_{s.label}.json"
                cfg.write_text(json.dumps({"1": {"candidate_steps": list(s.candidates)}}))
                a += ["--speculative-adaptive", "--speculative-adaptive-config", str(cfg)]
        return a + s.extra

    def start(self, env: dict[str, str]) -> None:
        argv = self.argv()
        (RES / f"server_{self.spec.label}.cmd").write_text(" ".join(argv) + "\n")
        self.fh = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.fh, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout_s: float) -> tuple[bool, str]:
        assert self.proc is not None
        end = time.time() + timeout_s
        while time.time() < end:
            if self.proc.poll() is not None:
                return False, f"exited rc={self.proc.returncode}"
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=5) as r:
                    if r.status == 200:
                        return True, "ready"
            except Exception:
                pass
            time.sleep(1.0)
        return False, "timeout"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except Exception:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self.fh.close()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def grep(self, needle: str) -> list[str]:
        try:
            return [ln for ln in self.log_path.read_text(errors="replace").splitlines() if needle in ln]
        except OSError:
            return []


def _slim(m: dict[str, Any]) -> dict[str, Any]:
    """A measurement without per-request rows (kept in the full file)."""
    return {k: v for k, v in m.items() if k != "requests"}


def measure(res: Results, server: Server, policy: str, specs: list[LoadSpec], deadline: float) -> list[dict]:
    out = []
    for spec in specs:
        if time.time() > deadline:
            res.event("skipped", server=server.spec.label, policy=policy, c=spec.concurrency)
            continue
        m = run_load(server.url, spec, timeout_s=max(30.0, deadline - time.time() + 30))
        m.update(server=server.spec.label, policy=policy)
        out.append(m)
        res.data["runs"].append(_slim(m))
        with open(RES / "requests.jsonl", "a") as f:
            f.write(json.dumps(m) + "\n")
        res.save()
        log(
            f"{server.spec.label:>14} {policy:>16} C={spec.concurrency:<3} "
            f"{m['throughput_tok_s']:8.0f} tok/s  tpot {m['tpot_mean_ms']:6.2f}/{m['tpot_p99_ms']:6.2f} ms  "
            f"acc_len {m['accept_len_mean']:.2f}  failed {m['failed']}"
        )
    return out


def serve_and_measure(
    res: Results, spec: ServerSpec, port: int, loads: list[LoadSpec], deadline: float, ready_s: float = 300
) -> tuple[bool, list[dict]]:
    server = Server(spec, port)
    tic = time.time()
    server.start(_env())
    ok, why = server.wait_ready(min(ready_s, max(10.0, deadline - time.time())))
    start_s = round(time.time() - tic, 1)
    log(f"server {spec.label}: {why} after {start_s}s")
    runs: list[dict] = []
    try:
        if ok:
            runs = measure(res, server, "sglang-adaptive" if spec.adaptive else "static", loads, deadline)
    finally:
        server.stop()
    switches = server.grep("Switch adaptive runtime state")
    res.event(
        "server",
        label=spec.label,
        ok=ok,
        why=why,
        start_s=start_s,
        argv=" ".join(server.argv()),
        built_states=server.grep("Built adaptive runtime state")[:8],
        adaptive_init=server.grep("AdaptiveSpeculativeParams initialized")[:2],
        switches=len(switches),
        switch_examples=switches[:6],
        tail=server.log_tail(30 if ok else 80),
    )
    res.flush()
    return ok, runs


# --------------------------------------------------------------------------- controller


class Controller:
    """``controller serve`` in its own process group, recording traces into ``record``."""

    def __init__(self, policy: str, bind: str, record: Path, label: str) -> None:
        self.policy = policy
        self.bind = bind
        self.record = record
        self.log_path = RES / f"controller_{label}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> bool:
        self.record.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "controller.cli", "serve", "--policy", self.policy, "--bind", self.bind,
                "--record", str(self.record)]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, env=_env(), stdout=self.fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        end = time.time() + timeout_s
        while time.time() < end:
            if self.proc.poll() is not None:
                return False
            if "serving" in self.log_path.read_text(errors="replace"):
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.fh.close()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


# --------------------------------------------------------------------------- plans

DEPTHS = (0, 1, 3, 5)
CONCURRENCY = (1, 4, 16, 64)
BIND = "ipc:///tmp/spec-controller-h200.sock"


LOAD_SCALE = 1  # --scale: requests per point = SCALE x two waves (1 = what the committed results used)


def loads(seed: int) -> list[LoadSpec]:
    """C = 1, 4, 16, 64; ``LOAD_SCALE`` x about two waves of requests each, same prompts for every policy.

    At scale 1 a point lasts 0.4-6 s, so one 100-300 ms TTFT stall moves its throughput by
    10-35% (seen in bench/results/h200): use --scale 4 or more when device time allows.
    """
    n = {1: 4, 4: 8, 16: 32, 64: 128}
    return [LoadSpec(c, n[c] * LOAD_SCALE, 256, 128, seed=seed + c) for c in CONCURRENCY]


def hook_server(label: str, draft: str, cuda_graph: bool = True) -> ServerSpec:
    launcher = ["-m", "sglang_hook.launch_server", "--spec-controller", BIND,
                "--spec-depths", ",".join(map(str, DEPTHS)), "--spec-fallback", "sglang",
                "--spec-stale-ms", "200", "--spec-instance", f"h200-{label}"]  # fmt: skip
    # The hook's launcher generates --speculative-adaptive(-config) from --spec-depths.
    return ServerSpec(label, draft, steps=max(DEPTHS), candidates=DEPTHS, cuda_graph=cuda_graph,
                      adaptive=False, launcher=launcher)  # fmt: skip


def policy_runs(
    res: Results, server: Server, level: str, policies: list[tuple[str, str]], deadline: float
) -> None:
    """Each policy: (re)start the controller with it (none for SGLang's own rule), warm, measure."""
    for name, spec in policies:
        if (level, name) in res.done:
            res.event("already_done", level=level, policy=name)
            continue
        if time.time() > deadline:
            res.event("skipped_policy", level=level, policy=name)
            continue
        ctl = None
        if spec != "sglang":
            ctl = Controller(spec, BIND, RES / "traces" / level / name.replace(":", "-"), f"{level}_{name}")
            if not ctl.start():
                res.event(
                    "controller_failed", level=level, policy=name, tail=ctl.log_path.read_text()[-2000:]
                )
                ctl.stop()
                continue
        mark = len(server.grep(""))
        if ctl is not None:
            wait_flowing(server, ctl)
        else:
            run_load(server.url, LoadSpec(1, 1, 64, 16, seed=999))
        measure(res, server, name, loads(seed=100), deadline)
        if ctl is not None:
            ctl.stop()
        lines = server.grep("")[mark:]
        res.event(
            "policy_done",
            level=level,
            policy=name,
            switches=sum("Switch adaptive runtime state" in ln for ln in lines),
            switch_examples=[ln for ln in lines if "Switch adaptive runtime state" in ln][:4],
            hook_lines=[ln for ln in lines if "spec controller" in ln][:6],
            sglang_rule_lines=[ln for ln in lines if "Adaptive spec params updated" in ln][:4],
        )
        res.flush()  # a call cut short by its time limit still returns every finished policy


def wait_flowing(server: Server, ctl: Controller, timeout_s: float = 20.0) -> None:
    """Send short requests until the controller has the hook's hello, then one more.

    A restarted controller does not know the instance: the hook's next step gets
    ``unknown_instance`` and re-sends hello, which takes a few hundred ms; steps before that run
    at the fallback depth and must not be timed as the policy's.
    """
    end = time.time() + timeout_s
    while time.time() < end:
        run_load(server.url, LoadSpec(1, 1, 64, 32, seed=999))
        if "hello from" in ctl.log_path.read_text(errors="replace"):
            break
    run_load(server.url, LoadSpec(1, 1, 64, 32, seed=998))


def kill9_test(res: Results, server: Server, level: str, policy: str) -> None:
    """kill -9 the controller mid-run: no request may fail, the fallback must show in the log."""
    ctl = Controller(policy, BIND, RES / "traces" / level / "kill9", f"{level}_kill9")
    if not ctl.start():
        res.event("kill9_controller_failed", tail=ctl.log_path.read_text()[-2000:])
        return
    wait_flowing(server, ctl)
    mark = len(server.grep(""))
    spec = LoadSpec(16, 96, 256, 256, seed=777)
    tic = time.time()
    join = start_load(server.url, spec, timeout_s=240)
    time.sleep(2.0)
    ctl.kill9()
    killed_at = time.time() - tic
    time.sleep(3.0)
    ctl2 = Controller(policy, BIND, RES / "traces" / level / "kill9-restart", f"{level}_kill9_restart")
    restarted = ctl2.start()
    restarted_at = time.time() - tic
    m = join()
    ctl2.stop()
    lines = server.grep("")[mark:]
    res.data["kill9"] = {
        "level": level,
        "policy": policy,
        "requests": spec.n_requests,
        "failed": m.get("failed"),
        "errors": m.get("errors"),
        "wall_s": m.get("wall_s"),
        "killed_at_s": round(killed_at, 2),
        "restarted_at_s": round(restarted_at, 2),
        "restarted": restarted,
        "hook_lines": [ln for ln in lines if "spec controller" in ln][:10],
        "switches": [ln for ln in lines if "Switch adaptive runtime state" in ln][:10],
    }
    res.event("kill9", failed=m.get("failed"), killed_at_s=round(killed_at, 2))
    log(f"kill -9: {json.dumps(res.data['kill9'])[:1500]}")


def level_run(
    res: Results,
    level: str,
    draft: str,
    policies: list[tuple[str, str]],
    deadline: float,
    port: int,
    kill9: bool,
) -> bool:
    spec = hook_server(level, draft)
    server = Server(spec, port)
    tic = time.time()
    env = _env()
    # The hook's own cost per decode step, timed inside the real scheduler (entry rank): the
    # same profiler as bench/bench_hook.py, here with CUDA graphs and EAGLE-3 on a GPU.
    env["SPECDEPTH_PROFILE_OUT"] = str(RES / f"hookprof_{level}.jsonl")
    # Blocks of records with and without the profiler's CPU-clock syscalls, side by side: does
    # the profiler's own clock change the wall time it measures?
    env["SPECDEPTH_PROFILE_CPU_CLOCK"] = "alternate"
    env.update(LEVEL_ENV.get(level, {}))  # e.g. one level with SPECDEPTH_CLIENT_THREAD=on: an A/B
    server.start(env)
    ok, why = server.wait_ready(min(400.0, max(10.0, deadline - time.time())))
    start_s = round(time.time() - tic, 1)
    log(f"server {level}: {why} after {start_s}s")
    try:
        if ok:
            # Warm-up: prefill and decode shapes of every C, outside the timed runs (call 2 of
            # bench/results/h200 warmed only C=64 and saw 300 ms first-token stalls at C=4).
            for c in CONCURRENCY:
                run_load(server.url, LoadSpec(c, 2 * c, 256, 32, seed=5 + c))
            # ... and every depth at every C under a controller, full-length outputs.
            for d in DEPTHS:
                ctl = Controller(
                    f"builtin:static:{d}", BIND, RES / "warm" / level / str(d), f"{level}_warm{d}"
                )
                if ctl.start():
                    wait_flowing(server, ctl)
                    for c in CONCURRENCY:
                        run_load(server.url, LoadSpec(c, c, 256, 128, seed=50 + c))
                ctl.stop()
            # The timed prompts themselves, once: every policy then finds them in SGLang's prefix
            # cache. Without this the policy timed first paid their full prefill and the rest
            # did not (calls 1-4: first policy 10-30% below its own re-run at the end).
            for spec in loads(seed=100):
                run_load(server.url, spec)
            res.event("warm", level=level, s=round(time.time() - tic - start_s, 1))
            policy_runs(res, server, level, policies, deadline)
            if kill9 and time.time() < deadline - 20:
                kill9_test(
                    res, server, level, policies[-1][1] if policies[-1][1] != "sglang" else "builtin:static:3"
                )
    finally:
        server.stop()
        res.event(
            "server",
            label=level,
            ok=ok,
            why=why,
            start_s=start_s,
            argv=" ".join(server.argv()),
            plugin=server.grep("plugin")[:6],
            built_states=server.grep("Built adaptive runtime state")[:8],
            adaptive_init=server.grep("AdaptiveSpeculativeParams initialized")[:2],
            tail=server.log_tail(30 if ok else 120),
        )
        res.flush()
    return ok


def full(
    res: Results,
    deadline: float,
    policies: list[tuple[str, str]],
    levels: list[tuple[str, str]],
    no_kill9: bool = False,
) -> None:
    for i, (level, draft) in enumerate(levels):
        kill9_done = bool((res.data.get("previous") or {}).get("kill9"))
        if all((level, name) in res.done for name, _ in policies) and (i > 0 or kill9_done):
            res.event("level_already_done", level=level)
            continue
        if time.time() > deadline - 60:
            res.event("skipped_level", level=level)
            continue
        ok = level_run(
            res,
            level,
            draft,
            policies,
            deadline,
            30000 + i,
            kill9=(i == 0 and not kill9_done and not no_kill9),
        )
        if not ok and i == 0:
            # Tell graphs apart from the rest: the same server without CUDA graphs, hook proof only.
            spec = hook_server(level + "_nograph", draft, cuda_graph=False)
            serve_and_measure(res, spec, 30010, [LoadSpec(1, 2, 256, 64, seed=1)], deadline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--deadline-s", type=float, default=540.0, help="start no new work after this")
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--drafts", default="same,rand,noisy")
    parser.add_argument("--levels", default="same=draft_same,rand=draft_rand,noisy=draft_noisy")
    parser.add_argument("--policies", default="", help="extra policies, comma list of NAME=SPEC")
    parser.add_argument("--collect", action="store_true", help="only pack what a warm machine kept")
    parser.add_argument("--no-kill9", action="store_true", help="skip the kill -9 test")
    parser.add_argument("--scale", type=int, default=1, help="requests per point x this (longer points)")
    parser.add_argument(
        "--baselines",
        default="static:0,static:1,static:3,static:5,sglang-adaptive",
        help="baseline policies timed after --policies, in this order (static:K, sglang-adaptive)",
    )
    parser.add_argument(
        "--level-env",
        action="append",
        default=[],
        metavar="LEVEL:KEY=VALUE",
        help="extra environment for one level's server, e.g. same2=draft_same in --levels and "
        "same2:SPECDEPTH_CLIENT_THREAD=on for a side-by-side A/B of the hook's client thread",
    )
    parser.add_argument(
        "--repeat-first",
        action="store_true",
        help="time the first --policies entry again after the baselines (as NAME-again): shows drift",
    )
    args = parser.parse_args()

    if args.collect:
        return collect(args.out)
    global LOAD_SCALE
    LOAD_SCALE = max(1, args.scale)
    for item in args.level_env:
        level, _, kv = item.partition(":")
        key, eq, value = kv.partition("=")
        if not (level and key and eq):
            parser.error(f"--level-env {item!r}: expected LEVEL:KEY=VALUE")
        LEVEL_ENV.setdefault(level, {})[key] = value

    args.out.mkdir(parents=True, exist_ok=True)
    deadline = T0 + args.deadline_s
    res = Results(args.out)
    res.data["device"] = device_info()
    res.data["argv"] = sys.argv
    log(f"device: {res.data['device']}")
    try:
        compiler = setup(res)
        # Importing SGLang once while the models are built fills the page cache for the servers.
        compiler.wait()
        importer = threading.Thread(target=check_imports, args=(res,))
        importer.start()
        built = build_models(res, args.shape, args.drafts)
        importer.join()
        res.flush()
        if built and res.data.get("imports_ok"):
            # Extra policies (the controller's PPO zip) first: they matter most if time runs out.
            policies = [tuple(x.split("=", 1)) for x in filter(None, args.policies.split(","))]
            for name in filter(None, args.baselines.split(",")):
                policies.append((name, "sglang" if name == "sglang-adaptive" else f"builtin:{name}"))
            if args.repeat_first and args.policies:
                policies.append((policies[0][0] + "-again", policies[0][1]))
            levels = [tuple(x.split("=", 1)) for x in args.levels.split(",")]
            full(res, deadline, policies, levels, no_kill9=args.no_kill9)  # type: ignore[arg-type]
    finally:
        res.event("done")
        res.flush()
        print_table(res)
    return 0


def collect(out: Path) -> int:
    """Pack the results an earlier call left on this (warm) machine into ``out``; print them."""
    out.mkdir(parents=True, exist_ok=True)
    if not RES.is_dir():
        print(f"nothing kept: {RES} does not exist (a fresh machine)")
        return 1
    with tarfile.open(out / "res.tar.gz", "w:gz") as tar:
        tar.add(RES, arcname="res")
    for summary in sorted(RES.glob("**/summary.json")):
        print(f"== {summary}")
        data = json.loads(summary.read_text())
        fake = Results.__new__(Results)
        fake.data = data
        print_table(fake)
    return 0


def print_table(res: Results) -> None:
    print("\n== events")
    for e in res.data["events"]:
        short = {k: v for k, v in e.items() if k not in ("tail", "argv", "out", "err")}
        print(json.dumps(short, default=str)[:600])
        if e.get("what") == "server" and not e.get("ok"):
            print(e.get("tail", "")[-3000:])
    print("\n== runs")
    for m in res.data["runs"]:
        print(
            f"{m['server']:>14} {m['policy']:>16} C={m['concurrency']:<3} {m['throughput_tok_s']:8.0f} tok/s "
            f"tpot {m['tpot_mean_ms']:6.2f}/{m['tpot_p99_ms']:6.2f} ms acc_len {m['accept_len_mean']:.2f} "
            f"hist {m['accepted_drafts_histogram']} failed {m['failed']}"
        )


if __name__ == "__main__":
    sys.exit(main())
