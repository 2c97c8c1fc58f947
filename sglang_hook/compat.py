"""Everything the hook knows about SGLang's internals, and the 0.5.17 / 0.5.23 differences.

The hook patches a handful of SGLang names and reads a handful of attributes. They are all
listed here, in :data:`CONTRACT`, with the signature the hook relies on; the contract test
checks every entry against the installed SGLang (and, statically, against another version's
source tree). Differences between the two supported versions:

========================================  ==============================  ==============================
what                                      0.5.17                          0.5.23
========================================  ==============================  ==============================
``AdaptiveController.__init__``           ``(worker, config_path=None)``  ``(worker, policy)``
                                          builds its own params           params passed in
``_broadcast_reqs_across_ranks``          ``(recv_reqs)``                 ``(recv_reqs, local_reqs=None)``
server-args resolution                    in ``prepare_server_args``      ``ServerArgs.resolve_once()``
``adaptive_unsupported_reason``           reads raw server args           reads the resolving view
========================================  ==============================  ==============================

Every function here is cheap and never raises into SGLang for a missing optional attribute:
it returns a neutral value instead (the caller counts it).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SUPPORTED_VERSIONS = ("0.5.17", "0.5.23")

# Patched targets (dotted paths as SGLang's HookRegistry resolves them).
ADAPTIVE_CONTROLLER = "sglang.srt.speculative.adaptive_runtime_state.AdaptiveController"
ADAPTIVE_CONTROLLER_INIT = ADAPTIVE_CONTROLLER + ".__init__"
BROADCAST_REQS = (
    "sglang.srt.managers.scheduler_components.request_receiver."
    "SchedulerRequestReceiver._broadcast_reqs_across_ranks"
)
PROCESS_BATCH_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
FORWARD_MODE = "sglang.srt.model_executor.forward_batch_info.ForwardMode"
MAYBE_DISABLE_ADAPTIVE = "sglang.srt.arg_groups.speculative_hook._maybe_disable_adaptive"


@dataclass(frozen=True, slots=True)
class Target:
    """One SGLang name the hook depends on.

    Attributes:
        path: dotted path, ``module.Class.attr`` or ``module.func``.
        params: the leading parameter names the hook relies on (``()`` = not callable-checked).
        kind: ``call`` (function/method), ``attr`` (property or method presence) or ``field``
            (a dataclass field / class annotation).
        why: what the hook does with it.
    """

    path: str
    params: tuple[str, ...] = ()
    kind: str = "call"
    why: str = ""


CONTRACT: tuple[Target, ...] = (
    Target(ADAPTIVE_CONTROLLER_INIT, ("self", "worker"), why="patched: wraps .params"),
    Target(ADAPTIVE_CONTROLLER + ".activate_step_by_batch", ("self", "batch_size"), why="calls params"),
    Target(
        ADAPTIVE_CONTROLLER + ".on_verify_complete",
        ("self", "num_correct_drafts_per_req", "batch_size"),
        why="calls params",
    ),
    Target(
        "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.get_steps_for_batch",
        ("self", "batch_size"),
        why="answered by the actuator",
    ),
    Target(
        "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.on_verify_complete",
        ("self", "num_correct_drafts_per_req", "batch_size"),
        why="delegated, result gated",
    ),
    Target(
        "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.set_cuda_graph_bs",
        ("self", "cuda_graph_bs"),
        why="delegated",
    ),
    Target(
        "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.cuda_graph_bs_for_step",
        ("self", "step"),
        why="delegated",
    ),
    Target(
        "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.candidate_steps",
        kind="attr",
        why="delegated; validates decisions",
    ),
    Target(BROADCAST_REQS, ("self", "recv_reqs"), why="patched: the decision rides the TP broadcast"),
    Target(PROCESS_BATCH_RESULT, ("self", "batch", "result"), why="patched: one step record per decode"),
    Target(ON_IDLE, ("self",), why="patched: step_us restarts after idle"),
    Target(MAYBE_DISABLE_ADAPTIVE, ("server_args",), why="launcher: refuse instead of silently disabling"),
    Target(
        "sglang.srt.speculative.adaptive_spec_params.adaptive_unsupported_reason",
        ("server_args",),
        why="launcher: SGLang's own refusal reason",
    ),
    Target("sglang.srt.server_args.prepare_server_args", ("argv",), why="launcher"),
    Target("sglang.launch_server.run_server", ("server_args",), why="launcher"),
    Target("sglang.srt.plugins.hook_registry.HookRegistry.register", ("cls", "target", "hook"), why="plugin"),
    Target("sglang.srt.runtime_context.get_parallel", (), why="tp/dp/pp ranks"),
    Target(FORWARD_MODE + ".DECODE", kind="attr", why="the step record: decode batches"),
    Target(FORWARD_MODE + ".is_extend", kind="attr", why="the step record: prefill tokens"),
    Target("sglang.srt.managers.utils.GenerationBatchResult.num_correct_drafts_per_req_cpu", kind="field"),
    Target("sglang.srt.managers.utils.GenerationBatchResult.speculative_num_draft_tokens", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.forward_mode", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.reqs", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.seq_lens_cpu", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.seq_lens_sum", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.extend_num_tokens", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.launch_ts", kind="field"),
    Target("sglang.srt.managers.schedule_batch.Req.seqlen", kind="attr", why="ctx_tokens without seq_lens_cpu"),
    # The off switch (sglang_hook.off_switch): depth 0 as a plain decode.
    Target(
        "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.build_adaptive_runtime_state",
        ("self", "speculative_num_steps", "speculative_num_draft_tokens"),
        why="off switch: wrapped, the depth-0 state gets plain decode graphs",
    ),
    Target(
        "sglang.srt.speculative.eagle_worker_v2.DecodeCudaGraphRunner",
        kind="attr",
        why="off switch: the name build_adaptive_runtime_state constructs, swapped for depth 0",
    ),
    Target(
        "sglang.srt.speculative.eagle_worker_common.eagle_prepare_for_verify",
        ("verify_input", "req_to_token_pool", "batch", "target_worker"),
        why="off switch: wrapped, a depth-0 step becomes a DECODE forward batch",
    ),
    Target(
        "sglang.srt.speculative.eagle_worker_common.run_eagle_verify",
        ("batch",),
        why="off switch: calls eagle_prepare_for_verify by its module name",
    ),
    Target(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.__init__",
        ("self", "model_runner"),
        why="off switch: subclassed, built with attn_backend and speculative_num_* keywords",
    ),
    Target(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph",
        ("self", "forward_batch"),
        why="off switch",
    ),
    Target(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.load_batch",
        ("self", "forward_batch"),
        why="off switch",
    ),
    Target(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        ("cls", "batch", "model_runner"),
        why="off switch: builds the DECODE forward batch",
    ),
    Target("sglang.srt.model_executor.forward_batch_info.ForwardBatch.mark_forward_metadata_ready", ("self",)),
    Target("sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode.FULL", kind="attr", why="off switch"),
    Target("sglang.srt.speculative.spec_info.SpeculativeAlgorithm.NONE", kind="attr", why="off switch"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.orig_seq_lens", kind="field", why="off switch"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.spec_info", kind="field", why="off switch"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.seq_lens", kind="field", why="off switch"),
    Target(
        "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner.resolve_num_tokens_per_req",
        kind="attr",
        why="wrapped: each depth's draft-extend graphs at that depth's width",
    ),
    Target("sglang.srt.speculative.spec_utils.resolve_num_tokens_per_req", why="called with phase= by keyword"),
    Target("sglang.srt.runtime_context.get_spec", (), why="the depth being captured"),
    # The off switch's ``kv`` mode: the drafter's keys and values only at depth 0.
    Target(
        "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode",
        ("self", "batch", "batch_result"),
        why="off switch kv: wrapped; at depth 0 the KV-only update stands in for it",
    ),
    Target(
        "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft",
        ("self", "batch"),
        why="off switch kv: wrapped; depth 0's owed drafter updates are stored before a draft",
    ),
    Target(
        "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill",
        ("self", "batch", "target_hidden_states", "next_token_ids"),
        why="off switch kv: wrapped; depth 0's owed drafter updates are stored before a prefill's",
    ),
    Target(
        "sglang.srt.speculative.eagle_worker_common.prepare_for_draft_extend",
        ("draft_extend_input", "batch", "predict", "num_draft_tokens", "draft_model_runner", "cuda_graph_runner"),
        why="off switch kv: kv_step_inputs makes its one-token-per-request inputs the same way",
    ),
    Target(
        "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2._stub_skipped_draft_extend",
        ("self", "batch", "batch_output"),
        why="off switch kv: stub_proposal runs it (reads topk, device, draft_worker)",
    ),
    Target("sglang.srt.managers.utils.GenerationBatchResult.next_token_ids", kind="field"),
    Target("sglang.srt.managers.utils.GenerationBatchResult.logits_output", kind="field"),
    Target("sglang.srt.managers.utils.GenerationBatchResult.next_draft_input", kind="field"),
    Target("sglang.srt.speculative.eagle_info.EagleDraftInput.topk_p", kind="field"),
    Target("sglang.srt.speculative.eagle_info.EagleDraftInput.topk_index", kind="field"),
    Target("sglang.srt.speculative.eagle_info.EagleDraftInput.hidden_states", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.out_cache_loc", kind="field"),
    # the off switch's KV-only drafter extend of a depth-0 prefill
    Target(
        "sglang.srt.speculative.eagle_utils._eagle_prefill_tail_tokens",
        ("batch", "next_token_ids"),
        why="off switch kv prefill: each request's tail token, chunked prefill included",
    ),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.extend_lens", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.prefix_lens", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.input_ids", kind="field"),
    Target("sglang.srt.speculative.eagle_info.EagleDraftInput.bonus_tokens", kind="field"),
    Target("sglang.srt.speculative.eagle_info.EagleDraftInput.num_tokens_per_req", kind="field"),
    Target("sglang.srt.speculative.eagle_info.EagleDraftExtendInput.hidden_states", kind="field"),
    Target("sglang.srt.managers.schedule_batch.ScheduleBatch.seq_lens", kind="field"),
    Target(
        "sglang.srt.models.llama.LlamaAttention.forward_prepare_native",
        ("self", "positions", "hidden_states"),
        why="off switch kv: the drafter layer's qkv projection and RoPE",
    ),
    Target("sglang.srt.models.llama_eagle3.LlamaModel.forward", ("self", "input_ids", "positions", "forward_batch"),
           why="off switch kv: draft_kv_only repeats its steps up to the attention"),  # fmt: skip
    Target(
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer",
        ("self", "layer", "loc_info", "cache_k", "cache_v"),
        why="off switch kv: the write the attention backends make",
    ),
    Target("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.get_kv_buffer", ("self", "layer_id"), why="kv check"),
    Target("sglang.srt.layers.logits_processor.LogitsProcessorOutput.hidden_states", kind="field"),
)


# --------------------------------------------------------------------------- resolution


def resolve(path: str) -> Any:
    """Import ``path`` (``module[.Class].attr``) and return the object, or raise ``LookupError``."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if isinstance(obj, type):
                # Class attributes, including dataclass fields that only exist as annotations.
                found = False
                for klass in obj.__mro__:
                    if name in vars(klass):
                        obj = vars(klass)[name]
                        found = True
                        break
                    if name in getattr(klass, "__annotations__", {}):
                        obj = klass.__annotations__[name]
                        found = True
                        break
                if not found:
                    raise LookupError(f"{path}: {name!r} not found")
            else:
                if not hasattr(obj, name):
                    raise LookupError(f"{path}: {name!r} not found")
                obj = getattr(obj, name)
        return obj
    raise LookupError(f"{path}: module not importable")


def check_target(target: Target) -> str | None:
    """Return why ``target`` does not match the installed SGLang, or ``None`` when it does."""
    try:
        obj = resolve(target.path)
    except LookupError as exc:
        return str(exc)
    if target.kind != "call" or not target.params:
        return None
    func = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    func = inspect.unwrap(func)
    try:
        names = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return f"{target.path}: not introspectable"
    if target.params[0] == "cls" and names[:1] != ("cls",):
        names = ("cls", *names)  # bound classmethod drops cls
    if names[: len(target.params)] != target.params:
        return f"{target.path}: expected parameters {target.params}, found {names}"
    return None


def check_contract(targets: Sequence[Target] = CONTRACT) -> list[str]:
    """All mismatches between :data:`CONTRACT` and the installed SGLang (empty = all good)."""
    return [problem for t in targets if (problem := check_target(t)) is not None]


# --------------------------------------------------------------------------- version helpers


def sglang_version() -> str:
    """The installed SGLang version string."""
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def new_adaptive_controller(worker: Any, cfg_path: str | None) -> Any:
    """Build SGLang's real ``AdaptiveController`` with its own default params, in either version."""
    from sglang.srt.speculative import adaptive_runtime_state as ars

    params = inspect.signature(ars.AdaptiveController.__init__).parameters
    if "policy" in params:  # 0.5.23: the caller builds the policy
        from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

        policy = AdaptiveSpeculativeParams(initial_steps=worker.speculative_num_steps, cfg_path=cfg_path)
        return ars.AdaptiveController(worker, policy)
    return ars.AdaptiveController(worker, config_path=cfg_path)  # 0.5.17


def resolve_server_args(server_args: Any) -> None:
    """Run SGLang's argument resolution now (0.5.23 defers it to ``run_server``; idempotent)."""
    resolve_once = getattr(server_args, "resolve_once", None)
    if callable(resolve_once):
        resolve_once()


def resolved_arg(server_args: Any, name: str) -> Any:
    """A server argument after SGLang's resolution (0.5.23 keeps resolutions in a view)."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view

        return getattr(resolved_view(server_args), name)
    except Exception:  # no view in this version, or not resolved yet
        return getattr(server_args, name, None)


def single_rank(server_args: Any) -> bool:
    """Whether each replica's scheduler is one process: TP size 1 and PP size 1."""
    tp = resolved_arg(server_args, "tp_size")
    pp = resolved_arg(server_args, "pp_size")
    return (tp is None or int(tp) == 1) and (pp is None or int(pp) == 1)


@dataclass(frozen=True, slots=True)
class Ranks:
    """Where this scheduler process sits. Entry rank = ``tp_rank == 0 and pp_rank == 0``."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int | None = None

    @property
    def is_entry(self) -> bool:
        return self.tp_rank == 0 and self.pp_rank == 0


def ranks() -> Ranks:
    """This process's ranks, read from SGLang's published parallel context."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()

    def read(name: str, default: Any) -> Any:
        try:
            value = getattr(par, name)
        except Exception:  # unpublished leaves raise AttributeError/ValueError by version
            return default
        return default if value is None else value

    return Ranks(
        tp_rank=int(read("tp_rank", 0)),
        tp_size=int(read("tp_size", 1)),
        pp_rank=int(read("pp_rank", 0)),
        pp_size=int(read("pp_size", 1)),
        dp_rank=read("dp_rank", None),
    )


def kv_usage(scheduler: Any) -> float:
    """Fraction of the KV pool held by requests (evictable prefix cache counts as free)."""
    total = scheduler.max_total_num_tokens
    used = (
        total - scheduler.token_to_kv_pool_allocator.available_size() - scheduler.tree_cache.evictable_size()
    )
    usage = used / total if total > 0 else 0.0
    return 0.0 if usage < 0.0 else 1.0 if usage > 1.0 else float(usage)


def decode_mode() -> Any:
    """SGLang's ``ForwardMode.DECODE``: ``mode == decode_mode()`` is ``mode.is_decode()`` without its call."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode.DECODE


def ctx_total(source: Any) -> int:
    """Sum of the sequence lengths: an int SGLang summed, its ``seq_lens_cpu`` tensor, or the
    batch's list of requests (each ``Req.seqlen``), summed now."""
    if type(source) is int:
        return source
    if type(source) is list:
        return sum(req.seqlen for req in source)
    return sum(source.tolist())  # a torch reduction costs several µs more for a small batch


def clamp_accept(per_req: Sequence[int], depth: int) -> list[int]:
    """Accepted drafts per request as the protocol wants them: ints in ``0..depth``."""
    return [0 if a < 0 else depth if a > depth else int(a) for a in per_req]
