"""The H200 real-server harness (``bench/h200/realgpu.py``) without a GPU: the controller swap
against real ``controller serve`` processes and the hook's own client, the open-loop trace,
which servers and policies a call runs, and the report's ratios and criteria."""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from controller.protocol import Hello, Step
from controller.registry import BUILTINS
from controller.traces import iter_records
from sglang_hook.client import ControllerClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "h200"))

import offswitch  # noqa: E402
import openloop  # noqa: E402
import policyswap  # noqa: E402
import realgpu  # noqa: E402
import realgpu_report  # noqa: E402

DEPTHS = realgpu.DEPTHS


# --------------------------------------------------------------------------- the swap


class Hook:
    """The hook's side as the scheduler drives it: a ControllerClient fed one step per decode."""

    def __init__(self, endpoint: str, instance: str = "h200-off") -> None:
        self.instance = instance
        self.client = ControllerClient(endpoint, Hello(instance, DEPTHS), stale_ms=200)
        self.seq = itertools.count(1)
        self.depth = 0  # the depth the last step ran with: the decision, else the fallback (0)

    def step(self) -> None:
        accept = [1, 0] if self.depth else []
        self.client.send_step(
            Step(
                self.instance, next(self.seq), self.depth, 2, 0, accept, 8000, 600, 0.01, 0, time.monotonic_ns()
            )
        )
        time.sleep(0.005)
        got = self.client.poll_decision()
        self.depth = 0 if got is None else got

    def poke(self) -> None:  # a short request: a few decode steps
        for _ in range(10):
            self.step()

    def until(self, depth: int, timeout_s: float = 10.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.step()
            if self.depth == depth:
                return True
        return False

    def answered(self, timeout_s: float = 10.0) -> bool:
        """Whether a decision answers the last step within ``timeout_s``, sending no more steps
        (a loaded machine may take longer than ``stale_ms`` to answer one)."""
        end = time.monotonic() + timeout_s
        while self.client.fresh_depth() is None and time.monotonic() < end:
            time.sleep(0.005)
            self.client.poll_decision()
        return self.client.fresh_depth() is not None


@pytest.mark.slow
def test_swap_moves_the_hook_from_controller_to_controller_and_packs_their_traces(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/hook.sock"
    hook = Hook(endpoint)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    records = tmp_path / "traces"
    pack = policyswap.TracePack(records, tmp_path)
    swap = policyswap.ControllerSwap(
        endpoint, tmp_path / "logs", records, env, hook.poke, on_stop=pack.add_new
    )
    try:
        first = swap.use("static:1")
        assert first.live, first.why
        assert hook.until(1) and hook.client.policy == "static:1"
        assert swap.use("static:1").why == "already running"  # no restart for the same policy

        second = swap.use("static:3")
        assert second.live, second.why
        assert second.stopped["policy"] == "static:1" and int(second.stopped["steps"]) > 0  # type: ignore[call-overload]
        assert pack.n == 1  # static:1's trace, packed once it was closed, before static:3 started
        assert hook.until(3) and hook.client.policy == "static:3"

        broken = swap.use("no-such-policy")  # controller serve refuses it: the hook falls back to 0
        assert not broken.live and "unknown builtin" in broken.why
        assert hook.until(0)
        assert swap.use("no-such-policy").why != "already running"  # asked again: tried again

        # The fallback is not permanent: the next controller gets the hook back.
        again = swap.use("bandit")
        assert again.live, again.why
        assert hook.client.policy == "bandit"
        hook.poke()

        # goodput on a fitted latency model, through the service's own loop (serve_goodput_fit.py).
        fit = swap.use(f"goodput-fit=goodput-fit:{ROOT / 'agents/bundled/h200-llama8b/sim.json'}")
        assert fit.live, fit.why
        assert fit.stopped["policy"] == "bandit" and int(fit.stopped["steps"]) > 0  # type: ignore[call-overload]
        assert hook.client.policy == "goodput-fit"
        hook.poke()
        assert hook.answered() and hook.client.counters["decisions"] > 0
        assert hook.client.fresh_depth() in DEPTHS
        assert swap.stop()["steps"] > 0  # type: ignore[operator]
    finally:
        swap.stop()
        hook.client.close()
    tried = ["static:1", "static:3", "no-such-policy", "no-such-policy", "bandit", "goodput-fit"]
    assert [s.policy for s in swap.history] == tried
    assert pack.n == 4 and pack.add_new() == 0  # one file per controller that served, each packed once
    with tarfile.open(tmp_path / "traces.tar") as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert sorted(n.split("/")[1].split("-h200-off")[0] for n in names) == [
        "bandit",
        "goodput-fit",
        "static-1",
        "static-3",
    ]
    steps = [r for f in (tmp_path / "unpacked/traces").iterdir() for r in iter_records(f) if r["t"] == "step"]
    assert len(steps) > 20
    # The folder is what `controller train --traces` reads: it lists the files flat.
    out = subprocess.run(
        [sys.executable, "-m", "controller.cli", "traces", "summarize", str(tmp_path / "unpacked/traces")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_a_swap_on_one_server_leaves_the_trace_another_server_still_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two hook servers in one call, with offswitch's own wiring: a swap on `off` must not pack
    # the file that plain-rec's controller is still writing (a file is packed once: what came
    # after was lost, call AG's plain-rec repetition 71).
    monkeypatch.setattr(offswitch.run, "RES", tmp_path / "res")  # the controllers' logs
    pack = policyswap.TracePack(tmp_path / "traces", tmp_path)
    hooks, swaps = {}, {}
    for port, label in enumerate(("plain-rec", "off"), 30000):
        server = offswitch.Server(label, offswitch.KINDS[label], port, argparse.Namespace())
        server.endpoint = f"ipc://{tmp_path}/{label}.sock"
        hooks[label] = Hook(server.endpoint, f"h200-{label}")
        swaps[label] = server.controller_swap(pack)
        swaps[label].poke = hooks[label].poke  # no SGLang here: the hook's steps come from the test
    rec, off = hooks["plain-rec"], hooks["off"]
    try:
        assert swaps["plain-rec"].use("static:0").live and swaps["off"].use("static:0").live
        rec.poke()
        assert swaps["off"].use("static:3").live  # packs off's static:0
        assert off.until(3)
        rec.poke()  # plain-rec's controller still writes the file it opened first
        sent = next(rec.seq) - 1
    finally:
        for swap in swaps.values():
            swap.stop()
        for hook in hooks.values():
            hook.client.close()
    assert pack.n == 3 and pack.add_new() == 0  # each file packed once, by its own server's swap
    with tarfile.open(tmp_path / "traces.tar") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    seqs = {
        r["seq"]
        for f in (tmp_path / "unpacked/traces").iterdir()
        for r in iter_records(f)
        if r["t"] == "step" and r["instance"] == "h200-plain-rec"
    }
    assert sent in seqs  # the last step, sent after off's swap packed, is in the trace


def test_policy_names_map_to_what_runs() -> None:
    r = policyswap.resolve
    assert r("static:3").spec == "builtin:static:3"
    assert r("ppo").spec == str(ROOT / "agents/bundled/h200-llama8b/ppo.zip")
    assert r("ppo-retrained").spec.endswith("bench/results/realgpu/ppo-retrained/ppo.zip")
    assert r("mine=/x/y.zip") == policyswap.PolicySpec("mine", "/x/y.zip")
    assert r("/x/other.zip") == policyswap.PolicySpec("other", "/x/other.zip")
    assert r("scripted:static:3").scripted and r("static:3").slug == "static-3"
    assert r("goodput-fit").spec == "goodput-fit:" + str(
        ROOT / "bench/results/realgpu/ppo-retrained/sim.json"
    )
    assert (ROOT / policyswap.NAMED_ZIPS["ppo"]).exists()
    # Every default hook policy is a builtin `controller serve` serves, or a named zip.
    for stage in ("closed", "long", "open"):
        for name in realgpu.default_policies(stage):
            if (
                name in realgpu.SERVER_POLICIES
                or name in policyswap.NAMED_ZIPS
                or name in policyswap.NAMED_SIMS
            ):
                continue
            assert any(name == b or (b.endswith(":") and name.startswith(b)) for b in BUILTINS), name


def test_each_server_gets_the_controller_its_policy_needs() -> None:
    """The hook server serves the timed policy, ``plain-rec`` records under static:0 (its steps
    are the plain server's, in records), the other servers run without a controller."""
    kinds = offswitch.KINDS
    live = realgpu.live_policy
    assert live(kinds["off"], "off", "ppo") == "ppo"
    assert realgpu.SERVER_POLICIES["plain-rec"] == "plain-rec"
    assert live(kinds["plain-rec"], "plain-rec", "plain-rec") == "static:0"
    assert live(kinds["plain"], "plain", "plain") is None
    assert live(kinds["off-keep"], "off-keep", "static:0-keep") is None
    # The resume stage drives the variant it names with its scripted controller.
    assert live(kinds["off-keep"], "off-keep", "scripted:resume", on="off-keep") == "scripted:resume"
    assert realgpu.servers_needed(["plain", "plain-rec", "static:0"]) == ["plain", "plain-rec", "off"]


def test_parse_starts_only_the_servers_the_stages_need() -> None:
    args = realgpu.parse(["--stages", "closed,long,open"])
    assert args.server_labels == ["plain", "off", "sglang-default", "sglang-tuned"]
    assert set(realgpu.STATICS) | set(realgpu.BUILTINS) | {"ppo", "plain"} <= set(args.policies)
    args = realgpu.parse(["--stages", "open", "--open-policies", "ppo,static:3"])
    assert args.server_labels == ["off"]
    args = realgpu.parse(["--stages", "closed", "--policies", "plain,sglang-adaptive-tuned"])
    assert args.server_labels == ["plain", "sglang-tuned"]
    # The off-switch variants: their depth 0 is a server of its own; resume drives each hook server.
    args = realgpu.parse(["--stages", "closed,resume", "--policies", "plain,static:0,static:0-keep",
                          "--resume-servers", "off,off-keep"])  # fmt: skip
    assert args.server_labels == ["plain", "off", "off-keep"]
    assert realgpu.SERVER_POLICIES["static:0-keep"] == "off-keep" and "static:0" not in realgpu.SERVER_POLICIES
    with pytest.raises(SystemExit):
        realgpu.parse(["--stages", "resume", "--resume-servers", "plain"])  # no controller drives it
    # The bundled PPO zip was trained for these depths; the hook server must offer exactly them.
    meta = json.loads(
        __import__("zipfile").ZipFile(ROOT / policyswap.NAMED_ZIPS["ppo"]).read("specdepth.json")
    )
    assert tuple(meta["depths"]) == realgpu.DEPTHS
    assert [realgpu.rotate([1, 2, 3], rep) for rep in (1, 2, 3, 4)] == [
        [1, 2, 3],
        [2, 3, 1],
        [3, 1, 2],
        [1, 2, 3],
    ]
    assert [realgpu.rotate(list(range(15)), rep)[0] for rep in (1, 2, 3)] == [0, 5, 10]


def stage_points(args: argparse.Namespace, stage: str) -> list[tuple[int, str, str, realgpu.LoadSpec]]:
    """(rep, policy, workload, load) of each point ``realgpu.stage_loop`` measures, in order, on
    a bench with time left whose every policy goes live on the hook server."""
    points: list[tuple[int, str, str, realgpu.LoadSpec]] = []

    class Bench:
        def time_left(self, need_s: float) -> bool:
            return True

        def use(self, policy: str) -> str:
            return "off"

        def measure(self, server: str, policy: str, spec: realgpu.LoadSpec, rep: int, workload: str) -> None:
            points.append((rep, policy, workload, spec))

    realgpu.stage_loop(Bench(), args, stage)  # type: ignore[arg-type]
    return points


def test_the_long_stage_runs_each_prompt_length_for_each_policy_and_sizes_the_context() -> None:
    """``--long-input`` as a list: per repetition and policy (one controller start), each length
    at each C, every point named by its length; the servers' context holds the longest prompt
    plus the longest output a request may draw, and a context too short is refused."""
    args = realgpu.parse(["--stages", "long", "--long-input", "4096,32768", "--long-conc", "1,4",
                          "--long-policies", "static:0,static:3", "--reps", "2"])  # fmt: skip
    assert args.long_input == [4096, 32768] and args.context == 32768 + 512
    drawn = realgpu.parse(["--stages", "long", "--long-input", "4096,32768", "--output-sigma", "0.7"])
    assert drawn.context == 32768 + realgpu.OUTPUT_BOUNDS[1]
    assert realgpu.parse(["--stages", "long"]).context == 8192 + 512  # the single length, as before
    with pytest.raises(SystemExit):
        realgpu.parse(["--stages", "long", "--long-input", "32768", "--context", "32768"])

    measured = [(rep, policy, workload, spec.input_tokens, spec.concurrency)
                for rep, policy, workload, spec in stage_points(args, "long")]  # fmt: skip
    out = "128"
    assert measured == [
        (rep, policy, f"long-mix-{n}-{out}", n, c)
        for rep, order in ((1, ["static:0", "static:3"]), (2, ["static:3", "static:0"]))
        for policy in order
        for n in (4096, 32768)
        for c in (1, 4)
    ]


def test_every_hook_server_command_is_one_the_launcher_accepts(tmp_path: Path) -> None:
    """``offswitch.Server.argv`` for each kind started through the hook's launcher parses with
    the launcher's own ``plan``; ``plain-rec`` is the plain server (no speculation) with a
    controller endpoint, so ``--record`` can record its steps."""
    import argparse

    import offswitch

    from sglang_hook.launch_server import plan

    args = argparse.Namespace(mem_fraction=0.8, max_total_tokens=49152, conc=[16, 64], backend="triton",
                              no_prefill_graph=True, context=4096)  # fmt: skip
    for label, kind in offswitch.KINDS.items():
        if kind.sglang_rule:  # SGLang's own rule, no hook (its argv writes its config on the device)
            continue
        argv = offswitch.Server(label, kind, 31000, args).argv()
        if not kind.hook:
            assert argv[2] == "sglang.launch_server" and "--spec-controller" not in argv
            continue
        assert argv[2] == "sglang_hook.launch_server", label
        p = plan(argv[3:], str(tmp_path / "adaptive.json"))
        assert p.speculative == kind.speculative and p.config.endpoint == f"ipc:///tmp/specdepth-off-{label}.sock"
        assert ("--speculative-algorithm" in argv) == kind.speculative, label
    assert offswitch.KINDS["plain-rec"].hook and not offswitch.KINDS["plain-rec"].speculative


def test_help_runs_without_sglang() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench/h200/realgpu.py"), "--help"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "--open-policies" in out.stdout


# --------------------------------------------------------------------------- the open-loop trace


def test_open_trace_is_deterministic_and_shifts_load_and_mix() -> None:
    spec = openloop.OpenSpec(duration_s=180, peak_rps=80, seed=0)
    a, b = openloop.arrivals(spec), openloop.arrivals(spec)
    assert a == b and [openloop.prompt(spec, x) for x in a[:50]] == [openloop.prompt(spec, x) for x in b[:50]]
    assert openloop.arrivals(openloop.OpenSpec(duration_s=180, peak_rps=80, seed=1)) != a
    times = [x.t_s for x in a]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 180
    # The expected count is the rate's integral: about 0.40 x peak x duration.
    assert abs(len(a) - 0.3995 * 80 * 180) < 4 * (0.3995 * 80 * 180) ** 0.5
    bins = openloop.describe(spec, bins=10)
    rps = [b["rps"] for b in bins]
    assert rps[0] < 0.05 * 80 and rps[-1] < 0.05 * 80  # a trickle at both ends
    assert max(rps) > 0.8 * 80 and rps.index(max(rps)) in (4, 5)  # overload in the middle
    assert bins[0]["chat"] == 1.0 and bins[-1]["docs"] == 1.0  # chat -> docs
    mid = [x for x in a if 0.4 * 180 <= x.t_s < 0.6 * 180]
    assert sum(x.family == "code" for x in mid) / len(mid) > 0.75  # code leads the overload
    for x in a[:200]:
        fam = openloop.testbed.FAMILIES[x.family]
        assert all(fam.lo <= t < fam.hi for t in openloop.prompt(spec, x))
        assert spec.min_output_tokens <= x.output_tokens <= spec.max_output_tokens
    assert abs(sum(openloop.mix(0.3).values()) - 1) < 1e-12


class StandIn:
    """A stand-in for SGLang's streaming ``/generate`` (aiohttp, its own thread): the open-loop
    client's timing and accounting, not the engine, are under test here."""

    def __init__(self) -> None:
        import asyncio
        import threading

        from aiohttp import web

        self.seen: list[tuple[float, int]] = []  # (received at, max_new_tokens)

        async def generate(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            n = body["sampling_params"]["max_new_tokens"]
            self.seen.append((time.perf_counter(), n))
            resp = web.StreamResponse()
            await resp.prepare(request)
            for i in range(1, n + 1):
                await asyncio.sleep(0.002)
                chunk = {"output_ids": [body["input_ids"][-1]] * i, "meta_info": {"completion_tokens": i}}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/generate", generate)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_open_loop_sends_each_request_when_due_and_counts_every_token() -> None:
    pytest.importorskip("aiohttp")
    spec = openloop.OpenSpec(duration_s=4.0, peak_rps=25, input_tokens=16, min_output_tokens=4,
                             max_output_tokens=12, seed=3)  # fmt: skip
    arr = openloop.arrivals(spec)
    server = StandIn()
    try:
        m = openloop.run_open(server.url, spec, timeout_s=60)
    finally:
        server.close()
    assert m["concurrency"] == 0 and m["failed"] == 0 and m["n_requests"] == len(arr) > 20
    assert sum(r["out_tokens"] for r in m["requests"]) == sum(a.output_tokens for a in arr)
    assert [r["out_tokens"] for r in m["requests"]] == [a.output_tokens for a in arr]  # by arrival index
    # Sent when due, not when the previous one finished: received offsets follow the trace's.
    got = sorted(t for t, _ in server.seen)
    lag = [(g - got[0]) - (a.t_s - arr[0].t_s) for g, a in zip(got, arr)]
    assert sorted(abs(x) for x in lag)[len(lag) // 2] < 0.05 and max(abs(x) for x in lag) < 0.5, lag
    assert m["tpot_mean_ms"] > 0 and m["throughput_tok_s"] > 0


def test_the_clients_drop_idle_connections_before_sglangs_server_closes_them() -> None:
    """SGLang's uvicorn closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE
    seconds; a client keeping it longer may send on a closing one ("Server disconnected")."""
    pytest.importorskip("aiohttp")
    import loadgen
    from sglang.srt.environ import envs

    async def pool(limit: int) -> tuple[int, float]:
        conn = loadgen.connector(limit)
        try:
            return conn.limit, conn._keepalive_timeout
        finally:
            await conn.close()

    server_s = envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()
    for limit in (0, 68):  # openloop's and loadgen's pools
        got, idle_s = asyncio.run(pool(limit))
        assert got == limit and 0 < idle_s < server_s


# --------------------------------------------------------------------------- the report


def write_csv(path: Path, rows: list[tuple[str, int, str, int, float, float]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "summary.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(realgpu_report.FIELDS)
        for wl, c, p, rep, tok, tpot in rows:
            w.writerow([wl, c, p, rep, tok, tpot, tpot * 1.5, 0])


def test_report_ratios_and_criteria_from_two_calls(tmp_path: Path) -> None:
    closed = "closed-mix-256-128"
    call1 = [  # rep 1: ppo 1.10x plain, 1.00x best static (static:3), ahead of both rules
        (closed, 16, "plain", 1, 1000, 10), (closed, 16, "static:1", 1, 1050, 9), (closed, 16, "static:3", 1, 1100, 9),
        (closed, 16, "sglang-adaptive-default", 1, 900, 11), (closed, 16, "sglang-adaptive-tuned", 1, 1000, 10),
        (closed, 16, "ppo", 1, 1100, 9), ("accept-chat", 16, "static:5", 0, 5, 5),
        (closed, 16, "static:0-skip", 1, 5000, 1),  # another server's depth 0: not a static depth
    ]  # fmt: skip
    call2 = [  # rep 2 (another call): ppo 0.96x plain -> the mean over reps is 1.03x plain
        (closed, 16, "plain", 2, 1000, 10), (closed, 16, "static:1", 2, 1000, 9), (closed, 16, "static:3", 2, 1000, 9),
        (closed, 16, "sglang-adaptive-default", 2, 1000, 11), (closed, 16, "sglang-adaptive-tuned", 2, 1000, 10),
        (closed, 16, "ppo", 2, 960, 9),
        ("open-shift-180s", 0, "plain", 2, 500, 12.0), ("open-shift-180s", 0, "static:3", 2, 510, 11.0),
        ("open-shift-180s", 0, "ppo", 2, 500, 10.5),
    ]  # fmt: skip
    write_csv(tmp_path / "c1", call1)
    write_csv(tmp_path / "c2", call2)
    rows = realgpu_report.read_rows([tmp_path / "c1", tmp_path / "c2"])
    assert not any(r["workload"].startswith("accept") for r in rows)
    table, best = realgpu_report.cells(rows)
    ppo = table[(closed, 16, "ppo")]
    assert ppo.to_plain == pytest.approx({1: 1.10, 2: 0.96})
    assert best[(closed, 16)] == "static:3"  # mean 1050 against static:1's 1025 (static:0-skip is no static)
    assert ppo.to_static == pytest.approx({1: 1.0, 2: 0.96})
    crit = realgpu_report.criteria(rows)
    assert crit["ppo"]["plain"]["holds"] is True  # mean 1.03
    assert crit["ppo"]["static"]["holds"] is False  # mean 0.98 < 0.99
    assert "0.980 of static:3" in crit["ppo"]["static"]["why"][0]
    assert (
        crit["ppo"]["sglang"]["holds"] is True
    )  # (1100/900 + 960/1000) / 2 = 1.09, (1.10 + 0.96) / 2 = 1.03
    # Open: TPOT below both, but tok/s 500/510 = 0.980 of static:3 (< 0.99).
    assert crit["ppo"]["open"]["holds"] is False
    assert len(crit["ppo"]["open"]["why"]) == 1 and "vs static:3" in crit["ppo"]["open"]["why"][0]
    assert crit["all"]["failed"]["holds"] is True
    md = realgpu_report.markdown(rows, crit)
    assert (
        "| 16 | ppo | 2 | 1030 (960-1100) | 9.00 (9.00-9.00) | 1.030 (0.960-1.100) | 0.980 (0.960-1.000) | 0 |"
        in md
    )


def test_report_identity_and_duplicate_reps(tmp_path: Path) -> None:
    hashes = {("closed", 16, 1, "plain"): ["a", "b"], ("closed", 16, 1, "ppo"): ["a", "x"],
              ("closed", 16, 1, "static:3"): ["a", "b"], ("closed", 16, 2, "ppo"): ["a", "b"]}  # fmt: skip
    ident = realgpu_report.identity(hashes)
    assert ident["holds"] is False and ident["compared"] == 4 and ident["differing"] == 1
    assert ident["why"] == ["closed C=16 rep 1 ppo: 1/2"]  # rep 2 has no plain: not compared
    write_csv(tmp_path / "a", [("closed", 1, "plain", 1, 10, 1)])
    write_csv(tmp_path / "b", [("closed", 1, "plain", 1, 11, 1)])
    assert realgpu_report.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2


def test_report_refuses_calls_from_different_gpus(tmp_path: Path) -> None:
    for name, gpu, rep in (("h200", "NVIDIA H200", 1), ("h100", "NVIDIA H100 80GB HBM3", 2)):
        write_csv(tmp_path / name, [("closed", 1, "plain", rep, 10, 1)])
        book = {"device": {"nvidia_smi": f"{gpu}, 580.159.04, 81559 MiB"}, "points": []}
        (tmp_path / name / "offswitch.json").write_text(json.dumps(book))
    assert realgpu_report.read_devices([tmp_path / "h100"]) == {
        str(tmp_path / "h100"): "NVIDIA H100 80GB HBM3"
    }
    assert realgpu_report.main([str(tmp_path / "h200"), str(tmp_path / "h100")]) == 2
    assert realgpu_report.main([str(tmp_path / "h100")]) == 0


def test_the_fitted_simulator_replays_each_measured_point(tmp_path: Path, capsys) -> None:
    """realgpu_sim: each closed point's own benchmark in the simulator fitted to the H100 calls'
    traces, against what those calls measured (static:0 at C=1: 144-145 tok/s; static:3 at
    C=4: 622-666); plain and SGLang's rule are simulated as the servers they are; a policy it
    cannot run is listed, not dropped."""
    import realgpu_sim

    path = tmp_path / "summary.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(realgpu_report.FIELDS)
        for policy, c, rep, tok_s in [
            ("plain", 1, 1, 158.5),
            ("static:0", 1, 1, 144.4),
            ("static:0", 1, 2, 145.4),
            ("static:3", 4, 1, 666.1),
            ("static:3", 4, 2, 621.6),
            ("sglang-adaptive-default", 1, 1, 150.0),
            ("gone.zip", 1, 1, 150.0),
        ]:
            w.writerow(["closed-mix-256-128", c, policy, rep, tok_s, 6.0, 6.5, 0])
    sim = ROOT / "bench" / "results" / "realgpu" / "h100" / "ppo-retrained" / "sim.json"
    assert realgpu_sim.main(["--sim", str(sim), str(path), "--seeds", "4"]) == 0
    out = capsys.readouterr().out
    rows = {
        tuple(r.split("|")[1:3]): r.split("|")[4:6]
        for r in out.splitlines()
        if r.startswith("| ") and "policy" not in r
    }
    assert set(rows) == {
        (" plain ", " 1 "), (" static:0 ", " 1 "), (" static:3 ", " 4 "), (" sglang-adaptive-default ", " 1 "), (" gone.zip ", " 1 "),
    }  # fmt: skip
    assert rows[(" gone.zip ", " 1 ")][1].strip() == "not simulated"
    assert abs(float(rows[(" plain ", " 1 ")][0]) / 158.5 - 1) < 0.10
    assert abs(float(rows[(" static:0 ", " 1 ")][0]) / 144.9 - 1) < 0.10
    assert abs(float(rows[(" static:3 ", " 4 ")][0]) / 643.85 - 1) < 0.15
    assert "2 points of the hook server's policies: mean absolute error" in out
    assert "2 points of the servers of their own (plain, SGLang's rule): mean absolute error" in out
    assert realgpu_sim.main(["--sim", str(tmp_path / "none.json"), str(path)]) == 2

    # --ttft-points: the request path fitted to static:0's measured TTFTs (the mean per C over
    # repetitions), then the same replay; points of two closed workloads are refused.
    points = tmp_path / "offswitch.json"
    pt = {"workload": "closed-mix-256-128", "policy": "static:0", "rep": 1}
    points.write_text(json.dumps({"points": [
        {**pt, "concurrency": 1, "ttft_ms_mean": 30.0}, {**pt, "concurrency": 1, "rep": 2, "ttft_ms_mean": 32.0},
        {**pt, "concurrency": 4, "ttft_ms_mean": 41.0}, {**pt, "policy": "ppo", "concurrency": 4, "ttft_ms_mean": 99.0},
    ]}))  # fmt: skip
    assert realgpu_sim.measured_ttft([points]) == ("closed-mix-256-128", {1: 31.0, 4: 41.0})
    assert realgpu_sim.main(["--sim", str(sim), str(path), "--seeds", "2", "--ttft-points", str(points)]) == 0
    fitted = capsys.readouterr().out.splitlines()[0]
    assert fitted.startswith("request path fitted to static:0's TTFT at C = 1 and 4 (31.0 / 41.0 ms): ")
    # A points file with its call's arguments is fitted with them, whatever call is replayed:
    # sent cold (no warm-up), the same TTFTs hold a prefill each, so less is left to the path.
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({"args": {"prewarm": "none"}, "points": json.loads(points.read_text())["points"]}))
    assert realgpu_sim.main(["--sim", str(sim), str(path), "--seeds", "2", "--ttft-points", str(cold)]) == 0
    path_ms = [float(line.split("ms): ")[1].split(" ms")[0]) for line in (fitted, capsys.readouterr().out.splitlines()[0])]
    assert path_ms[1] < path_ms[0]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"points": [{**pt, "workload": "closed-mix-256-64", "concurrency": 1, "ttft_ms_mean": 9.0}]}))
    assert realgpu_sim.main(["--sim", str(sim), str(path), "--ttft-points", str(points), "--ttft-points", str(other)]) == 2
    assert "2 closed workloads" in capsys.readouterr().err


def test_each_call_is_replayed_with_its_own_arguments(tmp_path: Path, capsys) -> None:
    """realgpu_sim: ``--call-args`` once per CSV replays each call with its own (here the KV
    cap: the prompts fit half of one call's and were sent before the point, so they replay
    cached, and not the other's), and the summary is over them all; once, it is every CSV's."""
    import realgpu_sim

    csvs, args = [], []
    for name, cap in (("a", 2048), ("b", 131072)):
        path = tmp_path / f"{name}.csv"
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(realgpu_report.FIELDS)
            w.writerow(["closed-mix-256-128", 4, "static:0", 1, 600.0, 6.0, 6.5, 0])
            w.writerow(["closed-mix-256-128", 4, "plain", 1, 600.0, 6.0, 6.5, 0])
        points = tmp_path / f"{name}.json"
        points.write_text(json.dumps({"args": {"max_total_tokens": cap}, "points": []}))
        csvs.append(str(path))
        args += ["--call-args", str(points)]
    sim = ROOT / "bench" / "results" / "realgpu" / "h100" / "ppo-retrained" / "sim.json"

    def simulated(argv: list[str], n: int) -> list[float]:
        assert realgpu_sim.main(["--sim", str(sim), "--seeds", "2", *argv]) == 0
        out = capsys.readouterr().out
        assert f"all {n} points: mean absolute error" in out
        return [float(r.split("|")[4]) for r in out.splitlines() if r.startswith("| static:0 ")]

    own = simulated([*csvs, *args], 4)
    assert len(own) == 2 and own[0] < own[1]  # cold prompts prefill 256 tokens each, cached ones few
    # once: the first call's for both CSVs, whose points (the same policy, C and repetition) are one
    assert simulated([*csvs, *args[:2]], 2) == [own[0]]
    with pytest.raises(SystemExit):  # three for two CSVs
        realgpu_sim.main(["--sim", str(sim), *csvs, *args, *args[:2]])
    assert "once per CSV (2); got 3" in capsys.readouterr().err


def test_a_cold_point_finds_what_the_calls_earlier_points_left_in_the_cache(tmp_path: Path) -> None:
    """realgpu_sim.carried_hits against call AS's own records (H100, every long prompt sent
    cold): each lone prompt's prefilled tokens, as its server reported them, say how much of
    it the radix cache held (a 32k prompt after the 16k point: half). The model must find the
    same from the call's point order alone; with a cache too small to keep a prompt, nothing."""
    import realgpu_sim

    from controller.traces import load_traces

    folder = ROOT / "bench" / "results" / "realgpu" / "h100" / "longctx"
    call = realgpu_sim.call_args(folder / "points-as.json")
    hits = realgpu_sim.carried_hits(call, int(call.requests_per_conc), 0.99)
    with tarfile.open(folder / "traces-as.tar") as tar:
        tar.extractall(tmp_path, filter="data")
    steps = load_traces(tmp_path / "traces").sort_values(["file", "ts_ns"])
    lone = steps[(steps.bs == 1) & (steps.prefill_tokens >= 1000)]
    compared = 0
    for (_, depth), rows in lone.groupby(["file", "depth"]):
        for length, prefilled in zip(call.long_input, rows.prefill_tokens):  # the lengths in their order
            measured = 1.0 - int(prefilled) / length
            assert abs(hits[(f"long-mix-{length}-128", f"static:{depth}", 1, 1)] - measured) < 0.001
            compared += 1
    assert compared == 8 and hits[("long-mix-32768-128", "static:0", 1, 1)] == pytest.approx(0.5)
    call.max_total_tokens = 4096  # every earlier prompt evicted before the next length runs
    assert not any(realgpu_sim.carried_hits(call, int(call.requests_per_conc), 0.99).values())


def test_the_replay_runs_plain_and_sglangs_rule_as_their_servers_run() -> None:
    """The servers of their own replay as they run: ``plain`` with no drafter at all (faster
    than the hook server's depth 0, which stores the drafter's keys and values); SGLang's rule
    with its default tiers, whose depth 0 at batch 64 is SGLang's width-1 verify (slower than
    the off switch's depth 0), on its own depths (its tiers reach 7, the server ran
    ``--speculative-num-steps 7``)."""
    import realgpu_sim

    from env.params import SimParams

    assert realgpu_sim.SERVER_SIMS["sglang-adaptive-default"][1] == (0, 1, 3, 5, 7)
    assert realgpu_sim.SERVER_SIMS["sglang-adaptive-tuned"][1] == realgpu.DEPTHS
    assert set(realgpu_sim.SERVER_SIMS) <= set(realgpu.SERVER_POLICIES)  # named as realgpu.py runs them
    sim = ROOT / "bench" / "results" / "realgpu" / "h100" / "drawn" / "fit-mn.json"
    params = SimParams.from_dict(json.loads(sim.read_text()))
    w = "closed-mix-256-128"
    points = {(w, p, 64): {1: 1000.0} for p in ("plain", "static:0", "sglang-adaptive-default")}
    got = {label: tok_s for label, _, _, tok_s in realgpu_sim.replay(params, points, 2, 2)}
    assert got["sglang-adaptive-default"] < 0.8 * got["static:0"] < 0.8 * got["plain"]
    assert got["static:0"] < got["plain"] < 1.1 * got["static:0"]
    # --plain-sim: the plain server's own latency (a fit of its records) for plain and plain-rec
    # only; here one whose steps cost 5 ms more
    from dataclasses import replace

    slow = replace(params.latency, oh_us=params.latency.oh_us + 5000.0)
    points[(w, "plain-rec", 64)] = {1: 1000.0}
    own = {label: tok_s for label, _, _, tok_s in realgpu_sim.replay(params, points, 2, 2, plain_latency=slow)}
    assert own["plain"] == own["plain-rec"] < 0.7 * got["plain"]
    assert own["static:0"] == got["static:0"] and own["sglang-adaptive-default"] == got["sglang-adaptive-default"]


def test_the_replay_takes_the_fit_at_the_calls_share_of_documents() -> None:
    """A third of realgpu.py's requests are documents (the fit's zero-acceptance part); the
    M/N fit put 0.29 there and the rest too low. Replayed at the known share, static:3 at
    C = 16 in calls M and N (measured 1418-1524 tok/s, mean 1469) comes within 5% (−5.8%
    from the fit as it stands)."""
    import realgpu_sim

    from env.params import SimParams

    assert realgpu_sim.zero_share("chat,code,docs") == pytest.approx(1 / 3)
    assert realgpu_sim.zero_share("chat,code") == 0.0 and realgpu_sim.zero_share("") == 0.0
    drawn = ROOT / "bench" / "results" / "realgpu" / "h100" / "drawn"
    params = SimParams.from_dict(json.loads((drawn / "fit-mn.json").read_text()))
    assert params.acceptance.p_zero < 0.30
    points = realgpu_sim.measured([drawn / "call-drawn-m.csv", drawn / "call-drawn-n.csv"])
    point = {k: v for k, v in points.items() if k[1:] == ("static:3", 16)}
    reps = next(iter(point.values()))
    call = realgpu_sim.call_args(drawn / "points-drawn-m.json")
    sim = realgpu_sim.replay(params, point, 8, 8, call=call)[0][3]
    measured = sum(reps.values()) / len(reps)
    assert sim is not None and abs(sim / measured - 1) < 0.05


def test_the_replay_runs_each_call_with_its_own_kv_cap() -> None:
    """``--max-total-tokens`` caps each server's pool, whatever budget the fit read off its
    traces: the replay admits against the call's cap (the speculating server holds that many
    tokens), so a cap that binds slows the same point."""
    import realgpu_sim

    from env.params import SimParams

    drawn = ROOT / "bench" / "results" / "realgpu" / "h100" / "drawn"
    params = SimParams.from_dict(json.loads((drawn / "fit-mn.json").read_text()))
    call = realgpu_sim.call_args(drawn / "points-drawn-m.json")
    for cap in (49_152, 131_072):
        call.max_total_tokens = cap
        assert realgpu_sim.at_cap(params, call).engine.spec_kv_budget_tokens == cap
    point = {("closed-mix-256-128~0.7", "static:0", 16): {1: 1.0}}
    roomy = realgpu_sim.replay(params, point, 2, 2, call=call)[0][3]
    call.max_total_tokens = 2_000  # about three requests of 256 + up to 512 tokens at a time
    tight = realgpu_sim.replay(params, point, 2, 2, call=call)[0][3]
    assert roomy is not None and tight is not None and tight < 0.5 * roomy


def test_the_replay_sends_each_repetition_its_own_requests_and_cache_state(tmp_path: Path) -> None:
    """realgpu_sim replays the requests realgpu.py sent (the point's seed in that repetition:
    output lengths and families, ``docs`` as the fit's zero-acceptance part), and a point whose
    prompts realgpu.py did not warm (they do not fit in half the KV cap) runs cold."""
    import realgpu_sim
    from loadgen import LoadSpec, families, output_lengths

    # 8C requests of 256 tokens: warmed at C = 16 under a 131,072-token cap, cold at C = 64.
    assert realgpu.prewarmed(128, 256, 131072) and not realgpu.prewarmed(512, 256, 131072)
    assert not realgpu.prewarmed(128, 256, 131072, prewarm="none")
    load = realgpu_sim.point_load("closed-mix-256-128~0.7", 16, 7, 8, "chat,code,docs")
    sent = LoadSpec(16, 128, 256, 128, seed=realgpu.point_seed(7, 16), mix="chat,code,docs", output_sigma=0.7)
    assert load == sent and realgpu.point_seed(7, 16) != realgpu.point_seed(8, 16)
    path = realgpu_sim.write_requests(load, tmp_path / "r.csv")
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["output_tokens"]) for r in rows] == output_lengths(sent)
    assert [r["zero_accept"] == "1" for r in rows] == [f == "docs" for f in families(sent)]
    assert {r["prompt_tokens"] for r in rows} == {"256"}

    # The same point replayed warm and cold: a cold point prefills every prompt, so it is slower.
    sim = ROOT / "bench" / "results" / "realgpu" / "h100" / "ppo-retrained" / "sim.json"
    from env.params import SimParams

    params = SimParams.from_dict(json.loads(sim.read_text()))
    points = {("closed-mix-256-128~0.7", "static:0", 16): {7: 1000.0}}
    warm_call = realgpu_sim.call_args(None)  # realgpu.py's defaults
    warm_call.max_total_tokens = 131072
    assert warm_call.prewarm == "point" and warm_call.mix == "chat,code,docs" and warm_call.requests_per_conc == 2
    points_file = tmp_path / "offswitch.json"  # what a call wrote: its arguments, as run
    points_file.write_text(json.dumps({"args": {"max_total_tokens": 8192, "requests_per_conc": 8}, "points": []}))
    cold_call = realgpu_sim.call_args(points_file)
    assert cold_call.max_total_tokens == 8192 and cold_call.requests_per_conc == 8
    warm = realgpu_sim.replay(params, points, 2, 8, call=warm_call)[0][3]
    cold = realgpu_sim.replay(params, points, 2, 8, call=cold_call)[0][3]
    assert warm is not None and cold is not None and cold < warm


def test_the_replay_runs_the_open_trace_of_the_call(tmp_path: Path, capsys) -> None:
    """realgpu_sim replays an open point on the trace the call sent (its ``--open-s`` and
    ``--open-peak-rps``, from its point file): each request's arrival, output length and
    family's acceptance part; tok/s and mean TPOT against the measured; beside the closed
    points. A window that is not the call's is refused; ``--predict-open`` gives the same
    numbers for the same trace without a CSV."""
    import realgpu_sim

    call = realgpu_sim.call_args(None)
    call.open_s, call.open_peak_rps = 5.0, 10.0
    spec = realgpu_sim.open_spec("open-shift-5s", call, 1)
    assert spec == openloop.OpenSpec(duration_s=5.0, peak_rps=10.0, input_tokens=256, seed=0)
    sent = openloop.arrivals(spec)
    with realgpu_sim.write_arrivals(spec, tmp_path / "open.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(float(r["arrival_s"]), int(r["output_tokens"])) for r in rows] == [(a.t_s, a.output_tokens) for a in sent]
    assert [r["zero_accept"] == "1" for r in rows] == [a.family == "docs" for a in sent]
    assert {r["prompt_tokens"] for r in rows} == {"256"}

    path = tmp_path / "summary.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(realgpu_report.FIELDS)
        w.writerow(["closed-mix-256-128", 1, "static:0", 1, 145.0, 6.9, 7.0, 0])
        for policy, rep, tok_s, tpot in [("plain", 1, 700.0, 6.5), ("plain", 2, 720.0, 6.7),
                                         ("static:3", 1, 700.0, 5.0), ("gone.zip", 1, 700.0, 5.0)]:  # fmt: skip
            w.writerow(["open-shift-5s", 0, policy, rep, tok_s, tpot, 9.0, 0])
    points = tmp_path / "offswitch.json"
    points.write_text(json.dumps({"args": {"open_s": 5.0, "open_peak_rps": 10.0}, "points": []}))
    sim = ROOT / "bench" / "results" / "realgpu" / "h100" / "ppo-retrained" / "sim.json"
    assert realgpu_sim.main(["--sim", str(sim), str(path), "--seeds", "1", "--call-args", str(points)]) == 0
    out = capsys.readouterr().out
    assert "| static:0 | 1 | 145 (145-145) |" in out  # the closed point, as before
    opened = {r.split("|")[1].strip(): r.split("|")[3:9] for r in out.splitlines() if "| open-shift-5s |" in r}
    assert set(opened) == {"plain", "static:3", "gone.zip"}
    assert opened["plain"][0].strip() == "710 (700-720)" and opened["plain"][3].strip() == "6.60 (6.50-6.70)"
    assert opened["gone.zip"][2].strip() == "not simulated"
    tok_s = {p: float(opened[p][1]) for p in ("plain", "static:3")}
    tpot = {p: float(opened[p][4]) for p in ("plain", "static:3")}
    # Every request's tokens over the trace's span (from its start to a little after the last arrival).
    tokens = sum(a.output_tokens for a in sent)
    assert all(sent[-1].t_s < tokens / v < sent[-1].t_s + 3 for v in tok_s.values())
    assert tpot["static:3"] < 0.9 * tpot["plain"]  # a trickle of chat and code: drafts pay
    assert "2 open points: mean absolute error" in out

    # No call arguments: realgpu.py's default window (180 s) is not this trace's.
    assert realgpu_sim.main(["--sim", str(sim), str(path), "--seeds", "1"]) == 2
    assert "--call-args" in capsys.readouterr().err
    argv = ["--sim", str(sim), "--seeds", "1", "--predict-open", "static:3", "--open-s", "5", "--open-peak-rps", "10"]
    assert realgpu_sim.main(argv) == 0
    out = capsys.readouterr().out
    assert f"open-shift-5s predicted: peak 10 requests/s, 256-token prompts, seed 0: {len(sent)} requests" in out
    predicted = next(r for r in out.splitlines() if r.startswith("| static:3 |")).split("|")
    assert (float(predicted[2]), float(predicted[3])) == (tok_s["static:3"], tpot["static:3"])
    with pytest.raises(SystemExit):  # the trace's flags are for --predict-open
        realgpu_sim.main(["--sim", str(sim), str(path), "--open-s", "5"])


def test_drawn_output_lengths_are_the_simulators_distribution() -> None:
    """``loadgen`` (stdlib, on the device) and ``env.workload`` (``output=N~S``) draw output
    lengths from one distribution: log-normal around N, within the same bounds. Fixed lengths
    stay fixed, and a benchmark's draws are the same for every policy at a seed."""
    import numpy as np
    from loadgen import OUTPUT_BOUNDS, LoadSpec, output_lengths

    from env.workload import Arrivals, WorkloadParams, parse_workload

    wp = WorkloadParams()
    assert OUTPUT_BOUNDS == (wp.output_min_tokens, wp.output_max_tokens)
    spec = LoadSpec(8, 4000, 256, 128, seed=3, output_sigma=0.7)
    ours = np.array(output_lengths(spec))
    assert output_lengths(spec) == list(ours) and output_lengths(LoadSpec(8, 5, 256, 128)) == [128] * 5
    arr = Arrivals(parse_workload("closed:1@output=128~0.7"), wp, 0.0, np.random.default_rng(0))
    sims = np.array([arr._lengths()[1] for _ in range(4000)])
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        a, b = np.quantile(ours, q), np.quantile(sims, q)
        assert abs(a / b - 1) < 0.08, (q, a, b)
    assert 120 <= np.median(ours) <= 136 and ours.min() >= 8 and ours.max() <= 2048


def test_the_simulator_replays_drawn_output_lengths() -> None:
    import realgpu_sim

    assert realgpu_sim.sim_workload("closed-mix-256-128", 16) == "closed:16@prompt=256,output=128,n=32"
    assert realgpu_sim.sim_workload("closed-mix-256-128~0.7", 1) == "closed:1@prompt=256,output=128~0.7,n=4"
    # a call run with --requests-per-conc 8 sends 8C requests a point, and its replay does too
    assert realgpu_sim.sim_workload("closed-mix-256-128~0.7", 16, 8) == "closed:16@prompt=256,output=128~0.7,n=128"
    args = realgpu.parse(["--stages", "closed", "--output-sigma", "0.7", "--policies", "plain"])
    assert args.output_sigma == 0.7


def test_the_simulator_replays_a_long_point_as_the_long_stage_sent_it(tmp_path: Path) -> None:
    """A long point (``realgpu.stage_loop``): C requests of its prompt length, one wave, seeded
    as the long stage seeds them; read from the CSV beside the closed points and labelled by
    its prompt length."""
    import realgpu_sim

    args = realgpu.parse(["--stages", "long", "--long-input", "16384", "--long-conc", "8",
                          "--long-policies", "static:0", "--first-rep", "3"])  # fmt: skip
    sent = [spec for *_, spec in stage_points(args, "long")]
    assert realgpu_sim.point_load("long-mix-16384-128", 8, 3, 2, args.mix) == sent[0]
    assert realgpu_sim.sim_workload("long-mix-16384-128", 8) == "closed:8@prompt=16384,output=128,n=8"
    assert realgpu_sim.point_label("static:3", "long-mix-16384-128~0.7") == "static:3 [128~0.7, long 16384]"
    csv_path = tmp_path / "summary.csv"
    csv_path.write_text("workload,concurrency,policy,rep,tok_s,tpot_ms_mean,tpot_ms_p99,failed\n"
                        "closed-mix-256-128,4,static:0,1,600,6.3,6.3,0\nlong-mix-16384-128,8,static:0,1,548,13,14,0\n"
                        "open-shift-90s,0,static:0,1,900,9,12,0\n")  # fmt: skip
    assert set(realgpu_sim.measured([csv_path])) == {
        ("closed-mix-256-128", "static:0", 4), ("long-mix-16384-128", "static:0", 8)
    }


def test_the_profile_timeline_splits_a_step_into_graph_eager_and_idle() -> None:
    """Two steps: a graph replay (two kernels), then an eager kernel the GPU waited 50 us for."""
    import offswitch

    def runtime(name: str, corr: int, ts: float) -> dict:
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": 5.0, "tid": 1, "args": {"correlation": corr}}

    def kernel(name: str, corr: int, ts: float, dur: float) -> dict:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = []
    for step in range(2):
        t = 1000.0 * step
        events += [
            runtime("cudaGraphLaunch", 10 * step + 1, t),
            kernel("gemm", 10 * step + 1, t + 10, 500),
            kernel("attention", 10 * step + 1, t + 510, 300),
            runtime("cudaLaunchKernel", 10 * step + 2, t + 840),
            kernel("argmax", 10 * step + 2, t + 860, 40),  # 50 us after the graph's last kernel
            {"cat": "python_function", "name": "sglang/srt/speculative/eagle_utils.py(1): sample", "ts": t + 830,
             "dur": 20.0, "tid": 1},
        ]  # fmt: skip
    out = offswitch.summarize_trace({"traceEvents": events}, steps=2)["timeline"]
    assert out["busy_us_per_step"] == pytest.approx(840.0)
    assert out["eager_ops_per_step"] == 1.0 and out["eager_us_per_step"] == pytest.approx(40.0)
    assert [e["name"] for e in out["eager_top"]] == ["argmax"]
    # the gap before each argmax (50 us) and the one between the steps (110 us, before the graph)
    assert out["gaps_over_20us_per_step"] == pytest.approx((50 + 110 + 50) / 2)
    assert out["span_us_per_step"] == pytest.approx((1900 - 10) / 2)
    waited = {w["launch"].split(" <- ")[0]: w for w in out["waited_for"]}
    assert waited["cudaLaunchKernel"]["us_per_step"] == pytest.approx(50.0)
    assert "eagle_utils" in [w["launch"] for w in out["waited_for"] if w["launch"].startswith("cudaLaunchKernel")][0]


def test_two_servers_profiles_are_diffed_kernel_by_kernel() -> None:
    """The same profile summary for a plain step and a depth-0 step with two extra small kernels:
    the diff lists the step's totals and first the kernels whose time differs most, per step;
    a profile with Python stacks, or a C without the base server, is not diffed."""
    import offswitch

    def events(extra: int) -> list[dict]:
        out = []
        for step in range(3):
            t = 1000.0 * step
            out.append({"cat": "kernel", "name": "gemm", "ts": t, "dur": 500.0})
            out += [{"cat": "kernel", "name": "fill", "ts": t + 600 + 10 * i, "dur": 2.0} for i in range(extra)]
        return out

    plain = offswitch.summarize_trace({"traceEvents": events(0)}, steps=3)
    off = offswitch.summarize_trace({"traceEvents": events(2)}, steps=3)
    assert off["gpu_ops_per_step"] == 3.0 and plain["gpu_ops_per_step"] == 1.0
    diffs = offswitch.kernel_diff({"plain@c1": plain, "off@c1": off, "off@c1+stack": off, "off@c64": off})
    assert len(diffs) == 1
    d = diffs[0]
    assert (d["server"], d["c"], d["gpu_us"], d["base_gpu_us"], d["ops"], d["base_ops"]) == ("off", "c1", 504.0, 500.0, 3.0, 1.0)
    assert d["kernels"][0] == {"name": "fill", "us": 4.0, "base_us": 0.0, "n": 2.0, "base_n": 0.0}
    assert d["kernels"][1]["name"] == "gemm" and d["kernels"][1]["us"] == d["kernels"][1]["base_us"] == 500.0


def test_steady_throughput_counts_only_while_every_client_is_busy() -> None:
    """Two clients, four requests: the window opens when both first requests have their first
    token (t = 1) and closes when the last request is sent (t = 5); the drain after it, however
    slow, is not in the steady figure, and tokens before the window are not either."""
    from loadgen import steady_throughput

    sent = [0.0, 0.0, 3.0, 5.0]
    timelines = [
        [(0.5, 1), (1.0, 2), (3.0, 6)],  # 2 tokens before t=1; 4 in the window
        [(1.0, 1), (4.0, 7), (5.0, 9)],  # 8 in the window
        [(3.5, 1), (4.5, 3)],  # 3
        [(5.5, 1), (20.0, 100)],  # all after the window: the drain
    ]
    tok_s, seconds = steady_throughput(timelines, sent, 2)  # type: ignore[misc]
    assert seconds == 4.0 and tok_s == (4 + 8 + 3) / 4.0
    assert steady_throughput(timelines[:2], sent[:2], 2) is None  # no request after the first C
    assert steady_throughput([[], *timelines[1:]], sent, 2) is None  # a first request never streamed
    assert steady_throughput(timelines, [0.0, 0.0, 0.5, 0.8], 2) is None  # all sent before the window


def test_report_judges_the_steady_throughput_when_asked(tmp_path: Path) -> None:
    """``--metric steady`` reads each point's ``steady_tok_s`` from ``offswitch.json`` (points
    without it are left out) and judges the same criteria on it; the whole points can say
    otherwise, as they did on the H100 testbed, where drain punished drafting."""
    closed = "closed-mix-256-128~0.7"
    point = {"workload": closed, "concurrency": 16, "tpot_ms_p99": 12.0, "failed": 0}
    points = [  # whole points: ppo 0.90x plain; while all clients were busy: 1.05x
        {**point, "policy": "plain", "rep": 1, "tok_s": 1000.0, "steady_tok_s": 1200.0, "tpot_ms_mean": 8.0},
        {**point, "policy": "static:0", "rep": 1, "tok_s": 980.0, "steady_tok_s": 1190.0, "tpot_ms_mean": 8.0},
        {**point, "policy": "ppo", "rep": 1, "tok_s": 900.0, "steady_tok_s": 1260.0, "tpot_ms_mean": 7.0},
        {**point, "policy": "static:3", "rep": 1, "tok_s": 700.0, "steady_tok_s": None, "tpot_ms_mean": 9.0},
    ]
    call = tmp_path / "call"
    write_csv(call, [(closed, 16, p["policy"], 1, p["tok_s"], p["tpot_ms_mean"]) for p in points])
    (call / "offswitch.json").write_text(json.dumps({"points": points}))
    steady = realgpu_report.read_steady_rows([call])
    assert {r["policy"]: r["tok_s"] for r in steady} == {"plain": 1200.0, "static:0": 1190.0, "ppo": 1260.0}
    crit_point = realgpu_report.criteria(realgpu_report.read_rows([call]))
    crit_steady = realgpu_report.criteria(steady)
    assert crit_point["ppo"]["plain"]["holds"] is False and crit_steady["ppo"]["plain"]["holds"] is True
    out = tmp_path / "steady.md"
    assert realgpu_report.main([str(call), "--metric", "steady", "--md", str(out)]) == 0
    assert out.read_text().startswith("tok/s while all C clients were busy")
    empty = tmp_path / "old"
    write_csv(empty, [(closed, 16, "plain", 1, 1000.0, 8.0)])  # a call before steady_tok_s existed
    assert realgpu_report.main([str(empty), "--metric", "steady"]) == 2


def test_the_stack_sampler_finds_where_a_scheduler_spends_its_time(tmp_path: Path) -> None:
    """``offswitch --sample``: a process titled like SGLang's scheduler, with the sampler's
    ``sitecustomize`` first on its path, spends most of a window in ``busy`` and a little in
    ``idle``; the summary ranks them so, and a process without ``scheduler`` in its title is
    left out."""
    import offswitch

    code = (
        "import time\n"
        "def busy(t):\n"
        "    end = time.time() + t\n"
        "    while time.time() < end:\n"
        "        sum(range(200))\n"
        "def idle(t):\n"
        "    time.sleep(t)\n"
        "end = time.time() + 3.0\n"
        "while time.time() < end:\n"
        "    busy(0.04)\n"
        "    idle(0.01)\n"
    )
    env = {**os.environ, "SPECDEPTH_STACK_DIR": str(tmp_path),
           "PYTHONPATH": f"{offswitch.STACKS}:{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-c", code, "sglang::scheduler"], env=env),
        subprocess.Popen([sys.executable, "-c", code, "detokenizer"], env=env),
    ]
    time.sleep(0.8)
    (tmp_path / "on").touch()
    time.sleep(1.5)
    (tmp_path / "on").unlink()
    for p in procs:
        assert p.wait(timeout=30) == 0
    assert len(list(tmp_path.glob("*.json"))) == 2  # one window per process
    got = offswitch.stack_summary(tmp_path, tok_s=1000.0)
    assert [w["pid"] for w in got["windows"]] == [procs[0].pid]
    (window,) = got["windows"]
    main = next(v for k, v in window["sched_ms"].items() if k.startswith("MainThread#"))
    assert 300 < main[0] < 1600 and main[1] >= 0  # about 1.2 s busy of the 1.5 s window
    assert window["gc"]["ms"] >= 0 and window["affinity"]
    share = {r["name"].rsplit(":", 1)[-1]: r["share"] for r in got["inclusive"]}
    assert 0.6 < share["busy"] < 0.95 and 0.05 < share["idle"] < 0.35, share
    assert share["<module>"] == 1.0
    assert got["inclusive"][0]["us_per_tok"] == pytest.approx(1000.0)  # 1 s / 1000 tokens, all of it
    assert got["self"][0]["name"].split(":")[-2] in ("busy", "<genexpr>") or "busy" in got["self"][0]["name"]


def test_stack_parts_count_a_stack_in_every_part_it_matches() -> None:
    """``stack_parts.parts``: a part takes the stacks with all of its frames and none of its
    exclusions, per output token at the window's rate; parts nest, so rows overlap."""
    import stack_parts

    sync = stack_parts.SYNC
    stacks = {  # microseconds per stack, 1 s in all
        f"scheduler.py:event_loop_overlap;scheduler.py:process_batch_result_decode;{sync}:254": 400_000,
        "scheduler.py:event_loop_overlap;scheduler.py:process_batch_result_decode:10": 100_000,
        "scheduler.py:event_loop_overlap;x/prefill_cuda_graph_runner.py:execute:5": 300_000,
        "scheduler.py:event_loop_overlap;off_switch.py:draft_prefill_hook;x/prefill_cuda_graph_runner.py:execute:5": 200_000,
    }  # fmt: skip
    got = dict(zip([name for name, _, _ in stack_parts.PARTS], stack_parts.parts(stacks, tok_s=1000.0)))
    assert got["all"] == pytest.approx(1000.0)  # 1 s over 1000 tokens
    assert got["waiting for the GPU (stream synchronize)"] == pytest.approx(400.0)
    assert got["work: all but waiting for the GPU"] == pytest.approx(600.0)
    assert got["processing a decode result, not waiting"] == pytest.approx(100.0)
    assert got["the target's prefill (prefill graph runner, not the drafter's)"] == pytest.approx(300.0)
    assert got["the drafter's extend of admitted prompts (hook's prefill wrapper)"] == pytest.approx(200.0)


def test_a_load_started_in_the_background_joins_with_its_summary() -> None:
    """``loadgen.start_load`` (profiles, stack samples, the kill-9 run): ``join`` waits for the
    load and returns :func:`loadgen.run_load`'s summary; against a port nothing listens on,
    every request is counted as failed rather than raising on the thread."""
    from loadgen import LoadSpec, start_load

    join = start_load("http://127.0.0.1:9", LoadSpec(2, 4, 8, 4, seed=1), timeout_s=10)
    m = join()
    assert m["failed"] == 4 and len(m["requests"]) == 4 and m["concurrency"] == 2


def test_trace_points_splits_points_and_reads_decode_admissions_and_depths(tmp_path: Path, capsys) -> None:
    """``trace_points``: two points apart by an idle gap; in the second (C = 4), the median
    decode step at full batch, the extra time of each admission over two decode steps (its
    record and the one before), and the share of full-batch steps at each depth."""
    import trace_points

    def step(t_ms: float, us: int, bs: int, depth: int, prefill: int = 0, accept: tuple = ()) -> dict:
        return {"t": "step", "ts_ns": int(t_ms * 1e6), "step_us": us, "bs": bs, "depth": depth,
                "prefill_tokens": prefill, "accept": list(accept)}  # fmt: skip

    first = [step(10.0 * (i + 1), 10_000, 1, 0) for i in range(5)]  # C = 1, ends at 50 ms
    t, second = 1_000.0, []  # 950 ms idle: a new point
    plan = [(4, 0, 0)] * 6 + [(4, 0, 0), (4, 0, 8)] + [(4, 3, 0)] * 4 + [(2, 0, 0)]  # (bs, depth, prefill)
    for i, (bs, depth, prefill) in enumerate(plan):
        us = 8_000 if i in (6, 7) else 5_000  # the admission: 3 ms more in each of its two records
        t += us / 1e3
        second.append(step(t, us, bs, depth, prefill, (1,) * bs if depth else ()))
    pts = trace_points.points(first + second, gap_ms=150.0)
    assert [len(p) for p in pts] == [5, len(plan)]
    d = trace_points.describe(pts[1])
    assert d["c"] == 4 and d["decode_ms"] == pytest.approx(5.0)
    assert d["admissions"] == 1 and d["admit_ms"] == pytest.approx(6.0)
    assert d["depths"] == pytest.approx({0: 8 / 12, 3: 4 / 12})  # the bs-2 drain step is not at full batch
    assert d["full_share"] == pytest.approx((6 * 5 + 2 * 8 + 4 * 5) / (6 * 5 + 2 * 8 + 5 * 5))
    assert d["resumed"] == (1.0, 1) and d["later"] == (1.0, 3)  # one resume, three drafted steps after it
    resume = [dict(s, accept=[0] * s["bs"]) if i == 8 else s for i, s in enumerate(second)]
    assert trace_points.describe(resume)["resumed"] == (0.0, 1)  # a resume whose drafts were all lost
    assert d["pairs"][0] == 0  # the resume has no drafted step before its depth-0 run
    # One request at a time: the scheduler idles between requests, and the first decode after
    # it is timed from its own launch, after the prefill: its admission is not timed, left out.
    lone = [step(10.0 * (i + 1), 4_000, 1, 0) for i in range(4)]  # 6 ms idle before each record
    lone[2]["prefill_tokens"] = 256
    assert trace_points.after_idle(lone, 2) and not trace_points.after_idle(second, 7)
    assert trace_points.describe(lone)["admissions"] == 0
    lone[2]["ts_ns"] = lone[1]["ts_ns"] + 4_000_000  # busy: it starts where the one before ended
    assert trace_points.describe(lone)["admissions"] == 1
    toggled = [step(t + i, 5_000, 4, depth, 0, (1, 1, 0, 0) if depth else ()) for i, depth in enumerate((3, 0, 0, 3, 3))]
    toggled[3]["accept"] = [0, 0, 0, 0]  # a cold resume between two drafted steps accepting half
    assert trace_points.resume_pairs(toggled) == (1, 0.5, 0.0, 0.5)

    from controller.traces import TraceWriter

    w = TraceWriter(tmp_path, "static-0-h200-off", start_ns=1796530651324039943)  # as the controller names it
    for s in first + second:
        w.write(s, s["ts_ns"])
    w.close()
    assert trace_points.main([str(w.path), "--min-steps", "5"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| static-0-h200-off |")]
    assert len(rows) == 2 and rows[1].endswith("| 0: 0.67, 3: 0.33 | 1.00 (1) / 1.00 (3) | nan / nan / nan (0) |")

    b = trace_points.by_batch(pts[1])  # by batch: the 4-wide steps fall in 1-16, admissions apart
    assert b["steps"] == len(plan) and b["admissions"] == 1 and b["prefill_tokens"] == 8
    assert b["admit_s"] == pytest.approx(8e-3) and b["time_s"] == pytest.approx((11 * 5 + 2 * 8) / 1e3)
    assert b["decode_s"] == pytest.approx(b["time_s"] - 8e-3 - 5e-3)  # nor is the step after the admission
    assert b["bands"][(1, 16)] == (pytest.approx(5.0), len(plan) - 2) and b["bands"][(97, 128)][1] == 0
    assert trace_points.main([str(w.path), "--min-steps", "5", "--by-batch"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| static-0-h200-off |")]
    assert len(rows) == 2 and rows[1].startswith(f"| static-0-h200-off | {len(plan)} | 0.07 | 0.06 | 1 | 0.01 | 8 | 5.00 (11) |")


def test_keep_call_writes_the_summary_the_points_without_hashes_and_the_trace_tables(tmp_path: Path, capsys) -> None:
    """``keep_call``: a returned call folder as the device gives it (``summary.csv``,
    ``offswitch.json``, ``traces.tar`` packed by the harness's own ``TracePack``) becomes three
    files to commit; a second keep under the same name is refused, and a folder that is not a
    call is named in the error."""
    import keep_call

    from controller.traces import TraceWriter

    call = tmp_path / "call"
    call.mkdir()
    summary = "workload,concurrency,policy,rep,tok_s,tpot_ms_mean,tpot_ms_p99,failed\nopen,0,static:0,66,3122.0,13.12,40.1,0\n"
    (call / "summary.csv").write_text(summary)
    point = {"workload": "open", "policy": "static:0", "rep": 66, "tok_s": 3122.0, "out_hash": ["ab12"] * 500}
    (call / "offswitch.json").write_text(json.dumps({"device": "H100", "points": [point], "resume": {"held": 1.66}}))
    records = tmp_path / "records" / "off"
    w = TraceWriter(records / "static-0", "static-0-h200-off", start_ns=1796530651324039943)
    for i in range(60):  # one run of 60 decode steps at batch 64, an admission every 20th
        ts = int((i + 1) * 8e6)
        w.write({"t": "step", "ts_ns": ts, "step_us": 7_500, "bs": 64, "depth": 0, "accept": [],
                 "prefill_tokens": 256 if i % 20 == 10 else 0}, ts)  # fmt: skip
    w.close()
    assert policyswap.TracePack(tmp_path / "records", call).add_new() == 1

    into = tmp_path / "kept"
    assert keep_call.main([str(call), "--into", str(into), "--name", "open-x", "--gap-ms", "1000"]) == 0
    assert (into / "call-open-x.csv").read_text() == summary
    kept = json.loads((into / "points-open-x.json").read_text())
    assert kept["points"] == [{k: v for k, v in point.items() if k != "out_hash"}]
    assert kept["device"] == "H100" and kept["resume"] == {"held": 1.66}
    tables = (into / "traces-open-x.md").read_text()
    assert "1 trace files from traces.tar" in tables and "--gap-ms 1000 --min-steps 50 --by-batch" in tables
    # TracePack names a file by its policy folder and the controller's file name
    rows = [r for r in tables.splitlines() if r.startswith("| static-0-static-0-h200-off |")]
    assert len(rows) == 2 and rows[0].startswith("| static-0-static-0-h200-off | 64 | 60 | 8533 |")  # C, steps
    assert "| 3 | 0.02 | 768 |" in rows[1] and "| 7.50 (54) |" in rows[1]  # by batch: admissions apart
    assert "kept" in capsys.readouterr().out

    with pytest.raises(SystemExit) as again:  # the same name again: refused, nothing replaced
        keep_call.main([str(call), "--into", str(into), "--name", "open-x"])
    assert again.value.code == 2 and "already kept" in capsys.readouterr().err
    with pytest.raises(SystemExit) as wrong:
        keep_call.main([str(tmp_path / "records"), "--into", str(into), "--name", "y"])
    assert wrong.value.code == 2 and "summary.csv not found" in capsys.readouterr().err


def test_the_warm_up_runs_a_drawn_point_at_each_c_once_per_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--warm-drawn`` (the default): besides C requests of 16 tokens at every depth, one point of
    drawn lengths at each C (2C requests, a drain through every batch size) on each server, at
    the hook server's first depth only; ``--no-warm-drawn`` leaves it out."""
    sent: list[tuple[str, int, int, float]] = []
    monkeypatch.setattr(realgpu, "run_load", lambda url, spec, timeout_s=300.0: sent.append(
        (url, spec.concurrency, spec.n_requests, spec.output_sigma)))  # fmt: skip

    class Res:
        def event(self, name: str) -> None:
            pass

    class Bench:
        by_label = {"plain": argparse.Namespace(url="P"), realgpu.HOOK: argparse.Namespace(url="H")}
        book = argparse.Namespace(res=Res())

        def use(self, policy: str) -> str:
            return policy

    for flag, drawn in (([], True), (["--no-warm-drawn"], False)):
        sent.clear()
        args = realgpu.parse(["--stages", "closed", "--conc", "4,64", *flag])
        assert args.warm_drawn is drawn
        realgpu.warm(Bench(), args, ["closed"])  # type: ignore[arg-type]
        for url, depths in (("P", 1), ("H", len(DEPTHS))):
            for c in (4, 64):
                points = [(n, s) for u, cc, n, s in sent if u == url and cc == c]
                assert points.count((c, 0.0)) == depths  # the 16-token point, once per depth
                assert [p for p in points if p != (c, 0.0)] == ([(2 * c, 0.7)] if drawn else [])


def test_the_testbed_target_holds_the_longest_context_a_call_asks_for() -> None:
    """SGLang refuses a ``--context-length`` above the model's positions (two starts of call AQ
    exited so at 32,768-token prompts): the built target covers every ``--long-input`` length
    the issues ask for, with the longest drawn output."""
    import build_models

    cfg = build_models._llama_config(build_models.SHAPES["8b"], 1)
    args = realgpu.parse(["--stages", "long", "--long-input", "4096,16384,32768", "--output-sigma", "0.7"])
    assert args.context <= int(cfg["max_position_embeddings"])  # type: ignore[call-overload]


def test_server_facts_keep_the_last_off_switch_counters_line(tmp_path: Path) -> None:
    """``offswitch.facts``: of the counters lines the hook logs as its scheduler goes idle, the
    last one (how depth 0 ran over the whole call), whatever came before it."""
    from types import SimpleNamespace

    log = tmp_path / "server_off.log"
    startup = [f"spec controller: startup line {i}" for i in range(25)]
    counted = [f"spec controller: off switch so far: {n} depth-0 steps as plain decodes" for n in (10, 250)]
    log.write_text("\n".join([*startup, counted[0], "Traceback: not ours", counted[1]]) + "\n")
    got = offswitch.facts(SimpleNamespace(log_path=log))
    assert got["off_counters"] == [counted[1]] and len(got["off_switch"]) == 20
    log.write_text("no hook here\n")
    assert offswitch.facts(SimpleNamespace(log_path=log))["off_counters"] == []
