"""The off switch (``sglang_hook.off_switch``): depth 0 as a plain decode.

SGLang's speculative workers only import on a CPU machine, so what runs here is the hook's own
logic around SGLang's real classes and enums: which states and steps it touches, that every
SGLang name it swaps is restored, and that every failure falls back to SGLang's own depth 0.
The GPU run (``bench/h200/offswitch.py``) shows the plain path itself: throughput against a
plain server and identical greedy outputs.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.speculative import eagle_worker_v2  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_hook import actuator, off_switch  # noqa: E402

pytestmark = pytest.mark.sglang


def test_config_from_env() -> None:
    assert off_switch.OffConfig.from_env({}) == off_switch.OffConfig(plain=True, keep_draft=True)
    cfg = off_switch.OffConfig.from_env({off_switch.ENV_OFF_PATH: "sglang", off_switch.ENV_OFF_DRAFT: "skip"})
    assert cfg == off_switch.OffConfig(plain=False, keep_draft=False)
    with pytest.raises(ValueError, match="plain or sglang"):
        off_switch.OffConfig.from_env({off_switch.ENV_OFF_PATH: "fast"})
    with pytest.raises(ValueError, match="keep or skip"):
        off_switch.OffConfig.from_env({off_switch.ENV_OFF_DRAFT: "maybe"})


class RecordingRunner:
    """Stands in for SGLang's runner base: records what SGLang's ``__init__`` would see."""

    def __init__(self, model_runner: Any, *, attn_backend: Any = None, **kw: Any) -> None:
        self.seen_algorithm = model_runner.spec_algorithm
        self.seen_kw = kw
        self.return_hidden_states_mode = CaptureHiddenMode.NULL  # what BaseRunner assigns
        self.capture_hidden_mode = self.return_hidden_states_mode

    def can_run_graph(self, forward_batch: Any) -> bool:
        return True  # SGLang's checks: width and batch size, not the mode


def test_plain_runner_is_built_non_speculative_and_keeps_hidden_states() -> None:
    cls = off_switch.plain_runner_class(RecordingRunner)
    model_runner = SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE3)
    runner = cls(model_runner, attn_backend="backend", speculative_num_steps=3, speculative_num_draft_tokens=4)
    assert runner.seen_algorithm is SpeculativeAlgorithm.NONE  # DECODE capture, no spec_info
    assert model_runner.spec_algorithm is SpeculativeAlgorithm.EAGLE3  # restored
    assert runner.seen_kw == {"speculative_num_steps": 0, "speculative_num_draft_tokens": 1}
    assert runner.capture_hidden_mode == CaptureHiddenMode.FULL  # the drafter reads them
    assert off_switch.is_plain(runner) and not off_switch.is_plain(RecordingRunner(model_runner))
    assert off_switch.plain_runner_class(RecordingRunner) is cls


def test_plain_graphs_replay_only_decode_batches() -> None:
    # The fallback after a failed plain step hands SGLang a one-token verify batch: the model
    # runner must run it eagerly, never through these DECODE graphs.
    runner = off_switch.plain_runner_class(RecordingRunner)(SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE3))
    assert runner.can_run_graph(SimpleNamespace(forward_mode=ForwardMode.DECODE))
    assert not runner.can_run_graph(SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY))
    assert not runner.can_run_graph(SimpleNamespace(forward_mode=ForwardMode.IDLE))


def test_plain_runner_restores_the_algorithm_when_capture_fails() -> None:
    class Failing(RecordingRunner):
        def __init__(self, model_runner: Any, **kw: Any) -> None:
            raise RuntimeError("capture failed")

    model_runner = SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE3)
    with pytest.raises(RuntimeError):
        off_switch.plain_runner_class(Failing)(model_runner)
    assert model_runner.spec_algorithm is SpeculativeAlgorithm.EAGLE3


def test_real_decode_graph_runner_subclasses() -> None:
    cls = off_switch.plain_runner_class(eagle_worker_v2.DecodeCudaGraphRunner)
    assert issubclass(cls, eagle_worker_v2.DecodeCudaGraphRunner)
    assert isinstance(vars(cls)["return_hidden_states_mode"], property)


def worker() -> Any:
    return SimpleNamespace(speculative_algorithm=SpeculativeAlgorithm.EAGLE3)


def test_build_state_swaps_the_runner_for_depth_0_only() -> None:
    base = eagle_worker_v2.DecodeCudaGraphRunner
    seen: list[tuple[int, type]] = []

    def original(w: Any, steps: int, draft_tokens: int, cuda_graph_bs: Any = None) -> str:
        seen.append((steps, eagle_worker_v2.DecodeCudaGraphRunner))
        return f"state{steps}"

    assert off_switch.build_state_hook(original, worker(), 3, 4) == "state3"
    assert off_switch.build_state_hook(original, worker(), 0, 1, cuda_graph_bs=[1, 2]) == "state0"
    assert seen[0] == (3, base)
    assert seen[1][0] == 0 and issubclass(seen[1][1], base) and seen[1][1] is not base
    assert eagle_worker_v2.DecodeCudaGraphRunner is base


def test_build_state_falls_back_to_sglangs_depth_0_when_the_plain_graph_fails() -> None:
    base = eagle_worker_v2.DecodeCudaGraphRunner
    calls: list[type] = []

    def original(w: Any, steps: int, draft_tokens: int) -> str:
        calls.append(eagle_worker_v2.DecodeCudaGraphRunner)
        if eagle_worker_v2.DecodeCudaGraphRunner is not base:
            raise RuntimeError("capture failed")
        return "verify-state"

    errors = off_switch.COUNTERS.errors
    assert off_switch.build_state_hook(original, worker(), 0, 1) == "verify-state"
    assert calls[-1] is base and eagle_worker_v2.DecodeCudaGraphRunner is base
    assert off_switch.COUNTERS.errors == errors + 1


def test_build_state_leaves_standalone_speculation_alone() -> None:
    w = SimpleNamespace(speculative_algorithm=SpeculativeAlgorithm.STANDALONE)
    seen: list[type] = []
    off_switch.build_state_hook(lambda *a: seen.append(eagle_worker_v2.DecodeCudaGraphRunner), w, 0, 1)
    assert seen == [eagle_worker_v2.DecodeCudaGraphRunner]


class Graph:
    """A decode graph runner's surface as the prepare hook uses it."""

    def __init__(self, plain: bool, fits: bool = True) -> None:
        self.specdepth_plain_decode = plain
        self.fits = fits
        self.loaded: list[Any] = []

    def can_run_graph(self, fb: Any) -> bool:
        return self.fits

    def load_batch(self, fb: Any) -> None:
        self.loaded.append(fb)


def step(graph: Graph | None, draft_tokens: int = 1) -> tuple[Any, Any, Any]:
    """A depth-0 step's batch (3 requests), verify input and target worker."""
    import torch

    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        seq_lens=torch.tensor([5, 7, 9]),
        seq_lens_cpu=torch.tensor([5, 7, 9]),
        seq_lens_sum=21,
        orig_seq_lens=torch.tensor([5, 7, 9]),
        spec_info="draft-input",
    )
    runner = SimpleNamespace(decode_cuda_graph_runner=graph)
    return batch, SimpleNamespace(draft_token_num=draft_tokens), SimpleNamespace(model_runner=runner)


def sglang_prepare(log: list[Any]) -> Any:
    """What SGLang's eagle_prepare_for_verify does to the batch, and what it returns."""

    def prepare(verify_input: Any, pool: Any, batch: Any, target_worker: Any) -> tuple[str, bool]:
        log.append(target_worker.model_runner.decode_cuda_graph_runner)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        return "verify-fb", target_worker.model_runner.decode_cuda_graph_runner is not None

    return prepare


@pytest.fixture
def decode_init(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """SGLang's ForwardBatch.init_new needs a model runner; record the batch as it sees it."""
    seen: list[dict[str, Any]] = []

    def init_new(batch: Any, model_runner: Any, *, capture_hidden_mode: Any, **kw: Any) -> Any:
        seen.append(
            {
                "mode": batch.forward_mode,
                "seq_lens": batch.seq_lens.tolist(),
                "seq_lens_cpu": batch.seq_lens_cpu.tolist(),
                "seq_lens_sum": batch.seq_lens_sum,
                "orig": batch.orig_seq_lens.tolist(),
                "spec_info": batch.spec_info,
                "hidden": capture_hidden_mode,
            }
        )
        return SimpleNamespace(ready=False, mark_forward_metadata_ready=lambda: None)

    monkeypatch.setattr(ForwardBatch, "init_new", staticmethod(init_new))
    return seen


def test_depth_0_step_becomes_a_decode_batch(decode_init: list[dict[str, Any]]) -> None:
    graph = Graph(plain=True)
    batch, vi, tw = step(graph)
    log: list[Any] = []
    fb, can_graph = off_switch.prepare_verify_hook(sglang_prepare(log), vi, None, batch, tw)
    assert log == [None]  # SGLang's prepare never loads its verify batch into the plain graph
    assert tw.model_runner.decode_cuda_graph_runner is graph
    assert can_graph and graph.loaded == [fb]
    assert decode_init == [
        {
            "mode": ForwardMode.DECODE,
            "seq_lens": [6, 8, 10],  # a decode counts the step's own token
            "seq_lens_cpu": [6, 8, 10],
            "seq_lens_sum": 24,
            "orig": [6, 8, 10],
            "spec_info": None,
            "hidden": CaptureHiddenMode.FULL,
        }
    ]
    # ... and the batch is SGLang's again: spec v2's lengths, the verify mode SGLang set.
    assert batch.seq_lens.tolist() == [5, 7, 9] and batch.seq_lens_sum == 21 and batch.spec_info == "draft-input"
    assert batch.forward_mode == ForwardMode.TARGET_VERIFY


def test_depth_0_runs_eagerly_where_no_graph_fits(decode_init: list[dict[str, Any]]) -> None:
    graph = Graph(plain=True, fits=False)
    batch, vi, tw = step(graph)
    fb, can_graph = off_switch.prepare_verify_hook(sglang_prepare([]), vi, None, batch, tw)
    assert not can_graph and graph.loaded == [] and fb != "verify-fb"
    batch, vi, tw = step(None)  # CUDA graphs off
    fb, can_graph = off_switch.prepare_verify_hook(sglang_prepare([]), vi, None, batch, tw)
    assert not can_graph and fb != "verify-fb"


def test_other_steps_and_verify_graphs_go_to_sglang(decode_init: list[dict[str, Any]]) -> None:
    log: list[Any] = []
    batch, vi, tw = step(Graph(plain=True), draft_tokens=4)
    assert off_switch.prepare_verify_hook(sglang_prepare(log), vi, None, batch, tw) == ("verify-fb", True)
    fallbacks = off_switch.COUNTERS.verify_fallbacks
    verify_graph = Graph(plain=False)  # the plain graph was never built: never replay DECODE in it
    batch, vi, tw = step(verify_graph)
    assert off_switch.prepare_verify_hook(sglang_prepare(log), vi, None, batch, tw) == ("verify-fb", True)
    assert off_switch.COUNTERS.verify_fallbacks == fallbacks + 1
    assert decode_init == []


def test_a_failing_plain_step_verifies_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("SGLang changed")

    monkeypatch.setattr(ForwardBatch, "init_new", staticmethod(broken))
    graph = Graph(plain=True)
    batch, vi, tw = step(graph)
    errors = off_switch.COUNTERS.errors
    assert off_switch.prepare_verify_hook(sglang_prepare([]), vi, None, batch, tw) == ("verify-fb", False)
    assert off_switch.COUNTERS.errors == errors + 1 and graph.loaded == []
    assert batch.seq_lens.tolist() == [5, 7, 9] and batch.spec_info == "draft-input"


def test_plugin_installs_the_off_switch_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hook import plugin

    monkeypatch.setenv("SPECDEPTH_CONTROLLER", "ipc:///tmp/off-switch-test.sock")
    monkeypatch.delenv(off_switch.SGLANG_SKIP_ENV, raising=False)
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        for path, expect in (("plain", True), ("sglang", False)):
            HookRegistry._hooks.clear()
            monkeypatch.setenv(off_switch.ENV_OFF_PATH, path)
            plugin.register()
            for target, fn in off_switch.HOOKS:
                assert any(h is fn for _, h, _ in HookRegistry._hooks.get(target, [])) is expect
            width = HookRegistry._hooks.get(off_switch.DRAFT_EXTEND_WIDTH, [])
            assert any(h is off_switch.draft_extend_width_hook for _, h, _ in width)  # either way
        monkeypatch.setenv(off_switch.ENV_OFF_PATH, "plain")
        monkeypatch.setenv(off_switch.ENV_OFF_DRAFT, "skip")
        plugin.register()
        import os

        assert os.environ.get(off_switch.SGLANG_SKIP_ENV) == "1"
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)


def test_draft_extend_graphs_take_the_width_of_the_depth_being_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt import runtime_context

    calls: list[dict[str, Any]] = []

    def original(**kw: Any) -> int:
        calls.append(kw)
        return 4  # 0.5.17: the startup server_args' width, whatever depth is being captured

    monkeypatch.setattr(runtime_context, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=1))
    assert off_switch.draft_extend_width_hook(original, phase="draft_extend", server_args=None) == 1
    assert off_switch.draft_extend_width_hook(original, phase="draft_decode", server_args=None) == 4
    assert calls == [{"phase": "draft_decode", "server_args": None}]

    def broken() -> Any:
        raise RuntimeError("no context")

    monkeypatch.setattr(runtime_context, "get_spec", broken)
    assert off_switch.draft_extend_width_hook(original, phase="draft_extend", server_args=None) == 4


def test_sglang_rule_is_quiet_only_while_it_is_not_in_charge() -> None:
    state = actuator.ActuatorState()
    flt = actuator.QuietWhileControlled(state, fixed_fallback=False)

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord(actuator.SGLANG_PARAMS_LOGGER, logging.INFO, __file__, 1, msg, None, None)

    line = "Adaptive spec params updated: steps 3 -> 1 (ema_accept_len=0.40)"
    assert flt.filter(record(line))  # SGLang's rule in charge: its switches are real
    state.applied = 3
    assert not flt.filter(record(line))
    assert flt.filter(record("something else"))
    assert not flt.filter(record("Switch adaptive runtime state: steps 3 -> 0, draft_tokens 4 -> 1"))
    assert not actuator.QuietWhileControlled(actuator.ActuatorState(), fixed_fallback=True).filter(record(line))
