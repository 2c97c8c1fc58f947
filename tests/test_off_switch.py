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

from controller.protocol import WarmResume  # noqa: E402
from sglang_hook import actuator, off_switch  # noqa: E402

pytestmark = pytest.mark.sglang


def test_config_from_env() -> None:
    assert off_switch.OffConfig.from_env({}) == off_switch.OffConfig(plain=True, draft="kv")
    cfg = off_switch.OffConfig.from_env({off_switch.ENV_OFF_PATH: "sglang", off_switch.ENV_OFF_DRAFT: "skip"})
    assert cfg == off_switch.OffConfig(plain=False, draft="skip")
    assert off_switch.OffConfig.from_env(cfg.to_env()) == cfg
    assert off_switch.OffConfig.from_env({off_switch.ENV_OFF_DRAFT: "keep"}).draft == "keep"
    with pytest.raises(ValueError, match="plain or sglang"):
        off_switch.OffConfig.from_env({off_switch.ENV_OFF_PATH: "fast"})
    with pytest.raises(ValueError, match="keep, kv or skip"):
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
        assert not HookRegistry._hooks.get(off_switch.DRAFT_EXTEND)
        monkeypatch.delenv(off_switch.SGLANG_SKIP_ENV)
        HookRegistry._hooks.clear()
        monkeypatch.setenv(off_switch.ENV_OFF_DRAFT, "kv")
        plugin.register()
        extend = HookRegistry._hooks.get(off_switch.DRAFT_EXTEND, [])
        assert any(h is off_switch.draft_extend_hook for _, h, _ in extend)
        assert off_switch.SGLANG_SKIP_ENV not in os.environ
        HookRegistry._hooks.clear()
        monkeypatch.setenv(off_switch.ENV_OFF_DRAFT, "keep")  # SGLang's whole extend: nothing to swap
        plugin.register()
        assert not HookRegistry._hooks.get(off_switch.DRAFT_EXTEND)
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


# --- ``kv``: the drafter's keys and values only, checked against SGLang's own EAGLE-3 head ---


@pytest.fixture(scope="module")
def eagle3() -> Any:
    """SGLang's ``LlamaForCausalLMEagle3`` at a tiny shape, built on this CPU.

    SGLang's layers need model-parallel groups even at one rank (SGLang's own test helper makes
    them). Its RoPE picks a GPU kernel at construction unless it believes the host is its CPU
    engine; the module's flag is set for the construction only, so RoPE runs its native path.
    """
    import socket

    import torch
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.test.layer_ut_utils import init_single_process_dist
    from transformers import LlamaConfig

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_single_process_dist(port)

    def build(**extra: Any) -> Any:
        cfg = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=extra.pop("layers", 1), vocab_size=300, max_position_embeddings=512,
            rms_norm_eps=1e-5, torch_dtype="float32",
        )  # fmt: skip
        cfg.draft_vocab_size = 100
        for k, v in extra.items():
            setattr(cfg, k, v)
        saved = rope_base._is_cpu
        rope_base._is_cpu = True
        try:
            model = LlamaForCausalLMEagle3(cfg)
        finally:
            rope_base._is_cpu = saved
        gen = torch.Generator().manual_seed(len(extra))
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (param.dim() == 1))
        return model

    return build


def pool_for(model: Any, size: int = 256) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    radix = model.model.layers[0].self_attn.attn
    return MHATokenToKVPool(
        size=size, page_size=1, dtype=torch.float32, head_num=radix.tp_k_head_num, head_dim=radix.qk_head_dim,
        layer_num=1, device="cpu", enable_memory_saver=False, start_layer=radix.layer_id,
    )  # fmt: skip


@pytest.mark.parametrize("variant", [{}, {"use_aux_norm": True}, {"norm_before_fc": True}])
def test_kv_only_stores_what_sglangs_drafter_hands_its_attention(
    eagle3: Any, variant: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference is SGLang's own drafter forward: the keys and values its layer gives the
    attention backend to store (the backend stores them as given). The KV-only update must
    store exactly those, at the step's slots, through SGLang's real KV pool."""
    import torch
    from sglang.srt.layers import radix_attention

    model = eagle3(**variant)
    seen: dict[str, Any] = {}

    class Backend:
        def forward(self, q: Any, k: Any, v: Any, layer: Any, fb: Any, save_kv_cache: bool = True, **kw: Any) -> Any:
            seen.update(k=k.clone(), v=v.clone(), layer=layer, save=save_kv_cache)
            return torch.zeros_like(q)

    monkeypatch.setattr(radix_attention, "get_attn_backend", lambda: Backend())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (5,), generator=gen)
    positions = torch.tensor([3, 17, 40, 8, 100])
    hidden = torch.randn(5, 3 * 64, generator=gen)  # the target's three auxiliary layers
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2, mm_input_embeds=None, contains_mm_inputs=lambda: False,
        spec_info=SimpleNamespace(hidden_states=hidden), positions=positions,
    )  # fmt: skip
    with torch.inference_mode():
        model.model(ids, positions, fb)
    assert seen["save"] and seen["k"].shape == (5, 2, 16)

    pool = pool_for(model)
    assert off_switch.kv_only_unsupported(model, pool) == ""
    loc = torch.tensor([10, 11, 50, 51, 200])
    with torch.inference_mode():
        off_switch.draft_kv_only(model, pool, ids, positions, hidden, loc)
    k_buf, v_buf = pool.get_kv_buffer(seen["layer"].layer_id)
    torch.testing.assert_close(k_buf[loc], seen["k"], rtol=0, atol=0)
    torch.testing.assert_close(v_buf[loc], seen["v"], rtol=0, atol=0)
    untouched = torch.ones(k_buf.shape[0], dtype=torch.bool)  # the pool's rows, padding included
    untouched[loc] = False
    assert not k_buf[untouched].any() and not v_buf[untouched].any()  # no other slot written


def test_kv_only_refuses_what_it_cannot_keep_exact(eagle3: Any) -> None:
    deep = eagle3(layers=2)
    assert "2 drafter layers" in off_switch.kv_only_unsupported(deep, pool_for(deep))
    model = eagle3()
    assert "KV pool" in off_switch.kv_only_unsupported(model, SimpleNamespace())
    assert "not an EAGLE-3 drafter" in off_switch.kv_only_unsupported(SimpleNamespace(), pool_for(model))


def draft_worker(model: Any, pool: Any, steps: int) -> Any:
    import torch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    config = SimpleNamespace(hf_config=model.config, vocab_size=300, spec_hidden_size=64, dtype=torch.float32)
    runner = SimpleNamespace(model=model, token_to_kv_pool=pool, model_config=config,
                             spec_algorithm=SpeculativeAlgorithm.EAGLE3)  # fmt: skip
    return SimpleNamespace(speculative_num_steps=steps, topk=1, draft_runner=runner)


def decode_step() -> tuple[Any, Any]:
    """A depth-0 step after its verify: spec v2's batch (lengths before this step, the slots the
    verify assigned) and the verify's result (the sampled tokens, the target's aux hidden)."""
    import torch

    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([4, 9, 2]),
                            out_cache_loc=torch.tensor([7, 8, 9]))  # fmt: skip
    result = SimpleNamespace(
        next_token_ids=torch.tensor([1, 2, 3], dtype=torch.int32),
        logits_output=SimpleNamespace(hidden_states=torch.randn(3, 192)),
        next_draft_input=SimpleNamespace(topk_p=None, topk_index=None, hidden_states=None),
    )
    return batch, result


class SGLangExtend:
    """Stands in for SGLang's whole ``_draft_extend_for_decode``: counts calls; ``shift`` makes
    it store keys that far from the KV-only update's (``at`` overrides the slots it writes)."""

    def __init__(self, pool: Any = None, model: Any = None, shift: float = 0.0, at: Any = None) -> None:
        self.calls = 0
        self.pool, self.model, self.shift, self.at = pool, model, shift, at

    def __call__(self, worker: Any, batch: Any, result: Any, *args: Any, **kwargs: Any) -> str:
        self.calls += 1
        if self.pool is not None:
            import torch

            ids, positions, hidden, loc = off_switch.kv_step_inputs(batch, result)
            loc = loc if self.at is None else self.at
            with torch.inference_mode():
                off_switch.draft_kv_only(self.model, self.pool, ids, positions, hidden, loc)
            k_buf, _ = self.pool.get_kv_buffer(self.model.model.layers[0].self_attn.attn.layer_id)
            k_buf[loc] += self.shift
        return "whole extend"


@pytest.fixture
def spec(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's runtime spec config as a server without rejection sampling has it; each step's
    drafter update stored at once (``defer`` below owes them)."""
    from sglang.srt import runtime_context

    cfg = SimpleNamespace(speculative_use_rejection_sampling=False)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: cfg)
    monkeypatch.setattr(off_switch, "_DEFER", SimpleNamespace(steps=1, rows=off_switch.DEFER_ROWS))
    return cfg


def test_depth_0_extends_store_kv_only_and_leave_sglangs_stub(eagle3: Any, spec: Any) -> None:
    import torch

    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    batch, result = decode_step()
    sglang = SGLangExtend()
    kv_steps = off_switch.COUNTERS.kv_steps
    with torch.inference_mode():
        assert off_switch.draft_extend_hook(sglang, worker, batch, result) is None
    assert sglang.calls == 0 and off_switch.COUNTERS.kv_steps == kv_steps + 1
    layer_id = model.model.layers[0].self_attn.attn.layer_id
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    # exactly what the drafter's own modules give for the sampled tokens at the verify's positions
    ref = pool_for(model)
    with torch.inference_mode():
        off_switch.draft_kv_only(model, ref, result.next_token_ids.long(), batch.seq_lens,
                                 result.logits_output.hidden_states, batch.out_cache_loc)  # fmt: skip
    torch.testing.assert_close(k_buf, ref.get_kv_buffer(layer_id)[0], rtol=0, atol=0)
    torch.testing.assert_close(v_buf, ref.get_kv_buffer(layer_id)[1], rtol=0, atol=0)
    assert k_buf[[7, 8, 9]].abs().sum(dim=(1, 2)).gt(0).all() and not k_buf[:7].any()
    nxt = result.next_draft_input  # SGLang's skip stub: zeros of the shapes the future map stashes
    assert nxt.topk_p.shape == (3, 1) and nxt.topk_p.dtype == torch.float32 and not nxt.topk_p.any()
    assert nxt.topk_index.shape == (3, 1) and nxt.topk_index.dtype == torch.int64 and not nxt.topk_index.any()
    assert nxt.hidden_states.shape == (3, 64) and not nxt.hidden_states.any()

    worker.speculative_num_steps = 3  # drafting: SGLang's extend as is
    assert off_switch.draft_extend_hook(sglang, worker, batch, result) == "whole extend" and sglang.calls == 1
    worker.speculative_num_steps = 0  # an argument the KV-only update does not know (0.5.23's plan)
    assert off_switch.draft_extend_hook(sglang, worker, batch, result, kv_loc_plan=object()) == "whole extend"
    assert sglang.calls == 2


def test_a_failing_kv_update_runs_the_whole_extend_from_then_on(eagle3: Any, spec: Any) -> None:
    import torch

    model = eagle3()
    worker = draft_worker(model, SimpleNamespace(), steps=0)  # a pool the check refuses
    sglang = SGLangExtend()
    batch, result = decode_step()
    assert off_switch.draft_extend_hook(sglang, worker, batch, result) == "whole extend" and sglang.calls == 1
    assert "KV pool" in getattr(worker, off_switch.KV_VERDICT_MARK)

    class BrokenPool:  # passes the check, fails the write: SGLang changed under the hook
        def set_kv_buffer(self, *a: Any, **kw: Any) -> None:
            raise RuntimeError("SGLang changed")

    BrokenPool.__name__ = "MHATokenToKVPool"
    worker = draft_worker(model, BrokenPool(), steps=0)
    errors = off_switch.COUNTERS.errors
    with torch.inference_mode():
        assert off_switch.draft_extend_hook(sglang, worker, batch, result) == "whole extend"
    assert off_switch.COUNTERS.errors == errors + 1 and sglang.calls == 2
    assert getattr(worker, off_switch.KV_VERDICT_MARK) == "the update failed"
    assert off_switch.draft_extend_hook(sglang, worker, batch, result) == "whole extend"  # no second try
    assert sglang.calls == 3 and off_switch.COUNTERS.errors == errors + 1

    pool = pool_for(model)  # a step that is not one token per request is not guessed at
    worker = draft_worker(model, pool, steps=0)
    batch.seq_lens = batch.seq_lens[:2]
    with torch.inference_mode():
        assert off_switch.draft_extend_hook(sglang, worker, batch, result) == "whole extend"
    assert not pool.get_kv_buffer(model.model.layers[0].self_attn.attn.layer_id)[0].any()


def test_kv_is_refused_where_the_proposal_must_be_real(eagle3: Any, spec: Any) -> None:
    model = eagle3()
    spec.speculative_use_rejection_sampling = True  # the next verify reads the drafter's probabilities
    worker = draft_worker(model, pool_for(model), steps=0)
    sglang = SGLangExtend()
    assert off_switch.draft_extend_hook(sglang, worker, *decode_step()) == "whole extend"
    assert "rejection sampling" in getattr(worker, off_switch.KV_VERDICT_MARK)
    spec.speculative_use_rejection_sampling = False
    worker = draft_worker(model, pool_for(model), steps=0)
    worker.seed_dsa_topk_from_draft_extend = True
    assert off_switch.draft_extend_hook(sglang, worker, *decode_step()) == "whole extend"
    assert "DSA" in getattr(worker, off_switch.KV_VERDICT_MARK)
    worker = SimpleNamespace(speculative_num_steps=0)  # SGLang's draft worker changed shape
    assert off_switch.draft_extend_hook(sglang, worker, *decode_step()) == "whole extend"
    assert "AttributeError" in getattr(worker, off_switch.KV_VERDICT_MARK) and sglang.calls == 3


@pytest.mark.parametrize(
    ("shift", "elsewhere", "identical"), [(0.0, False, 2), (0.5, False, 0), (0.0, True, 0)], ids=["same", "shifted", "other-slots"]
)  # fmt: skip
def test_the_kv_check_compares_with_sglangs_whole_extend(
    eagle3: Any, spec: Any, monkeypatch: pytest.MonkeyPatch, shift: float, elsewhere: bool, identical: int
) -> None:
    """``SPECDEPTH_OFF_DRAFT_CHECK``: the GPU benchmark's proof that the two write the same, at
    the same slots (the slots are cleared before SGLang's extend runs)."""
    import torch

    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    at = torch.tensor([20, 21, 22]) if elsewhere else None
    sglang = SGLangExtend(pool, model, shift=shift, at=at)
    monkeypatch.setattr(off_switch, "_CHECK", SimpleNamespace(steps=2))
    monkeypatch.setattr(off_switch, "COUNTERS", off_switch.OffCounters())
    with torch.inference_mode():
        for _ in range(3):
            off_switch.draft_extend_hook(sglang, worker, *decode_step())
    c = off_switch.COUNTERS
    assert (c.kv_steps, c.kv_checked, c.kv_identical) == (3, 2, identical)
    assert c.kv_max_dk == pytest.approx(shift) if not elsewhere else c.kv_max_dk > 0
    assert sglang.calls == 2  # the third step is not checked


@pytest.fixture
def defer(spec: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Updates owed for up to 3 steps or 12 rows, fresh counters."""
    monkeypatch.setattr(off_switch, "_DEFER", SimpleNamespace(steps=3, rows=12))
    monkeypatch.setattr(off_switch, "COUNTERS", off_switch.OffCounters())
    return off_switch._DEFER


def steps_of(n: int, seed: int = 0) -> list[tuple[Any, Any]]:
    """``n`` depth-0 steps of 3 requests moving forward one position a step, new slots each."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([4, 9, 2]) + i,
                                out_cache_loc=torch.tensor([10, 30, 50]) + i)  # fmt: skip
        result = SimpleNamespace(
            next_token_ids=torch.randint(0, 300, (3,), generator=gen, dtype=torch.int32),
            logits_output=SimpleNamespace(hidden_states=torch.randn(3, 192, generator=gen)),
            next_draft_input=SimpleNamespace(topk_p=None, topk_index=None, hidden_states=None),
        )
        out.append((batch, result))
    return out


def stored_at_once(model: Any, steps: list[tuple[Any, Any]]) -> Any:
    """The drafter cache after storing each step's update at once, in order."""
    import torch

    pool = pool_for(model)
    with torch.inference_mode():
        for batch, result in steps:
            ids, positions, hidden, loc = off_switch.kv_step_inputs(batch, result)
            off_switch.draft_kv_only(model, pool, ids.long(), positions.long(), hidden, loc)
    return pool


def test_depth_0_updates_are_owed_then_stored_in_one_pass(eagle3: Any, defer: Any) -> None:
    import torch

    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    layer_id = model.model.layers[0].self_attn.attn.layer_id
    steps = steps_of(4)
    sglang = SGLangExtend()
    with torch.inference_mode():
        for batch, result in steps[:2]:
            assert off_switch.draft_extend_hook(sglang, worker, batch, result) is None
            assert result.next_draft_input.topk_index is not None  # the stub is left every step
        assert not pool.get_kv_buffer(layer_id)[0].any()  # owed, nothing stored yet
        off_switch.draft_extend_hook(sglang, worker, *steps[2])  # the third step fills the 3 allowed
    ref = stored_at_once(model, steps[:3])
    for got, want in zip(pool.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # GEMMs of other shapes may round apart
    c = off_switch.COUNTERS
    assert (c.kv_steps, c.kv_flushes, c.kv_deferred_steps, sglang.calls) == (3, 1, 3, 0)

    # 3 + 10 rows would not fit the 12 allowed: what is owed is stored first
    with torch.inference_mode():
        off_switch.draft_extend_hook(sglang, worker, *steps[3])  # 3 rows owed
        big = steps_of(1, seed=5)[0]
        big[0].seq_lens, big[0].out_cache_loc = torch.arange(10) + 100, torch.arange(10) + 200
        big[1].next_token_ids, big[1].logits_output.hidden_states = torch.arange(10), torch.randn(10, 192)
        off_switch.draft_extend_hook(sglang, worker, *big)
    assert c.kv_flushes == 2 and getattr(worker, off_switch.PENDING_MARK).used == 10


def test_owed_updates_are_stored_before_the_drafter_cache_is_used(eagle3: Any, defer: Any) -> None:
    """A draft reads the drafter's cache and a prefill's extend writes it: what depth 0 owes goes
    first. SGLang's own extend (any depth but 0) likewise."""
    import torch

    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    layer_id = model.model.layers[0].self_attn.attn.layer_id
    for use in ("draft", "prefill", "extend"):
        steps = steps_of(2, seed=len(use))
        with torch.inference_mode():
            for batch, result in steps:
                off_switch.draft_extend_hook(SGLangExtend(), worker, batch, result)
        seen: list[bool] = []

        def sglang(w: Any, *a: Any, seen: list[bool] = seen, loc: Any = steps[1][0].out_cache_loc,
                   use: str = use, **kw: Any) -> str:  # fmt: skip
            seen.append(bool(pool.get_kv_buffer(layer_id)[0][loc].any()))
            return use

        with torch.inference_mode():
            if use == "extend":
                worker.speculative_num_steps = 3
                assert off_switch.draft_extend_hook(sglang, worker, *steps_of(1)[0]) == use
                worker.speculative_num_steps = 0
            else:
                assert off_switch.flush_first_hook(sglang, worker, "batch", "more", key="word") == use
        assert seen == [True], use
        assert getattr(worker, off_switch.PENDING_MARK).used == 0
        pool.get_kv_buffer(layer_id)[0].zero_()


def test_a_warm_resume_step_runs_sglangs_whole_extend_after_what_is_owed(
    eagle3: Any, defer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The depth-0 launch :class:`WarmResume` inserts before drafting resumes: its drafter
    extend is SGLang's whole one (the proposal the next step drafts from), after the owed
    updates are stored (SGLang's extend reads the drafter's cache); the depth-0 steps around it
    store keys and values only."""
    import torch

    resume = WarmResume(enabled=True)
    monkeypatch.setattr(off_switch, "RESUME", resume)
    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    layer_id = model.model.layers[0].self_attn.attn.layer_id
    steps = steps_of(4)
    seen: list[bool] = []

    def sglang(w: Any, batch: Any, result: Any, *a: Any, **kw: Any) -> str:
        seen.append(bool(pool.get_kv_buffer(layer_id)[0][steps[0][0].out_cache_loc].any()))
        return "whole extend"

    with torch.inference_mode():
        assert resume.depth(0) == 0
        assert off_switch.draft_extend_hook(sglang, worker, *steps[0]) is None  # owed
        assert resume.depth(3) == 0 and resume.whole_extend  # the inserted launch
        assert off_switch.draft_extend_hook(sglang, worker, *steps[1]) == "whole extend"
        assert seen == [True] and not resume.whole_extend  # what was owed went first; the mark is used up
        assert resume.depth(3) == 3 and resume.depth(0) == 0
        assert off_switch.draft_extend_hook(sglang, worker, *steps[2]) is None and seen == [True]
    c = off_switch.COUNTERS
    assert (c.warm_extends, c.kv_steps) == (1, 2)

    resume.whole_extend = True  # a worker whose KV-only update is refused runs whole extends anyway
    refused = draft_worker(model, SimpleNamespace(), steps=0)
    assert off_switch.draft_extend_hook(sglang, refused, *steps[3]) == "whole extend"
    assert resume.enabled  # that was the inserted step; the next depth-0 step finds the refusal
    assert off_switch.draft_extend_hook(sglang, refused, *steps[3]) == "whole extend"
    assert not resume.enabled  # so nothing needs warming there: no more inserted steps
    assert resume.depth(0) == 0 and resume.depth(3) == 3
    resume.enabled = True  # likewise a depth-0 extend called with what the KV-only update does not know
    assert off_switch.draft_extend_hook(sglang, worker, *steps[3], kv_loc_plan=object()) == "whole extend"
    assert not resume.enabled


def test_a_prefill_right_before_drafting_resumes_gets_sglangs_extend(
    eagle3: Any, kv_prefill: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill between the inserted depth-0 launch and the drafted one: the next decode
    drafts from its proposal, so it must be SGLang's, not the stub."""
    import torch

    resume = WarmResume(enabled=True)
    monkeypatch.setattr(off_switch, "RESUME", resume)
    model = eagle3()
    worker = draft_worker(model, pool_for(model), steps=0)
    assert resume.depth(2) == 0  # inserted: the worker stays at depth 0 for this launch
    assert off_switch.draft_prefill_hook(lambda *a, **k: "sglang", worker, *prefill_batch()) == "sglang"
    assert resume.depth(2) == 2 and resume.depth(0) == 0
    with torch.inference_mode():  # an ordinary depth-0 prefill again: keys and values only
        assert off_switch.draft_prefill_hook(lambda *a, **k: "sglang", worker, *prefill_batch()) != "sglang"
    assert off_switch.COUNTERS.kv_prefills == 1


def test_a_slot_reused_while_owed_ends_with_its_latest_owner(eagle3: Any, defer: Any) -> None:
    """A request finishes, its slot is freed and handed to another request's next token while
    both updates are owed: the later one must win, as it would with each stored at once."""
    import torch

    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    steps = steps_of(3, seed=3)
    steps[2][0].out_cache_loc = steps[0][0].out_cache_loc.clone()  # step 3 reuses step 1's slots
    with torch.inference_mode():
        for batch, result in steps:
            off_switch.draft_extend_hook(SGLangExtend(), worker, batch, result)
    layer_id = model.model.layers[0].self_attn.attn.layer_id
    ref = stored_at_once(model, steps)
    for got, want in zip(pool.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # GEMMs of other shapes may round apart


def test_a_failing_pass_drops_what_is_owed_and_turns_kv_off(eagle3: Any, defer: Any) -> None:
    import torch

    model = eagle3()

    class BrokenPool:  # stores nothing: SGLang changed under the hook
        def set_kv_buffer(self, *a: Any, **kw: Any) -> None:
            raise RuntimeError("SGLang changed")

    BrokenPool.__name__ = "MHATokenToKVPool"
    worker = draft_worker(model, BrokenPool(), steps=0)
    with torch.inference_mode():
        for batch, result in steps_of(2):
            off_switch.draft_extend_hook(SGLangExtend(), worker, batch, result)
        assert off_switch.flush_first_hook(lambda w, *a: "drafted", worker, "batch") == "drafted"
    assert getattr(worker, off_switch.PENDING_MARK) is None
    assert getattr(worker, off_switch.KV_VERDICT_MARK) == "storing owed steps failed"
    assert off_switch.COUNTERS.errors == 1
    sglang = SGLangExtend()
    assert off_switch.draft_extend_hook(sglang, worker, *steps_of(1)[0]) == "whole extend"  # kv off


def test_the_batch_check_compares_one_pass_with_one_step_at_a_time(eagle3: Any, defer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(off_switch, "_CHECK", SimpleNamespace(steps=0, batches=1))
    model = eagle3()
    worker = draft_worker(model, pool_for(model), steps=0)
    with torch.inference_mode():
        for batch, result in steps_of(6):
            off_switch.draft_extend_hook(SGLangExtend(), worker, batch, result)
    c = off_switch.COUNTERS
    assert (c.kv_flushes, c.kv_batch_checked) == (2, 1)  # 3 steps a pass; the second is not checked
    assert c.kv_batch_max_d < 1e-5 and c.kv_batch_identical in (0, 1)


def test_install_reads_the_kv_knobs_and_survives_bad_values(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setattr(off_switch, "_CHECK", SimpleNamespace(steps=0, batches=0, prefills=0))
    monkeypatch.setattr(off_switch, "_DEFER", SimpleNamespace(steps=off_switch.DEFER_STEPS, rows=off_switch.DEFER_ROWS))
    monkeypatch.setattr(off_switch, "_PREFILL", SimpleNamespace(kv=True))
    monkeypatch.setattr(off_switch, "RESUME", WarmResume())
    registered: list[str] = []
    monkeypatch.setenv(off_switch.ENV_OFF_DRAFT_CHECK, "60")
    monkeypatch.setenv(off_switch.ENV_OFF_DRAFT_DEFER, "0")  # 0 and 1: every step stores its own
    monkeypatch.setenv(off_switch.ENV_OFF_PREFILL, "sglang")
    off_switch.install(lambda target, fn: registered.append(target), off_switch.OffConfig())
    assert (off_switch._CHECK.steps, off_switch._CHECK.batches, off_switch._DEFER.steps) == (60, 10, 1)
    assert off_switch._CHECK.prefills == 10 and not off_switch._PREFILL.kv  # SGLang's, as asked
    monkeypatch.setenv(off_switch.ENV_OFF_PREFILL, "kvv")
    assert {off_switch.DRAFT_EXTEND, off_switch.DRAFT, off_switch.DRAFT_PREFILL} <= set(registered)
    monkeypatch.setenv(off_switch.ENV_OFF_DRAFT_CHECK, "lots")
    monkeypatch.delenv(off_switch.ENV_OFF_DRAFT_DEFER)
    with caplog.at_level(logging.WARNING, logger="sglang_hook"):
        off_switch.install(lambda target, fn: None, off_switch.OffConfig())
    assert off_switch._CHECK.steps == 0 and off_switch._DEFER.steps == off_switch.DEFER_STEPS
    assert off_switch._PREFILL.kv  # a misspelt value: the default, KV only, and a warning
    assert "is not a whole number" in caplog.text and "'kvv' is not one of kv, sglang" in caplog.text
    monkeypatch.delenv(off_switch.ENV_OFF_PREFILL)
    off_switch.install(lambda target, fn: None, off_switch.OffConfig())
    assert off_switch._PREFILL.kv  # unset: KV only
    assert off_switch.RESUME.enabled  # kv: drafting resumes warm unless asked otherwise
    monkeypatch.setenv(off_switch.ENV_OFF_RESUME, "cold")
    off_switch.install(lambda target, fn: None, off_switch.OffConfig())
    assert not off_switch.RESUME.enabled
    monkeypatch.setenv(off_switch.ENV_OFF_RESUME, "lukewarm")
    off_switch.install(lambda target, fn: None, off_switch.OffConfig())
    assert off_switch.RESUME.enabled and "'lukewarm' is not one of warm, cold" in caplog.text
    registered.clear()
    off_switch.install(lambda target, fn: registered.append(target), off_switch.OffConfig(draft="keep"))
    assert off_switch.DRAFT not in registered and off_switch.DRAFT_PREFILL not in registered
    assert not off_switch.RESUME.enabled  # keep's proposals are always current


# --- a depth-0 prefill's drafter extend, keys and values only (unless SPECDEPTH_OFF_PREFILL=sglang) ---


def prefill_batch(chunked: bool = False) -> tuple[Any, Any, Any]:
    """Three requests' prefill (prompt chunks of 4, 1 and 3 tokens after cached prefixes of 0, 7
    and 2), the target's aux hidden states of every token and the tokens it sampled."""
    import torch

    reqs = [SimpleNamespace(rid=i) for i in range(3)]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, extend_lens=[4, 1, 3], prefix_lens=[0, 7, 2],
        input_ids=torch.tensor([11, 12, 13, 14, 21, 31, 32, 33]), out_cache_loc=torch.arange(8) + 40,
        seq_lens=torch.tensor([4, 8, 5]), reqs=reqs, chunked_req=reqs[2] if chunked else None,
        chunked_req_next_prompt_token=34 if chunked else None, spec_info="target prefill",
    )  # fmt: skip
    return batch, torch.randn(8, 192, generator=torch.Generator().manual_seed(9)), torch.tensor([15, 22, 99])


def sglang_prefill_inputs(batch: Any, next_token_ids: Any) -> tuple[Any, Any]:
    """SGLang 0.5.23's own loop in ``_draft_extend_for_prefill`` (ids), and the positions its
    extend forward batch gives each token (its cached prefix on)."""
    import torch
    from sglang.srt.speculative.eagle_utils import _eagle_prefill_tail_tokens

    tail = _eagle_prefill_tail_tokens(batch, next_token_ids)
    ids, positions, pt = torch.empty_like(batch.input_ids), [], 0
    for i, n in enumerate(batch.extend_lens):
        ids[pt : pt + n].copy_(torch.cat((batch.input_ids[pt : pt + n][1:], tail[i].reshape(1))))
        positions += range(batch.prefix_lens[i], batch.prefix_lens[i] + n)
        pt += n
    return ids, torch.tensor(positions)


@pytest.mark.parametrize("chunked", [False, True], ids=["last-chunks", "a-chunk-continues"])
def test_prefill_inputs_are_sglangs(chunked: bool) -> None:
    batch, hidden, sampled = prefill_batch(chunked)
    ids, positions, got_hidden, loc = off_switch.prefill_inputs(batch, hidden, sampled)
    want_ids, want_positions = sglang_prefill_inputs(batch, sampled)
    assert ids.tolist() == want_ids.tolist() and positions.tolist() == want_positions.tolist()
    assert ids.tolist()[-1] == (34 if chunked else 99) and got_hidden is hidden and loc is batch.out_cache_loc
    batch.extend_lens = [4, 1, 2]  # lengths that do not cover the tokens: not guessed at
    with pytest.raises(ValueError):
        off_switch.prefill_inputs(batch, hidden, sampled)


def test_host_lengths_reach_the_batch_device_in_its_dtype() -> None:
    """``to_device_async`` keeps the dtype of the tensor it copies next to; on the CPU it is
    the host tensor itself (the pinned, non-blocking copy needs a GPU)."""
    import torch

    got = off_switch.to_device_async([3, 0, 7], torch.zeros(2, dtype=torch.int32))
    assert got.dtype == torch.int32 and got.device.type == "cpu" and got.tolist() == [3, 0, 7]


@pytest.fixture
def kv_prefill(spec: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(off_switch, "_PREFILL", SimpleNamespace(kv=True))
    monkeypatch.setattr(off_switch, "COUNTERS", off_switch.OffCounters())
    return off_switch._PREFILL


def test_a_depth_0_prefill_stores_kv_only_and_leaves_sglangs_batch(eagle3: Any, kv_prefill: Any) -> None:
    import torch
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    batch, hidden, sampled = prefill_batch()
    want_ids, want_positions = sglang_prefill_inputs(batch, sampled)
    calls: list[str] = []
    with torch.inference_mode():  # as EAGLEWorkerV2 calls it: mm_input_embeds positional, None for text
        out = off_switch.draft_prefill_hook(lambda *a, **k: calls.append("sglang"), worker, batch, hidden, sampled, None)
    assert calls == [] and off_switch.COUNTERS.kv_prefills == 1
    ref = pool_for(model)
    with torch.inference_mode():
        off_switch.draft_kv_only(model, ref, want_ids, want_positions, hidden, torch.arange(8) + 40)
    layer_id = model.model.layers[0].self_attn.attn.layer_id
    for got, want in zip(pool.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert out.topk_p.shape == (3, 1) and not out.topk_p.any() and not out.topk_index.any()
    assert out.hidden_states.shape == (3, 64) and out.bonus_tokens is sampled and out.num_tokens_per_req == 1
    assert batch.input_ids.tolist() == want_ids.tolist() and isinstance(batch.spec_info, EagleDraftExtendInput)

    embeds = torch.zeros(8, 64)  # multimodal input embeddings: SGLang's extend
    assert off_switch.draft_prefill_hook(lambda *a, **k: "sglang", worker, *prefill_batch(), embeds) == "sglang"
    worker.speculative_num_steps = 3  # drafting: the proposal is needed, SGLang's extend runs
    assert off_switch.draft_prefill_hook(lambda *a, **k: "sglang", worker, *prefill_batch()) == "sglang"
    kv_prefill.kv = False  # not asked for: SGLang's
    worker.speculative_num_steps = 0
    assert off_switch.draft_prefill_hook(lambda *a, **k: "sglang", worker, *prefill_batch()) == "sglang"


def test_a_failing_kv_prefill_runs_sglangs_from_then_on(eagle3: Any, kv_prefill: Any) -> None:
    import torch

    class BrokenPool:
        def set_kv_buffer(self, *a: Any, **kw: Any) -> None:
            raise RuntimeError("SGLang changed")

    BrokenPool.__name__ = "MHATokenToKVPool"
    worker = draft_worker(eagle3(), BrokenPool(), steps=0)
    batch, hidden, sampled = prefill_batch()
    seen: list[Any] = []
    with torch.inference_mode():
        out = off_switch.draft_prefill_hook(lambda w, b, *a: seen.append(b.input_ids.tolist()) or "sglang", worker, batch, hidden, sampled)
    assert out == "sglang" and seen == [[11, 12, 13, 14, 21, 31, 32, 33]]  # SGLang rotates the ids itself
    assert getattr(worker, off_switch.PREFILL_OFF_MARK) and off_switch.COUNTERS.errors == 1
    assert off_switch.draft_prefill_hook(lambda *a, **k: "again", worker, *prefill_batch()) == "again"


@pytest.mark.parametrize(("shift", "identical"), [(0.0, 1), (0.25, 0)], ids=["same", "shifted"])
def test_the_kv_prefill_check_compares_with_sglangs_extend(eagle3: Any, kv_prefill: Any, monkeypatch: pytest.MonkeyPatch, shift: float, identical: int) -> None:
    import torch

    monkeypatch.setattr(off_switch, "_CHECK", SimpleNamespace(steps=0, batches=0, prefills=1))
    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    layer_id = model.model.layers[0].self_attn.attn.layer_id

    def sglang(w: Any, batch: Any, hidden: Any, sampled: Any) -> str:  # its extend, maybe off by `shift`
        ids, positions = sglang_prefill_inputs(batch, sampled)
        off_switch.draft_kv_only(model, pool, ids, positions, hidden, batch.out_cache_loc)
        pool.get_kv_buffer(layer_id)[0][batch.out_cache_loc] += shift
        return "sglang's proposal"

    with torch.inference_mode():
        assert off_switch.draft_prefill_hook(sglang, worker, *prefill_batch()) == "sglang's proposal"
        assert off_switch.draft_prefill_hook(sglang, worker, *prefill_batch()) != "sglang's proposal"  # checked once
    c = off_switch.COUNTERS
    assert (c.kv_prefills, c.kv_prefill_checked, c.kv_prefill_identical) == (2, 1, identical)
    assert c.kv_prefill_max_d == pytest.approx(shift)


def test_a_failing_step_still_stores_what_earlier_steps_owe(eagle3: Any, defer: Any) -> None:
    import torch

    model = eagle3()
    pool = pool_for(model)
    worker = draft_worker(model, pool, steps=0)
    steps = steps_of(3)
    steps[2][1].logits_output.hidden_states = torch.randn(3, 100)  # hidden states of another width
    sglang = SGLangExtend()
    with torch.inference_mode():
        for batch, result in steps:
            off_switch.draft_extend_hook(sglang, worker, batch, result)
    assert sglang.calls == 1 and getattr(worker, off_switch.KV_VERDICT_MARK) == "the update failed"
    layer_id = model.model.layers[0].self_attn.attn.layer_id
    ref = stored_at_once(model, steps[:2])  # the two steps before it were stored, not dropped
    for got, want in zip(pool.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_counters_are_logged_when_they_change_at_most_every_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``log_counters_if_changed``: nothing while depth 0 never ran; then one line per change,
    none within ``COUNTERS_LOG_S`` of the last one, none while nothing changed."""
    monkeypatch.setattr(off_switch, "COUNTERS", off_switch.OffCounters())
    monkeypatch.setattr(off_switch, "_COUNTERS_LOG", SimpleNamespace(last=None, at=-off_switch.COUNTERS_LOG_S))
    caplog.set_level(logging.INFO, logger="sglang_hook")
    assert not off_switch.log_counters_if_changed(now=100.0)  # all 0: a server without depth 0
    off_switch.COUNTERS.plain_steps, off_switch.COUNTERS.graph_steps = 7, 6
    assert off_switch.log_counters_if_changed(now=101.0)
    assert "7 depth-0 steps as plain decodes (6 through a CUDA graph)" in caplog.text
    assert not off_switch.log_counters_if_changed(now=200.0)  # unchanged
    off_switch.COUNTERS.verify_fallbacks = 1
    assert not off_switch.log_counters_if_changed(now=101.0 + off_switch.COUNTERS_LOG_S / 2)  # too soon
    assert off_switch.log_counters_if_changed(now=101.0 + off_switch.COUNTERS_LOG_S)
    assert "1 as SGLang's verify" in caplog.text
