"""The actuator against SGLang's real ``AdaptiveController`` and a minimal adaptive worker.

The worker below implements SGLang's ``AdaptiveSpecWorker`` protocol (build a runtime state per
depth, apply one); the controller, its params and the TP broadcast (``broadcast_pyobj`` over a
gloo group of two processes) are SGLang's own code.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang_hook import compat, plugin, profiler  # noqa: E402
from sglang_hook.actuator import ActuatorState, DepthSync, TpSync, wrap_controller_params  # noqa: E402
from sglang_hook.config import HookConfig  # noqa: E402

pytestmark = pytest.mark.sglang

DEPTHS = (0, 1, 2, 3, 5)
# What the broadcast hook reads from SGLang's request receiver.
RECEIVER = SimpleNamespace(server_args=SimpleNamespace(port=30000, model_path="tiny", dp_size=1))


def fake_scheduler(free: int = 900, evictable: int = 0, total: int = 1000, waiting: int = 0) -> Any:
    """The attributes of SGLang's ``Scheduler`` that the step record reads."""
    return SimpleNamespace(
        server_args=RECEIVER.server_args,
        waiting_queue=[object()] * waiting,
        max_total_num_tokens=total,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: free),
        tree_cache=SimpleNamespace(evictable_size=lambda: evictable),
    )


def fake_decode(
    rt: plugin.HookRuntime,
    scheduler: Any,
    seq_lens: list[int],
    depth: int = 0,
    accept: list[int] | None = None,
) -> None:
    """One decode step through the hook's real record path, with SGLang's batch and result faked."""
    width = depth + 1 if depth else None  # SGLang leaves it None without speculation
    result = SimpleNamespace(speculative_num_draft_tokens=width, num_correct_drafts_per_req_cpu=accept)
    rt.after_batch_result(scheduler, fake_decode_batch(seq_lens), result)


def fake_decode_batch(seq_lens: list[int]) -> Any:
    """The attributes of SGLang's ``ScheduleBatch`` that a decode step's record reads."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(
        reqs=[object()] * len(seq_lens),
        forward_mode=ForwardMode.DECODE,
        seq_lens_sum=None,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        launch_ts=None,
    )


def fake_prefill(rt: plugin.HookRuntime, scheduler: Any, tokens: int) -> None:
    """One prefill batch through the hook's real record path: its tokens go into the next record."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch = SimpleNamespace(reqs=[object()], forward_mode=ForwardMode.EXTEND, extend_num_tokens=tokens)
    rt.after_batch_result(scheduler, batch, SimpleNamespace())


class MinimalAdaptiveWorker:
    """Implements SGLang's ``AdaptiveSpecWorker`` protocol with plain runtime states."""

    def __init__(self, steps: int) -> None:
        self.speculative_num_steps = steps
        self.speculative_num_draft_tokens = steps + 1
        self.built: list[int] = []
        self.applied: list[int] = []

    def build_adaptive_runtime_state(
        self, speculative_num_steps: int, speculative_num_draft_tokens: int, cuda_graph_bs: Any = None
    ) -> Any:
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        self.built.append(speculative_num_steps)
        return SpecRuntimeState(
            speculative_num_steps=speculative_num_steps,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            draft_attn_backend=None,
            cuda_graph_runner=None,
            target_attn_backend=f"verify-width-{speculative_num_draft_tokens}",
            target_graph_runner=None,
            draft_extend_attn_backend=None,
            cuda_graph_runner_for_draft_extend=None,
        )

    def apply_runtime_state(self, state: Any) -> None:
        self.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = state.speculative_num_draft_tokens
        self.applied.append(state.speculative_num_steps)


def make_controller(
    tmp: Path, fallback: int | None = None, initial: int = 3, resume: Any = None
) -> tuple[Any, Any, TpSync]:
    """SGLang's controller over the minimal worker, params wrapped, runtime states built."""
    cfg = tmp / "adaptive.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": list(DEPTHS)}}))
    worker = MinimalAdaptiveWorker(initial)
    controller = compat.new_adaptive_controller(worker, str(cfg))
    state = ActuatorState()
    wrap_controller_params(controller, state, fallback, resume=resume)
    controller.register(worker.build_adaptive_runtime_state(initial, initial + 1))
    controller.init_states(cuda_graph_bs=None)
    return controller, worker, TpSync(state)


def launch(controller: Any, sync: TpSync, desired: int | None, bs: int = 4) -> int:
    """One scheduler iteration on a single rank: offer → broadcast (identity) → take → launch."""
    marker = sync.offer(desired)
    reqs: list[Any] = ["req-a"] + ([marker] if marker is not None else [])
    assert sync.take(reqs) == ["req-a"]
    controller.activate_step_by_batch(bs)
    return controller.worker.speculative_num_steps


def test_every_depth_has_a_runtime_state(tmp_path: Path) -> None:
    controller, worker, sync = make_controller(tmp_path)
    assert sorted(set(worker.built)) == list(DEPTHS)
    assert sync.state.valid == frozenset(DEPTHS)
    assert controller.params.candidate_steps == list(DEPTHS)


def test_decisions_switch_the_active_runtime_state(tmp_path: Path) -> None:
    controller, worker, sync = make_controller(tmp_path)
    for depth in (5, 1, 0, 2, 2, 3, 5):
        assert launch(controller, sync, depth) == depth
        assert worker.speculative_num_draft_tokens == depth + 1
    # A repeated decision sends no new marker: the applied depth is sticky.
    assert sync.state.counters.syncs_sent == 6
    assert sync.state.counters.controller_steps == 7


def test_drafting_resumes_after_one_more_depth_0_launch_whoever_decides(tmp_path: Path) -> None:
    """With the off switch's warm resume, a depth above 0 right after depth 0 launches depth 0
    once more (marked for SGLang's whole drafter extend), then the depth decided; the fallback
    and SGLang's own policy go through it alike."""
    from controller.protocol import WarmResume

    resume = WarmResume(enabled=True)
    controller, worker, sync = make_controller(tmp_path, resume=resume)
    decided = (3, 3, 0, 0, 5, 5, 1, 0, 2, 2)
    launched, marked = [], []
    for depth in decided:
        launched.append(launch(controller, sync, depth))
        marked.append(resume.whole_extend)
    # before the first decode, prefills may have run at depth 0: the first drafted launch is warmed too
    assert launched == [0, 3, 0, 0, 0, 5, 1, 0, 0, 2]
    assert marked == [True, False, False, False, True, False, False, False, True, False]
    assert sync.state.counters.controller_steps == len(decided)

    fixed = WarmResume(enabled=True, last=5)
    controller, worker, sync = make_controller(tmp_path, fallback=3, resume=fixed)
    assert [launch(controller, sync, None) for _ in range(2)] == [3, 3]  # no depth 0 before: as chosen
    assert [launch(controller, sync, d) for d in (0, None, None)] == [0, 0, 3]  # back to the fallback: warmed

    probe = WarmResume(enabled=True)  # one drafted step asked for, then 0 again: it still drafts once
    controller, worker, sync = make_controller(tmp_path, resume=probe)
    assert [launch(controller, sync, d) for d in (0, 3, 0, 0, 0, 5, 0, 5)] == [0, 0, 3, 0, 0, 0, 5, 5]

    cold = WarmResume(enabled=False)
    controller, worker, sync = make_controller(tmp_path, resume=cold)
    assert [launch(controller, sync, d) for d in decided] == list(decided)
    assert not cold.whole_extend


def test_controller_in_charge_blocks_sglang_switches_but_keeps_its_ema_warm(tmp_path: Path) -> None:
    controller, worker, sync = make_controller(tmp_path)
    assert launch(controller, sync, 1) == 1
    inner = controller.params.inner
    before = inner.get_steps_for_batch(4)
    # Long accepted runs: SGLang's own rule wants to step up after warm-up.
    for _ in range(40):
        controller.on_verify_complete([5, 5, 5, 5], 4)
        assert worker.speculative_num_steps == 1, "SGLang's policy switched while the controller decides"
    assert inner.get_steps_for_batch(4) > before


def test_stale_or_missing_decision_falls_back_to_sglang_policy(tmp_path: Path) -> None:
    controller, worker, sync = make_controller(tmp_path)
    assert launch(controller, sync, 5) == 5
    sglang_choice = controller.params.inner.get_steps_for_batch(4)
    assert sglang_choice != 5
    assert launch(controller, sync, None) == sglang_choice
    assert sync.state.counters.fallback_steps == 1
    # In the fallback SGLang's own switches apply again.
    for _ in range(40):
        controller.on_verify_complete([0, 0, 0, 0], 4)
    assert worker.speculative_num_steps == controller.params.inner.get_steps_for_batch(4)
    assert worker.speculative_num_steps < sglang_choice
    # Decisions resume.
    assert launch(controller, sync, 2) == 2


def test_fixed_fallback_depth(tmp_path: Path) -> None:
    controller, worker, sync = make_controller(tmp_path, fallback=1)
    assert launch(controller, sync, None) == 1
    assert launch(controller, sync, 5) == 5
    assert launch(controller, sync, None) == 1
    for _ in range(40):
        controller.on_verify_complete([1, 1, 1, 1], 4)
        assert worker.speculative_num_steps == 1


def test_invalid_depth_is_ignored_and_counted(tmp_path: Path) -> None:
    controller, worker, sync = make_controller(tmp_path)
    assert launch(controller, sync, 5) == 5
    sglang_choice = controller.params.inner.get_steps_for_batch(4)
    assert launch(controller, sync, 4) == sglang_choice  # 4 has no runtime state
    assert sync.state.counters.invalid_depth == 1
    assert launch(controller, sync, 3) == 3


def test_a_marker_with_a_depth_sglang_did_not_build_is_applied_as_none(tmp_path: Path) -> None:
    """A rank never hands SGLang a depth it has no runtime state for, whatever the broadcast carried."""
    controller, worker, sync = make_controller(tmp_path)
    assert launch(controller, sync, 5) == 5
    assert sync.take(["req", DepthSync(depth=4, seq=99)]) == ["req"]  # not from offer(): forged
    assert sync.state.applied is None and sync.state.counters.invalid_depth == 1
    controller.activate_step_by_batch(4)
    assert worker.speculative_num_steps == controller.params.inner.get_steps_for_batch(4)
    assert sync.state.counters.fallback_steps == 1


def test_a_depth_taken_before_the_runtime_states_were_known_is_checked_when_they_are(tmp_path: Path) -> None:
    state = ActuatorState()
    TpSync(state).take([DepthSync(depth=4, seq=1)])  # valid unknown yet: kept
    assert state.applied == 4
    cfg = tmp_path / "adaptive.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": list(DEPTHS)}}))
    controller = compat.new_adaptive_controller(MinimalAdaptiveWorker(3), str(cfg))
    wrap_controller_params(controller, state, None)
    assert state.valid == frozenset(DEPTHS) and state.applied is None


def test_actuator_failure_falls_back_to_sglang(tmp_path: Path) -> None:
    controller, worker, sync = make_controller(tmp_path)
    launch(controller, sync, 5)

    class Corrupt:  # the wrapper's state, broken: reading the depth raises
        counters = sync.state.counters

        @property
        def applied(self) -> int:
            raise RuntimeError("corrupt")

    controller.params._state = Corrupt()
    controller.activate_step_by_batch(4)
    assert worker.speculative_num_steps == controller.params.inner.get_steps_for_batch(4)
    assert sync.state.counters.hook_errors == 1


class ScriptedClient:
    """The entry rank's client, its newest decision read from a script (``None`` = none yet).

    Freshness itself is tested with the real client and controller below; here the point is
    what the ranks do with whatever the entry rank decided.
    """

    refresh_drains = False

    def __init__(self, script: list[int | None]) -> None:
        self.script = script
        self.i = 0

    @property
    def fresh_depth(self) -> int | None:
        value = self.script[self.i]
        self.i += 1
        return value


def depth_now(rt: plugin.HookRuntime) -> int | None:
    """What the entry rank applies for the next decode launch (None: fall back).

    Through the broadcast, that is what the top of the next scheduler iteration offers; on a
    replica of one rank, what the last step record applied.
    """
    if rt.direct:
        return rt.state.applied
    rt.offer(RECEIVER)
    return rt.sync.last_desired


def test_broadcast_hook_survives_a_failing_poll() -> None:
    rt = plugin.HookRuntime(HookConfig(endpoint="ipc:///tmp/hook-none.sock"), compat.Ranks())

    class Broken:
        refresh_drains = False

        @property
        def fresh_depth(self) -> int:
            raise RuntimeError("boom")

    rt.client = Broken()
    plugin.reset_runtime(rt)
    try:
        out = plugin.broadcast_hook(lambda recv, reqs: reqs, RECEIVER, ["a", "b"])
        assert out == ["a", "b"]
        assert rt.state.counters.hook_errors == 1
    finally:
        plugin.reset_runtime(None)


def _tp_rank_main(rank: int, world: int, init_file: str, script: list[int | None], out_dir: str) -> None:
    import torch.distributed as dist
    from sglang.srt.utils import broadcast_pyobj

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tmp = Path(out_dir) / f"rank{rank}"
    tmp.mkdir(parents=True, exist_ok=True)
    rt = plugin.HookRuntime(
        HookConfig(endpoint="ipc:///tmp/hook-none.sock"), compat.Ranks(tp_rank=rank, tp_size=world)
    )
    plugin.reset_runtime(rt)
    cfg = tmp / "adaptive.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": list(DEPTHS)}}))
    worker = MinimalAdaptiveWorker(3)
    controller = compat.new_adaptive_controller(worker, str(cfg))
    plugin.controller_init_hook(lambda c: None, controller)  # the plugin's own wrapping
    controller.register(worker.build_adaptive_runtime_state(3, 4))
    controller.init_states(cuda_graph_bs=None)
    if rank == 0:
        rt.client = ScriptedClient(script)  # connected; decisions come from the script

    def original(receiver: Any, recv_reqs: Any) -> Any:
        return broadcast_pyobj(recv_reqs, rank, None, src=0)

    rng = random.Random(7)  # same seed on every rank: identical verify results, as in SGLang
    applied = []
    for step in range(len(script)):
        pulled = [f"req-{step}"] if rank == 0 and step % 3 == 0 else ([] if rank == 0 else None)
        reqs = plugin.broadcast_hook(original, RECEIVER, pulled)
        assert all(type(r) is not DepthSync for r in reqs)
        assert reqs == ([f"req-{step}"] if step % 3 == 0 else [])
        bs = 1 + step % 4
        controller.activate_step_by_batch(bs)
        applied.append(worker.speculative_num_steps)
        controller.on_verify_complete([rng.randint(0, worker.speculative_num_steps) for _ in range(bs)], bs)
    (Path(out_dir) / f"applied{rank}.json").write_text(
        json.dumps({"applied": applied, "invalid": rt.state.counters.invalid_depth})
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp_broadcast_applies_the_same_depth_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    rng = random.Random(3)
    choices: list[int | None] = [0, 1, 2, 3, 5, None, 4]  # 4: no runtime state, ignored
    script = [rng.choice(choices) for _ in range(60)]
    for k in range(10, 14):
        script[k] = None  # a stale stretch
    world = 2
    init_file = str(tmp_path / "dist-init")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_tp_rank_main, args=(world, init_file, script, str(tmp_path)), nprocs=world, join=True)
    runs = [json.loads((tmp_path / f"applied{r}.json").read_text()) for r in range(world)]
    assert runs[0]["applied"] == runs[1]["applied"]
    for step, (want, got) in enumerate(zip(script, runs[0]["applied"], strict=True)):
        if want is not None and want in DEPTHS:
            assert got == want, f"step {step}: decision {want}, applied {got}"
    assert runs[0]["invalid"] == script.count(4)


@pytest.mark.parametrize("single_rank", [False, True], ids=["broadcast", "one-rank"])
@pytest.mark.parametrize("client_thread", [True, False], ids=["client-thread", "inline"])
def test_staleness_runs_only_while_steps_are_unanswered(
    tmp_path: Path, client_thread: bool, single_rank: bool
) -> None:
    """Real client, real controller service: idle keeps the decision, a dead controller does not."""
    import threading
    import time

    from controller.service import ServeConfig, Server

    endpoint = f"ipc://{tmp_path}/ctl.sock"

    def serve() -> tuple[Server, threading.Thread]:
        server = Server(ServeConfig(policy="builtin:static:2", bind=endpoint))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return server, thread

    rt = plugin.HookRuntime(
        HookConfig(endpoint=endpoint, stale_ms=200.0, client_thread=client_thread, single_rank=single_rank),
        compat.Ranks(),
    )
    assert rt.direct is single_rank
    rt.state.valid = frozenset(DEPTHS)  # as if SGLang built runtime states for DEPTHS
    scheduler = fake_scheduler()

    def step_until(want: int | None, timeout_s: float = 5.0) -> int | None:
        deadline = time.monotonic() + timeout_s
        got = depth_now(rt)
        while got != want and time.monotonic() < deadline:
            fake_decode(rt, scheduler, [10])
            time.sleep(0.01)
            got = depth_now(rt)
        return got

    server, thread = serve()
    try:
        client = rt._ensure_client(RECEIVER.server_args)
        assert type(client).__name__ == ("ClientThread" if client_thread else "InlineClient")
        assert rt.hello_depths == DEPTHS
        assert step_until(2) == 2
        time.sleep(0.5)  # idle for longer than stale_ms: no steps, nothing to answer
        if single_rank:
            fake_decode(rt, scheduler, [10])  # the first step after idle applies what it finds
        assert depth_now(rt) == 2
    finally:
        server.stop()
        thread.join(5)
    # Controller gone: the next steps go unanswered and the decision turns stale.
    t0 = time.monotonic()
    assert step_until(None) is None
    assert 0.15 <= time.monotonic() - t0 < 2.0
    server, thread = serve()  # restarted: the client says hello again and decisions resume
    try:
        assert step_until(2) == 2
        assert rt.client.counters["hellos"] >= 2
    finally:
        rt.client.close()
        server.stop()
        thread.join(5)


def test_the_scheduler_thread_never_touches_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real client thread, real controller: every per-step ZeroMQ call runs on the client's thread."""
    import threading
    import time

    from controller.service import ServeConfig, Server
    from sglang_hook.client import ControllerClient

    endpoint = f"ipc://{tmp_path}/ctl.sock"
    server = Server(ServeConfig(policy="builtin:static:3", bind=endpoint))
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    callers: set[int] = set()
    for name in ("send_step", "poll_decision", "wait", "_send_hello"):
        original = getattr(ControllerClient, name)

        def traced(self: Any, *args: Any, _original: Any = original) -> Any:
            callers.add(threading.get_ident())
            return _original(self, *args)

        monkeypatch.setattr(ControllerClient, name, traced)
    rt = plugin.HookRuntime(HookConfig(endpoint=endpoint, client_thread=True), compat.Ranks())
    rt.state.valid = frozenset(DEPTHS)
    try:
        client = rt._ensure_client(RECEIVER.server_args)
        assert client is not None
        callers.clear()  # the first hello goes out as the client is built; steps are what count
        got = None
        deadline = time.monotonic() + 5.0
        scheduler = fake_scheduler()
        for _ in range(1, 10_000):
            fake_decode(rt, scheduler, [10])
            time.sleep(0.002)  # a decode step
            got = depth_now(rt)
            if got == 3 or time.monotonic() > deadline:
                break
        assert got == 3
        assert client.decisions >= 1 and client.dropped == 0 and client.errors == 0
        assert callers == {client._thread.ident}, "a ZeroMQ call ran on the caller's thread"
    finally:
        if rt.client is not None:
            rt.client.close()
        server.stop()
        serving.join(5)


def test_client_thread_off_visits_the_socket_on_the_callers_thread(tmp_path: Path) -> None:
    """--spec-client-thread off (the default): no thread; each record drains replies, then sends."""
    import threading
    import time

    from controller.service import ServeConfig, Server
    from sglang_hook.client import InlineClient

    endpoint = f"ipc://{tmp_path}/ctl.sock"
    server = Server(ServeConfig(policy="builtin:static:3", bind=endpoint))
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    threads_before = threading.active_count()
    rt = plugin.HookRuntime(HookConfig(endpoint=endpoint, client_thread=False), compat.Ranks())
    rt.state.valid = frozenset(DEPTHS)
    try:
        client = rt._ensure_client(RECEIVER.server_args)
        assert type(client) is InlineClient
        assert threading.active_count() == threads_before
        got = None
        deadline = time.monotonic() + 5.0
        scheduler = fake_scheduler()
        for _ in range(1, 10_000):
            fake_decode(rt, scheduler, [10])
            time.sleep(0.002)
            got = depth_now(rt)
            if got == 3 or time.monotonic() > deadline:
                break
        assert got == 3 and client.counters["sent"] >= 1
    finally:
        if rt.client is not None:
            rt.client.close()
        server.stop()
        serving.join(5)


def test_one_socket_visit_per_step_and_polls_again_when_records_stop() -> None:
    """Inline: the record drains replies before sending; the iteration top drains only when it is stale."""
    import time

    from controller.protocol import Step
    from sglang_hook.client import InlineClient

    class CountingClient:  # ControllerClient's calls, counted
        def __init__(self) -> None:
            self.polls = self.sends = 0
            self.depth: int | None = 3
            self.counters = {"decisions": 0}

        def poll_decision(self) -> int | None:
            self.polls += 1
            self.counters["decisions"] += 1  # a decision came back each time
            return self.depth

        def fresh_depth(self, now_ns: int | None = None) -> int | None:
            return self.depth

        def send_step(self, step: Step) -> None:
            self.sends += 1

    rt = plugin.HookRuntime(HookConfig(endpoint="ipc:///tmp/hook-none.sock"), compat.Ranks())
    rt.instance, rt.hello_depths = "i", (0,)
    inner = CountingClient()
    rt.client = InlineClient(  # as the hook makes it on a server that speculates
        inner,  # type: ignore[arg-type]
        build=rt.build_step,
        refresh_after_ns=plugin.POLL_AFTER_NS,
    )
    scheduler = fake_scheduler()
    for _ in range(3):
        fake_decode(rt, scheduler, [10])
        assert depth_now(rt) == 3  # right after a record: no second visit
    assert (inner.sends, inner.polls) == (3, 3)
    time.sleep(plugin.POLL_AFTER_NS / 1e9 + 0.005)  # a long prefill or an idle gap
    assert depth_now(rt) == 3
    assert inner.polls == 4


class RecordingClient:
    """ControllerClient's interface, keeping what it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.depth: int | None = None
        self.counters = {"decisions": 0}

    def send_step(self, step: Any) -> None:
        self.sent.append(step)

    def poll_decision(self) -> int | None:
        return None

    def fresh_depth(self, now_ns: int | None = None) -> int | None:
        return None

    def wait(self, timeout_ms: int) -> bool:
        return False

    def close(self) -> None:
        pass


@pytest.mark.parametrize("thread", [False, True], ids=["inline", "client-thread"])
def test_the_step_record_holds_what_sglang_reported(thread: bool) -> None:
    """The scheduler thread captures; the record is built inline or on the client thread, the same."""
    import time

    from controller.protocol import Step
    from sglang_hook.client import ClientThread, InlineClient

    rt = plugin.HookRuntime(HookConfig(endpoint="ipc:///tmp/hook-none.sock"), compat.Ranks())
    rt.instance, rt.hello_depths = "i", DEPTHS
    inner = RecordingClient()
    wrap = ClientThread if thread else InlineClient
    rt.client = wrap(inner, build=rt.build_step)  # type: ignore[arg-type]
    scheduler = fake_scheduler(free=600, evictable=100, total=1000, waiting=2)
    try:
        fake_prefill(rt, scheduler, 3)
        fake_prefill(rt, scheduler, 4)
        fake_decode(rt, scheduler, [10, 20, 30, 40], depth=3, accept=[-1, 2, 5, 3])
        fake_decode(rt, scheduler, [11, 21], depth=3, accept=[1, 0])
        fake_decode(rt, scheduler, [12, 22], depth=4, accept=[1, 0])  # not announced: skipped
        fake_decode(rt, scheduler, [12, 22, 5], depth=3, accept=[1, 0])  # accept not for every request
        deadline = time.monotonic() + 5.0
        while len(inner.sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        rt.client.close()
    assert rt.skipped_records == 2
    got = [
        (s.seq, s.depth, s.bs, s.waiting, s.accept, s.ctx_tokens, s.kv_usage, s.prefill_tokens)
        for s in inner.sent
    ]
    assert all(type(s) is Step for s in inner.sent)
    assert got == [
        (1, 3, 4, 2, [0, 2, 3, 3], 100, pytest.approx(0.3), 7),
        (2, 3, 2, 2, [1, 0], 32, pytest.approx(0.3), 0),
    ]
    assert inner.sent[0].ts_ns < inner.sent[1].ts_ns


def test_inline_client_without_speculation_drains_only_now_and_then() -> None:
    """No decision is applied without speculation: a record is one send, replies drain rarely."""
    from controller.protocol import Step
    from sglang_hook.client import InlineClient

    class CountingClient(RecordingClient):
        polls = 0

        def poll_decision(self) -> int | None:
            self.polls += 1
            return None

    inner = CountingClient()
    client = InlineClient(inner, min_drain_ns=10**12)  # type: ignore[arg-type]
    for seq in range(1, 6):
        client.submit(Step("i", seq, 0, 1, 0, [], 1000, 10, 0.1, 0, seq))
    client.refresh()
    assert (len(inner.sent), inner.polls) == (5, 1)


@pytest.mark.parametrize(
    ("speculative", "flag", "want"),
    [
        (True, None, "InlineClient"),
        (False, None, "InlineClient"),
        (True, True, "ClientThread"),
        (False, True, "ClientThread"),
        (True, False, "InlineClient"),
    ],
)
def test_the_client_runs_inline_unless_its_thread_is_asked_for(speculative: bool, flag: bool | None, want: str) -> None:
    # auto is inline wherever SGLang runs: a thread that wakes every millisecond for the GIL
    # slowed a launch-bound EAGLE-3 scheduler on the H100 (call AI).
    rt = plugin.HookRuntime(
        HookConfig(endpoint="ipc:///tmp/hook-none.sock", client_thread=flag), compat.Ranks()
    )
    if speculative:
        rt.state.valid = frozenset(DEPTHS)
    client = rt._ensure_client(RECEIVER.server_args)
    try:
        assert type(client).__name__ == want
        assert rt.hello_depths == (DEPTHS if speculative else (0,))
    finally:
        client.close()


def read_profile(path: Path) -> dict[str, list[int]]:
    """The benchmark profiler's JSON lines, each key's values concatenated (counters left out)."""
    prof: dict[str, list[int]] = {}
    for line in path.read_text().splitlines():
        for key, values in json.loads(line).items():
            if key != "counters":
                prof.setdefault(key, []).extend(values)
    return prof


def test_the_profiler_times_the_wrappers_own_work_not_sglangs() -> None:
    """Benchmark accounting: both wrapped calls open a window; SGLang's own policy update is outside it."""
    import time

    from sglang_hook.actuator import ControlledParams

    class SlowParams:  # SGLang's params, its update taking 20 ms
        candidate_steps = [0, 1, 3]

        def get_steps_for_batch(self, batch_size: int) -> int:
            return 1

        def on_verify_complete(self, accepted: list[int], batch_size: int) -> int | None:
            time.sleep(0.02)
            return 3

    class Windows:
        def __init__(self) -> None:
            self.walls: list[int] = []

        def start(self) -> int:
            return time.perf_counter_ns()

        def stop(self, t0: int) -> None:
            self.walls.append(time.perf_counter_ns() - t0)

    state, prof = ActuatorState(), Windows()
    params = ControlledParams(SlowParams(), state, profiler=prof)
    state.applied = 3  # a decision is in charge: SGLang's switch is suppressed
    assert params.get_steps_for_batch(4) == 3
    assert params.on_verify_complete([1, 2, 0, 3], 4) is None
    state.applied = None  # no decision: SGLang's policy decides and switches
    assert params.get_steps_for_batch(4) == 1
    assert params.on_verify_complete([1, 2, 0, 3], 4) == 3
    assert len(prof.walls) == 4
    assert max(prof.walls) < 10_000_000, "SGLang's 20 ms update was counted as the hook's"


def test_the_benchmark_profiler_writes_one_entry_per_record_and_the_longest_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPECDEPTH_PROFILE_OUT: per record, the hook's windows summed, split by site, and the longest one."""

    from sglang_hook.client import InlineClient

    out = tmp_path / "prof.jsonl"
    monkeypatch.setenv(profiler.ENV_PROFILE_OUT, str(out))
    rt = plugin.HookRuntime(HookConfig(endpoint="ipc:///tmp/hook-none.sock"), compat.Ranks())
    assert isinstance(rt.profiler, profiler.HookProfiler)
    rt.instance, rt.hello_depths = "i", DEPTHS
    inner = RecordingClient()
    rt.client = InlineClient(inner, build=rt.build_step)  # type: ignore[arg-type]
    plugin.reset_runtime(rt)
    scheduler = fake_scheduler()
    try:
        for k in range(5):
            plugin.broadcast_hook(lambda receiver, reqs: reqs, RECEIVER, [])  # an iteration top
            if k == 2:  # a prefill iteration in between: its top and record go to the next decode
                fake_prefill(rt, scheduler, 16)
                plugin.broadcast_hook(lambda receiver, reqs: reqs, RECEIVER, [])
            fake_decode(rt, scheduler, [10, 20], depth=3, accept=[1, 2])
        rt.profiler.flush()
    finally:
        plugin.reset_runtime(None)
        rt.profiler.close()  # the profiler's GC timer, which it installed
    prof = read_profile(out)
    assert len(inner.sent) == 5
    per_record = [k for k in profiler.PROFILE_KEYS if k not in ("iter_ns", "iter_decode")]
    assert all(len(prof[k]) == 5 for k in per_record), {k: len(prof[k]) for k in per_record}
    assert prof["polls"] == [1, 1, 2, 1, 1]
    assert prof["bs"] == [2] * 5 and prof["step_us"] == [s.step_us for s in inner.sent]  # each record's own
    for i in range(5):
        sites = prof["rec_ns"][i] + prof["poll_ns"][i] + prof["wrap_ns"][i]
        assert prof["hook_ns"][i] == sites  # the send is timed inside the record's window
        assert 0 < prof["max_window_ns"][i] <= prof["hook_ns"][i]
        assert profiler.PROFILE_SITES[prof["max_window_site"][i]] in ("rec", "poll")
    assert len(prof["iter_ns"]) == 5  # iterations that processed a batch: 5 decodes, 1 prefill, less the last
    assert prof["iter_decode"][:3] == [1, 1, 0]


class SubmitScriptedClient(ScriptedClient):
    """A client whose newest decision changes with each record it is given (from the script)."""

    busy_cpu_ns = last_lag_ns = 0  # what the benchmark profiler reads from a client

    def __init__(self, script: list[int | None]) -> None:
        super().__init__(script)
        self.records: list[Any] = []

    def submit(self, captured: Any) -> None:
        self.records.append(captured)


def test_one_rank_applies_each_decision_after_its_step_record(tmp_path: Path) -> None:
    """Without the broadcast hook: SGLang's real controller launches at the depth the last record found."""
    controller, worker, _ = make_controller(tmp_path)
    rt = plugin.HookRuntime(
        HookConfig(endpoint="ipc:///tmp/hook-none.sock", single_rank=True), compat.Ranks()
    )
    assert rt.direct
    rt.state = controller.params._state  # the state SGLang's wrapped params read
    rt.sync = TpSync(rt.state)
    rt.instance, rt.hello_depths = "i", DEPTHS
    script: list[int | None] = [1, 1, 5, None, 4, 2, 2]
    rt.client = SubmitScriptedClient(script)
    scheduler = fake_scheduler()
    launched = []
    for _ in script:
        fake_decode(rt, scheduler, [10, 20], depth=worker.speculative_num_steps, accept=[0, 0])
        controller.activate_step_by_batch(2)
        launched.append(worker.speculative_num_steps)
    sglang_default = controller.params.inner.get_steps_for_batch(2)
    # None and 4 (no runtime state) hand the launch back to SGLang's policy.
    assert launched == [1, 1, 5, sglang_default, sglang_default, 2, 2]
    assert rt.state.counters.invalid_depth == 1
    assert len(rt.client.records) == len(script)


def test_a_one_rank_launch_on_several_ranks_applies_nothing() -> None:
    """The broadcast is not hooked, so the entry rank must not follow the controller alone."""
    rt = plugin.HookRuntime(
        HookConfig(endpoint="ipc:///tmp/hook-none.sock", single_rank=True), compat.Ranks(tp_rank=0, tp_size=2)
    )
    assert not rt.direct
    rt.state.valid = frozenset(DEPTHS)
    rt.instance, rt.hello_depths = "i", DEPTHS
    rt.client = SubmitScriptedClient([3, 3, 3])
    for _ in range(3):
        fake_decode(rt, fake_scheduler(), [10], depth=3, accept=[1])
    assert rt.state.applied is None and rt.state.counters.syncs_applied == 0
    assert len(rt.client.records) == 3  # telemetry still flows


def test_single_rank_is_tp_and_pp_size_one() -> None:
    assert compat.single_rank(SimpleNamespace(tp_size=1, pp_size=1))
    assert not compat.single_rank(SimpleNamespace(tp_size=2, pp_size=1))
    assert not compat.single_rank(SimpleNamespace(tp_size=1, pp_size=2))


def test_the_profiler_closes_iterations_at_the_record_on_one_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No iteration tops to close an iteration at: each batch result closes its own."""

    monkeypatch.setenv(profiler.ENV_PROFILE_OUT, str(tmp_path / "prof.jsonl"))
    rt = plugin.HookRuntime(
        HookConfig(endpoint="ipc:///tmp/hook-none.sock", single_rank=True), compat.Ranks()
    )
    rt.state.valid = frozenset(DEPTHS)
    rt.instance, rt.hello_depths = "i", DEPTHS
    rt.client = SubmitScriptedClient([3] * 4)
    try:
        for k in range(4):
            if k == 2:
                fake_prefill(rt, fake_scheduler(), 16)
            fake_decode(rt, fake_scheduler(), [10], depth=3, accept=[1])
        rt.profiler.flush()
    finally:
        rt.profiler.close()
    prof = read_profile(tmp_path / "prof.jsonl")
    assert prof["iter_decode"] == [1, 1, 0, 1, 1]
    assert all(n > 0 for n in prof["iter_ns"])
    assert prof["polls"] == [0] * 4 and prof["poll_ns"] == [0] * 4


def test_the_profiler_can_leave_the_cpu_clock_out_of_every_other_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPECDEPTH_PROFILE_CPU_CLOCK=alternate: blocks of records with and without the CPU clock's syscalls."""

    monkeypatch.setenv(profiler.ENV_PROFILE_OUT, str(tmp_path / "prof.jsonl"))
    monkeypatch.setenv(profiler.ENV_PROFILE_CPU_CLOCK, "alternate")
    rt = plugin.HookRuntime(
        HookConfig(endpoint="ipc:///tmp/hook-none.sock", single_rank=True), compat.Ranks()
    )
    rt.instance, rt.hello_depths = "i", DEPTHS
    n = 3 * profiler.PROFILE_FLUSH_EVERY
    rt.client = SubmitScriptedClient([None] * n)
    try:
        for _ in range(n):
            fake_decode(rt, fake_scheduler(), [10])
    finally:
        rt.profiler.close()
    prof = read_profile(tmp_path / "prof.jsonl")
    block = profiler.PROFILE_FLUSH_EVERY
    assert prof["cpu_clock"] == [1] * block + [0] * block + [1] * block
    off = [i for i, on in enumerate(prof["cpu_clock"]) if not on]
    assert all(prof["hook_cpu_ns"][i] == prof["ref_cpu_ns"][i] == 0 for i in off)
    assert all(prof["hook_ns"][i] > 0 for i in off)  # the wall clock still times every window
    assert sum(prof["ref_cpu_ns"][:block]) > 0


def test_without_a_cpu_mirror_of_seq_lens_the_requests_are_summed_off_the_scheduler_thread() -> None:
    """EAGLE v2 with triton or FA3 keeps neither seq_lens_sum nor seq_lens_cpu: the scheduler
    thread hands over the batch's request list, and build_step sums each Req.seqlen."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    class Req:
        reads = 0

        def __init__(self, n: int) -> None:
            self.n = n

        @property
        def seqlen(self) -> int:
            Req.reads += 1
            return self.n

    rt = plugin.HookRuntime(
        HookConfig(endpoint="ipc:///tmp/hook-none.sock", single_rank=True), compat.Ranks()
    )
    rt.state.valid = frozenset(DEPTHS)
    rt.instance, rt.hello_depths = "i", DEPTHS
    rt.client = SubmitScriptedClient([3])
    reqs = [Req(n) for n in (100, 250, 7)]
    batch = SimpleNamespace(
        reqs=reqs, forward_mode=ForwardMode.DECODE, seq_lens_sum=None, seq_lens_cpu=None, launch_ts=None
    )
    result = SimpleNamespace(speculative_num_draft_tokens=4, num_correct_drafts_per_req_cpu=[1, 3, 0])
    scheduler = fake_scheduler()
    rt.after_batch_result(scheduler, batch, result)
    assert Req.reads == 0  # nothing per request on the scheduler thread
    (captured,) = rt.client.records
    step = rt.build_step(captured)
    assert step.ctx_tokens == 357 and Req.reads == 3
    assert step.accept == [1, 3, 0] and step.depth == 3 and step.bs == 3


def test_idle_after_work_logs_the_off_switch_counters_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_idle`` asks the off switch to log its counters only when a decode ran since the last
    idle, and a failure there stays in the hook."""
    from sglang_hook import off_switch

    calls: list[int] = []
    monkeypatch.setattr(off_switch, "log_counters_if_changed", lambda: calls.append(1) or True)
    rt = plugin.HookRuntime(HookConfig(endpoint="ipc:///tmp/hook-none.sock"), compat.Ranks())
    rt.client = object()  # connected: on_idle has nothing else to do
    sched = SimpleNamespace(server_args=SimpleNamespace())
    rt.on_idle(sched)
    assert calls == []  # idle before any decode
    rt.prev_decode_ns = 123
    rt.on_idle(sched)
    rt.on_idle(sched)
    assert calls == [1] and rt.prev_decode_ns is None

    def boom() -> bool:
        raise RuntimeError("log")

    monkeypatch.setattr(off_switch, "log_counters_if_changed", boom)
    rt.prev_decode_ns = 456
    rt.on_idle(sched)  # does not raise
    assert rt.prev_decode_ns is None
