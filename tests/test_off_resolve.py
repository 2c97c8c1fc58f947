"""The off switch's host lengths (``sglang_hook.off_resolve``): no wait before a step after depth 0.

What runs here is SGLang's real ``FutureMap`` (0.5.23 on this CPU), its ``publish`` and its
``resolve_seq_lens_cpu``, through the hook's wrappers. Only the CUDA side of the resolve is
stood in for: a stream whose ``synchronize`` is counted (the wait the hook exists to skip)
and a host mirror in place of the pinned buffer, which SGLang builds only on CUDA. Each
answer the hook gives is compared with the answer SGLang's own resolve gives for the same
batch.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from sglang.srt.managers import overlap_utils  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_hook import off_resolve  # noqa: E402

pytestmark = pytest.mark.sglang


class CountingStream:
    """The private D2H stream SGLang's resolve copies on, with its host wait counted."""

    def __init__(self) -> None:
        self.waits = 0

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        self.waits += 1


@pytest.fixture
def fm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's future map with the CUDA path's stream and mirror, and the hook on."""
    future_map = overlap_utils.FutureMap(
        torch.device("cpu"), SpeculativeAlgorithm.EAGLE3, SimpleNamespace(req_to_token=torch.zeros(64, 8))
    )
    future_map.fwd_prepare_d2h_stream = CountingStream()
    future_map.new_seq_lens_cpu_pinned = torch.empty(64, dtype=torch.int64)
    monkeypatch.setattr(off_resolve, "COUNTERS", off_resolve.ResolveCounters())
    monkeypatch.setattr(off_resolve, "LENS", off_resolve.HostLens())
    monkeypatch.setattr(off_resolve, "STATE", off_resolve._State(enabled=True))
    monkeypatch.setattr(off_resolve, "_logged", set())
    return future_map


def publish(future_map: Any, *args: Any) -> None:
    off_resolve.publish_hook(overlap_utils.FutureMap.publish, future_map, *args)


def resolve(future_map: Any, batch: Any) -> None:
    off_resolve.resolve_hook(overlap_utils.FutureMap.resolve_seq_lens_cpu, future_map, batch)


def batch_of(slots: list[int], lens: list[int] | None, mode: ForwardMode = ForwardMode.DECODE) -> Any:
    idx = torch.tensor(slots, dtype=torch.int64)
    cpu = None if lens is None else torch.tensor(lens, dtype=torch.int64)
    return SimpleNamespace(
        forward_mode=mode,
        is_extend_in_batch=False,
        req_pool_indices_cpu=idx,
        seq_lens_cpu=cpu,
        seq_lens=None if cpu is None else cpu.clone(),
        seq_lens_sum=None,
        spec_info=SimpleNamespace(future_indices=idx) if mode == ForwardMode.DECODE else None,
    )


def step(future_map: Any, batch: Any, accepted: int = 1, plain: bool = False, fail: bool = False) -> None:
    """One forward of the worker, as SGLang's scheduler drives it: the worker publishes what the
    step leaves (a prefill its lengths, a verify its lengths plus what it accepted)."""

    def worker_forward(worker: Any, b: Any) -> None:
        extend = b.forward_mode.is_extend()
        publish(future_map, b.req_pool_indices_cpu, b.seq_lens if extend else b.seq_lens + accepted)
        if plain:
            off_resolve.plain_step_ran()
        if fail:
            raise RuntimeError("the step failed")

    off_resolve.forward_hook(worker_forward, None, batch)


def sglangs_answer(future_map: Any, batch: Any) -> tuple[list[int], list[int], int]:
    """What SGLang's own resolve makes of ``batch`` (on a copy, with its wait)."""
    b = SimpleNamespace(**vars(batch))
    overlap_utils.FutureMap.resolve_seq_lens_cpu(future_map, b)
    return b.seq_lens.tolist(), b.seq_lens_cpu.tolist(), b.seq_lens_sum


def answer(batch: Any) -> tuple[list[int], list[int], int]:
    return batch.seq_lens.tolist(), batch.seq_lens_cpu.tolist(), batch.seq_lens_sum


def test_after_a_prefill_and_each_plain_step_the_host_answers_without_waiting(fm: Any) -> None:
    step(fm, batch_of([3, 5, 9], [10, 20, 30], ForwardMode.EXTEND))
    lens = [10, 20, 30]
    for _ in range(3):
        batch = batch_of([3, 5, 9], [0, 0, 0])  # the host lengths are stale until resolved
        want = sglangs_answer(fm, batch)
        waits = fm.fwd_prepare_d2h_stream.waits
        resolve(fm, batch)
        assert answer(batch) == want == (lens, lens, sum(lens))
        assert fm.fwd_prepare_d2h_stream.waits == waits  # no host wait
        step(fm, batch, plain=True)
        lens = [n + 1 for n in lens]
    assert off_resolve.COUNTERS.answered == 3 and off_resolve.COUNTERS.sglang == 0
    # A batch filtered and merged with a new prefill: the slots are answered each by its own.
    step(fm, batch_of([7], [100], ForwardMode.EXTEND))
    batch = batch_of([9, 7, 3], [0, 0, 0])
    want = sglangs_answer(fm, batch)
    resolve(fm, batch)
    assert answer(batch) == want == ([33, 100, 13], [33, 100, 13], 146)


def test_what_the_host_cannot_know_goes_to_sglangs_resolve(fm: Any) -> None:
    step(fm, batch_of([3, 5], [10, 20], ForwardMode.EXTEND))
    drafted = batch_of([3, 5], [10, 20])
    step(fm, drafted, accepted=3)  # a drafted step: lengths only the GPU knows
    batch = batch_of([3, 5], [0, 0])
    waits = fm.fwd_prepare_d2h_stream.waits
    resolve(fm, batch)
    assert answer(batch) == ([13, 23], [13, 23], 36) and fm.fwd_prepare_d2h_stream.waits == waits + 1
    step(fm, batch, plain=True)
    resolve(fm, again := batch_of([3, 5], [0, 0]))
    assert again.seq_lens_cpu.tolist() == [14, 24] and fm.fwd_prepare_d2h_stream.waits == waits + 1
    # A step that raised leaves nothing to answer from.
    with pytest.raises(RuntimeError):
        step(fm, again, plain=True, fail=True)
    resolve(fm, batch_of([3, 5], [0, 0]))
    assert fm.fwd_prepare_d2h_stream.waits == waits + 2
    # A publish the hook did not see the lengths of (PD disaggregation's) clears everything.
    step(fm, batch_of([3, 5], [30, 40], ForwardMode.EXTEND))
    publish(fm, torch.tensor([5]), torch.tensor([41]))
    resolve(fm, out := batch_of([3, 5], [0, 0]))
    assert out.seq_lens_cpu.tolist() == [30, 41] and fm.fwd_prepare_d2h_stream.waits == waits + 3
    assert off_resolve.COUNTERS.cleared == 1
    # A mixed batch (prefill with decode tails) is SGLang's to resolve after.
    step(fm, batch_of([3, 5], [50, 60], ForwardMode.MIXED))
    resolve(fm, batch_of([3, 5], [0, 0]))
    assert fm.fwd_prepare_d2h_stream.waits == waits + 4


def test_sglangs_debug_asserts_and_other_paths_keep_sglangs_resolve(fm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    step(fm, batch_of([3], [10], ForwardMode.EXTEND))
    monkeypatch.setattr(overlap_utils, "_DEBUG_ASSERT", True)
    fm._publish_fresh = True  # armed by the publish under the debug asserts
    resolve(fm, batch_of([3], [0]))
    assert fm.fwd_prepare_d2h_stream.waits == 1 and not fm._publish_fresh  # SGLang's consume-once ran
    monkeypatch.setattr(overlap_utils, "_DEBUG_ASSERT", False)
    fm.needs_cpu_seq_lens = False  # a backend without host lengths: SGLang's GPU-only path
    resolve(fm, b := batch_of([3], [0]))
    assert b.seq_lens_cpu is None and fm.fwd_prepare_d2h_stream.waits == 1
    fm.needs_cpu_seq_lens = True
    resolve(fm, b := batch_of([3], [0]))
    assert b.seq_lens_cpu.tolist() == [10] and off_resolve.COUNTERS.answered == 1
    off_resolve.STATE.enabled = False
    resolve(fm, b := batch_of([3], [0]))
    assert fm.fwd_prepare_d2h_stream.waits == 2


def test_the_check_compares_with_sglangs_and_turns_the_host_off_on_a_difference(
    fm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    off_resolve.STATE.check = 2
    step(fm, batch_of([3, 5], [10, 20], ForwardMode.EXTEND))
    resolve(fm, b := batch_of([3, 5], [0, 0]))
    assert b.seq_lens_cpu.tolist() == [10, 20] and off_resolve.COUNTERS.checked == 1
    assert off_resolve.COUNTERS.mismatches == 0 and off_resolve.STATE.enabled
    off_resolve.LENS.record(torch.tensor([5]), torch.tensor([99]))  # a host length gone wrong
    with caplog.at_level(logging.ERROR, logger="sglang_hook"):
        resolve(fm, b := batch_of([3, 5], [0, 0]))
    assert b.seq_lens_cpu.tolist() == [10, 20]  # SGLang's answer stands
    assert off_resolve.COUNTERS.mismatches == 1 and not off_resolve.STATE.enabled
    assert "host sequence lengths off" in caplog.text
    step(fm, b, plain=True)
    resolve(fm, batch_of([3, 5], [0, 0]))
    assert off_resolve.COUNTERS.answered == 0 and fm.fwd_prepare_d2h_stream.waits == 3


def test_install_registers_the_three_hooks_unless_sglangs_resolve_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(off_resolve, "STATE", off_resolve._State())
    for value, hooked in (("", True), ("sglang", False), ("host", True), ("fast", True)):
        got: list[tuple[str, Any]] = []
        monkeypatch.setenv(off_resolve.ENV_OFF_RESOLVE, value)
        monkeypatch.setenv(off_resolve.ENV_OFF_RESOLVE_CHECK, "5" if value == "host" else "x")
        with caplog.at_level(logging.WARNING, logger="sglang_hook"):
            off_resolve.install(lambda target, fn, got=got: got.append((target, fn)))
        assert (got == list(off_resolve.HOOKS)) is hooked and off_resolve.STATE.enabled is hooked
        assert off_resolve.STATE.check == (5 if value == "host" else 0)
    assert "'fast' is not host or sglang" in caplog.text


def test_host_lengths_grow_and_forget() -> None:
    lens = off_resolve.HostLens()
    assert lens.lookup(torch.tensor([1])) is None
    lens.record(torch.tensor([1, 300]), torch.tensor([5, 6]))
    assert lens.lookup(torch.tensor([300, 1])).tolist() == [6, 5]
    assert lens.lookup(torch.tensor([2])) is None and lens.lookup(torch.tensor([5000])) is None
    lens.forget(torch.tensor([300, 9000]))
    assert lens.lookup(torch.tensor([1, 300])) is None and lens.lookup(torch.tensor([1])).tolist() == [5]
