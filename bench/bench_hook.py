"""How much time the hook adds per scheduler step, measured inside the real SGLang scheduler.

Starts a real CPU SGLang server (tiny random Llama, built locally) through
``python -m sglang_hook.launch_server`` with a real ``controller serve``, and sets
``SPECDEPTH_PROFILE_OUT`` so the entry rank writes, for every decode step, the hook's own time
(record building + the client's submit: a socket visit, or with the client thread a hand-over
+ reading the decision and the broadcast marker at every scheduler iteration since the
previous step + the actuator wrapper; the client thread's own CPU time is printed apart, as it
runs off the scheduler thread) next to that step's ``step_us``.
Then drives waves of concurrent ``/generate`` requests and prints one table.

A second table times the actuator wrapper against SGLang's own params object (real
``AdaptiveController``, in this process): on CPU SGLang never calls it, so it cannot be timed
inside the scheduler here.

Targets (issue): p50 ≤ 15 µs and p99 ≤ 40 µs per step.

By default two servers run one after the other, with the hook's client thread on and off, so
the rows compare both. (``auto``, the hook's default, is off. The thread ticks every 1 ms, the
default tick; set ``SPECDEPTH_CLIENT_TICK_MS=0`` to time it woken per record instead.)

Usage: ``python bench/bench_hook.py [--concurrency 1,4,16] [--tokens 128] [--client-thread on,off] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

P50_TARGET_US = 15.0
P99_TARGET_US = 40.0


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
    )


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


def generate(port: int, prompt: str, tokens: int) -> None:
    import requests

    requests.post(
        f"http://127.0.0.1:{port}/generate",
        json={
            "text": prompt,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
        },
        timeout=900,
    ).raise_for_status()


def wave(port: int, n: int, tokens: int) -> None:
    threads = [threading.Thread(target=generate, args=(port, f"prompt number {i}", tokens)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def read_profile(path: Path) -> dict[str, list[int]]:
    from sglang_hook.profiler import PROFILE_KEYS

    out: dict[str, list[int]] = {key: [] for key in PROFILE_KEYS}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            for k in out:
                out[k] += rec.get(k, [])
    return out


def bench_server(
    args: argparse.Namespace, root: Path, client_thread: str = "off"
) -> list[tuple[str, dict[str, list[int]]]]:
    import requests
    from _tiny_model import build_tiny_llama

    model = build_tiny_llama(root / "tiny")
    sock = f"ipc://{root}/controller-{client_thread}.sock"
    port = free_port()
    profile = root / f"profile-{client_thread}.jsonl"
    env = {**os.environ, "SPECDEPTH_PROFILE_OUT": str(profile), "PYTHONUNBUFFERED": "1"}
    ctl = start(
        [sys.executable, "-m", "controller.cli", "serve", "--policy", "builtin:static:0", "--bind", sock],
        root / f"controller-{client_thread}.log",
        env,
    )
    srv = start(
        [sys.executable, "-m", "sglang_hook.launch_server", "--spec-controller", sock,
         "--model-path", str(model), "--device", "cpu", "--model-impl", "transformers",
         "--attention-backend", "torch_native", "--host", "127.0.0.1", "--port", str(port),
         "--max-total-tokens", "65536", "--skip-server-warmup", "--spec-client-thread", client_thread],
        root / f"server-{client_thread}.log",
        env,
    )  # fmt: skip
    rows = []
    try:
        deadline = time.monotonic() + 600
        while True:
            if srv.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; see {root / f'server-{client_thread}.log'}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/health_generate", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        wave(port, 1, 16)  # warm-up, not measured
        time.sleep(0.5)
        for n in args.concurrency:
            before = len(read_profile(profile)["hook_ns"])
            wave(port, n, args.tokens)
            wave(port, 1, 40)  # pushes the last buffered records of the wave to the file
            time.sleep(0.5)
            prof = read_profile(profile)
            sel = {k: v[before:] for k, v in prof.items()}
            # Keep the steps of this wave at full concurrency (drop ramp-up/down and the flush wave).
            keep = [i for i, b in enumerate(sel["bs"]) if b == n]
            rows.append((f"{client_thread} bs={n}", {k: [v[i] for i in keep] for k, v in sel.items()}))
    finally:
        stop(srv)
        stop(ctl)
    return rows


def warm_reference_us(iters: int = 20000) -> float:
    t0 = time.thread_time_ns()
    for _ in range(iters):
        sum(range(200))
    return (time.thread_time_ns() - t0) / iters / 1000.0


def bench_runtime() -> Any:
    """The hook's runtime, installed in this process, with a real ClientThread ticking every 1 ms
    toward a controller that is not there (records are built and dropped, as when one is down)."""
    from controller.protocol import Hello
    from sglang_hook import compat, plugin
    from sglang_hook.client import ClientThread, ControllerClient
    from sglang_hook.config import HookConfig

    nobody = f"ipc://{tempfile.gettempdir()}/bench-hook-nobody.sock"
    rt = plugin.HookRuntime(HookConfig(endpoint=nobody), compat.Ranks())
    rt.instance, rt.hello_depths = "bench", (0, 1, 3, 5)
    rt.state.valid = frozenset(rt.hello_depths)
    rt.client = ClientThread(
        ControllerClient(nobody, Hello("bench", rt.hello_depths)), build=rt.build_step, tick_ms=1
    )
    plugin.reset_runtime(rt)
    return rt


def cache_thrasher() -> Any:
    """A function that evicts the caches before a timed call: a 16 MB array summed, a JSON dump,
    regex matches; closer to what the hook meets after a GPU step than back-to-back calls."""
    import json
    import re

    import numpy as np

    big = np.ones(2 << 20)
    junk = {f"k{i}": [i, str(i), {"x": i}] for i in range(3000)}
    pattern = re.compile(r"(\w+)-(\d+)")

    def thrash() -> None:
        big.sum()
        json.dumps(junk)
        for i in range(500):
            pattern.match(f"a-{i}")

    return thrash


def scheduler_path_us(iters: int = 1500, bs: int = 16) -> dict[str, tuple[float, float]]:
    """The scheduler thread's share per step, through the hook's real functions, in this process.

    ``batch_result_hook`` (the step record, handed to a real :class:`ClientThread` ticking every
    1 ms) and ``broadcast_hook`` (the iteration top), with SGLang's batch and result faked
    around a real ``ForwardMode`` at depth 3. Timed warm (back to back) and with the caches
    thrashed before every call (:func:`cache_thrasher`). Returns (p50, p99) µs per row.
    """
    from test_hook_actuator import RECEIVER, fake_decode_batch, fake_scheduler  # the tests' SGLang fakes

    from sglang_hook import plugin

    rt = bench_runtime()
    scheduler = fake_scheduler()
    batch = fake_decode_batch(list(range(bs)))
    results = [
        SimpleNamespace(speculative_num_draft_tokens=4, num_correct_drafts_per_req_cpu=[1] * bs)
        for _ in range(4)
    ]
    receiver = RECEIVER
    thrash = cache_thrasher()

    def bcast(_receiver: Any, reqs: Any) -> Any:
        return reqs

    def process(_scheduler: Any, _batch: Any, _result: Any) -> None:
        return None

    rows: dict[str, list[float]] = {
        k: [] for k in ("record, warm", "iteration top, warm", "record, cold", "iteration top, cold")
    }
    try:
        for cold in (False, True):
            suffix = ", cold" if cold else ", warm"
            for i in range(iters):
                if cold:
                    thrash()
                t0 = time.perf_counter_ns()
                plugin.broadcast_hook(bcast, receiver, [])
                rows["iteration top" + suffix].append((time.perf_counter_ns() - t0) / 1000.0)
                if cold:
                    thrash()
                t0 = time.perf_counter_ns()
                plugin.batch_result_hook(process, scheduler, batch, results[i % 4])
                rows["record" + suffix].append((time.perf_counter_ns() - t0) / 1000.0)
    finally:
        rt.client.close()
        plugin.reset_runtime(None)
    return {k: (pct(v[100:], 0.5), pct(v[100:], 0.99)) for k, v in rows.items()}


def request_loop_us(iters: int = 1500, bs: int = 64) -> dict[str, tuple[float, float]]:
    """Where SGLang keeps no CPU copy of the sequence lengths (EAGLE v2 with triton or FA3).

    The step record through the hook's real ``batch_result_hook`` with a batch of ``bs`` real
    SGLang ``Req`` objects and neither ``seq_lens_sum`` nor ``seq_lens_cpu`` (the record hands
    the request list to the client thread), interleaved with the loop the record ran there
    before (``sum(req.seqlen for req in batch.reqs)`` on the scheduler thread). Warm and with
    the caches thrashed before each call, as :func:`scheduler_path_us`. (p50, p99) µs per row.
    """
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from test_hook_actuator import fake_scheduler  # the tests' SGLang fakes

    from sglang_hook import plugin

    rt = bench_runtime()
    reqs = []
    for i in range(bs):
        req = Req(f"r{i}", "", list(range(200 + i)), SamplingParams(max_new_tokens=512))
        req.output_ids = list(range(50 + i))
        reqs.append(req)
    batch = SimpleNamespace(
        reqs=reqs, forward_mode=ForwardMode.DECODE, seq_lens_sum=None, seq_lens_cpu=None, launch_ts=None
    )
    result = SimpleNamespace(speculative_num_draft_tokens=4, num_correct_drafts_per_req_cpu=[1] * bs)
    scheduler = fake_scheduler()
    thrash = cache_thrasher()

    def process(_scheduler: Any, _batch: Any, _result: Any) -> None:
        return None

    new, old = (
        f"record, bs {bs}, request list handed over",
        f"the loop it ran before: sum of Req.seqlen, bs {bs}",
    )
    rows: dict[str, list[float]] = {f"{k}, {c}": [] for k in (new, old) for c in ("warm", "cold")}
    try:
        for cold in (False, True):
            suffix = ", cold" if cold else ", warm"
            for _ in range(iters):
                if cold:
                    thrash()
                t0 = time.perf_counter_ns()
                plugin.batch_result_hook(process, scheduler, batch, result)
                rows[new + suffix].append((time.perf_counter_ns() - t0) / 1000.0)
                if cold:
                    thrash()
                t0 = time.perf_counter_ns()
                sum(req.seqlen for req in batch.reqs)
                rows[old + suffix].append((time.perf_counter_ns() - t0) / 1000.0)
    finally:
        rt.client.close()
        plugin.reset_runtime(None)
    return {k: (pct(v[100:], 0.5), pct(v[100:], 0.99)) for k, v in rows.items()}


def bench_wrapper(iters: int = 20000) -> list[tuple[str, float]]:
    """Per-call cost of the actuator wrapper vs SGLang's own params (real AdaptiveController)."""
    from sglang_hook import compat
    from sglang_hook.actuator import ActuatorState, TpSync, wrap_controller_params

    sys.path.insert(0, str(REPO / "tests"))
    from test_hook_actuator import MinimalAdaptiveWorker

    tmp = Path(tempfile.mkdtemp(prefix="bench-hook-"))
    cfg = tmp / "a.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": [0, 1, 2, 3, 5]}}))
    out = []
    for label, wrap in (("SGLang params (baseline)", False), ("wrapped, controller depth", True)):
        worker = MinimalAdaptiveWorker(3)
        ctl = compat.new_adaptive_controller(worker, str(cfg))
        if wrap:
            state = ActuatorState()
            wrap_controller_params(ctl, state, None)
            sync = TpSync(state)
            sync.take([sync.offer(3)])
        ctl.register(worker.build_adaptive_runtime_state(3, 4))
        ctl.init_states(None)
        p = ctl.params
        acc = [2, 3, 1, 0]
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            p.get_steps_for_batch(4)
            p.on_verify_complete(acc, 4)
        out.append((label, (time.perf_counter_ns() - t0) / iters / 1000.0))
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrent requests per wave")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--keep", help="keep logs and the profile in this folder")
    ap.add_argument(
        "--client-thread",
        default="on,off",
        help="servers to run one after the other: the hook's --spec-client-thread on, off and/or auto",
    )
    ap.add_argument(
        "--in-process-only",
        action="store_true",
        help="skip the servers: only the tables timed in this process (seconds instead of minutes)",
    )
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    if args.in_process_only:
        in_process_tables()
        return 0
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-hook-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = [row for mode in args.client_thread.split(",") for row in bench_server(args, root, mode.strip())]
    print("\nHook time per decode step, inside the real SGLang scheduler (CPU, tiny Llama, depth 0)")
    print("wall = perf_counter (includes preemption on a busy host); cpu = the scheduler thread's CPU time")
    head = f"{'thread batch':>12} {'steps':>6} {'wall p50':>9} {'wall p99':>9} {'cpu p50':>8} {'cpu p99':>8} {'step p50':>9}"
    print(head + f" {'cpu/step':>9}   (µs)")
    for label, prof in rows:
        wall = [x / 1000.0 for x in prof["hook_ns"]]
        cpu = [x / 1000.0 for x in prof["hook_cpu_ns"]]
        step = pct([float(x) for x in prof["step_us"]], 0.5)
        print(
            f"{label:>12} {len(wall):>6} {pct(wall, 0.5):>9.1f} {pct(wall, 0.99):>9.1f} {pct(cpu, 0.5):>8.1f} "
            f"{pct(cpu, 0.99):>8.1f} {step:>9.0f} {pct(cpu, 0.5) / step:>9.3%}"
        )
    ok = True
    for mode in dict.fromkeys(label.split()[0] for label, _ in rows):
        mine = [prof for label, prof in rows if label.split()[0] == mode]
        all_wall = [x / 1000.0 for prof in mine for x in prof["hook_ns"]]
        all_cpu = [x / 1000.0 for prof in mine for x in prof["hook_cpu_ns"]]
        print(
            f"{mode + ' all':>12} {len(all_wall):>6} {pct(all_wall, 0.5):>9.1f} {pct(all_wall, 0.99):>9.1f} "
            f"{pct(all_cpu, 0.5):>8.1f} {pct(all_cpu, 0.99):>8.1f}"
        )
        sites = ("rec_ns", "send_ns", "poll_ns", "wrap_ns", "sender_cpu_ns", "lag_ns")
        split = {k: pct([x / 1000.0 for prof in mine for x in prof.get(k, [])], 0.5) for k in sites}
        print(
            "  by call site, wall p50: step record {rec_ns:.1f} (of which the client's submit "
            "{send_ns:.1f}), iteration tops {poll_ns:.1f}, actuator wrapper {wrap_ns:.1f} µs".format(**split)
        )
        if any(x for prof in mine for x in prof.get("sender_cpu_ns", [])):  # a client thread ran
            print(
                "  off the scheduler thread, p50: the client thread's CPU per step {sender_cpu_ns:.1f} µs; "
                "a record waits {lag_ns:.1f} µs from its timestamp to its send".format(**split)
            )
        gc_us = [x / 1000.0 for prof in mine for x in prof.get("gc_ns", [])]
        if gc_us:
            hit = [x for x in gc_us if x > 0]
            net = [w - g for w, g in zip(all_wall, gc_us, strict=True)]
            print(
                f"  garbage collections inside the hook's windows: {len(hit)} of {len(gc_us)} steps "
                f"({(sum(hit) / len(hit)) if hit else 0.0:.1f} µs each on average); "
                f"wall without them p50 {pct(net, 0.5):.1f}, p99 {pct(net, 0.99):.1f} µs"
            )
        for name, vals in (("wall", all_wall), ("cpu", all_cpu)):
            p50, p99 = pct(vals, 0.5), pct(vals, 0.99)
            verdict = "PASS" if p50 <= P50_TARGET_US and p99 <= P99_TARGET_US else "FAIL"
            print(f"  targets p50 <= {P50_TARGET_US} us, p99 <= {P99_TARGET_US} us on {name} time: {verdict}")
        ok = ok and pct(all_cpu, 0.5) <= P50_TARGET_US and pct(all_cpu, 0.99) <= P99_TARGET_US
    ref = [x / 1000.0 for _, prof in rows for x in prof["ref_cpu_ns"]]
    polls = [x for _, prof in rows for x in prof["polls"]]
    print(
        f"reference: sum(range(200)) timed at the same point costs p50 {pct(ref, 0.5):.1f} µs cpu here "
        f"(warm, idle: {warm_reference_us():.1f} µs); polls per step p50 {pct([float(p) for p in polls], 0.5):.0f}"
    )
    in_process_tables()
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


def in_process_tables() -> None:
    """The tables timed in this process, through the hook's real functions."""
    print(
        "\nThe scheduler thread's share through the hook's real functions, this process (SGLang's batch"
        "\nfaked, depth 3, bs 16, client thread ticking; cold = caches thrashed before each call)"
    )
    for label, (p50, p99) in scheduler_path_us().items():
        print(f"{label:>28} p50 {p50:6.1f}  p99 {p99:6.1f} µs")
    print(
        "\nWithout SGLang's CPU sequence lengths (EAGLE v2 with triton or FA3), real SGLang Reqs,"
        "\nthe record and the per-request loop it ran before, interleaved"
    )
    for label, (p50, p99) in request_loop_us().items():
        print(f"{label:>58} p50 {p50:6.1f}  p99 {p99:6.1f} µs")
    print(
        "\nActuator wrapper (get_steps_for_batch + on_verify_complete), this process, real AdaptiveController"
    )
    for label, us in bench_wrapper():
        print(f"{label:>28} {us:>8.2f} µs/step")


if __name__ == "__main__":
    sys.exit(main())
