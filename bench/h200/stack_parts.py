"""Where a scheduler's time per output token goes, by part of SGLang's loop, server beside server.

Reads the scheduler windows that ``offswitch.py --sample`` took (``stacksample``: one
``<server>.json.gz`` per server under ``--windows``) and each window's load rate from the
call's stack summaries (``--summary``: ``{"stacks": {"<server>@c<C>": {"tok_s": ...}}}``),
and prints the scheduler main thread's µs per output token in each part of :data:`PARTS`.
A part is the samples whose stack has every frame of ``must`` and none of ``skip``, so parts
may nest (the rows are not a partition).

Run: ``python bench/h200/stack_parts.py --windows bench/results/realgpu/offswitch/stacks-g
--summary bench/results/realgpu/offswitch/stacks-c64-g.json``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import offswitch  # noqa: E402  (the windows' reader)

SYNC = "torch/cuda/streams.py:synchronize"
PREFILL_GRAPH = "prefill_cuda_graph_runner.py:execute"
DRAFT_PREFILL = ("_draft_extend_for_prefill", "draft_prefill_hook")
# (label, frames the stack must have, frames it must not have)
PARTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("all", (), ()),
    ("waiting for the GPU (stream synchronize)", (SYNC,), ()),
    ("work: all but waiting for the GPU", (), (SYNC,)),
    ("the target's prefill (prefill graph runner, not the drafter's)", (PREFILL_GRAPH,), DRAFT_PREFILL),
    ("the drafter's extend of admitted prompts (hook's prefill wrapper)", ("draft_prefill_hook",), ()),
    ("  of which the hook's KV-only prefill inputs", ("prefill_inputs",), ()),
    ("a depth-0 step: SGLang's verify (hook's plain decode inside)", ("eagle_worker_v2.py:verify",), ()),
    ("  the hook's prepare (plain decode batch)", ("prepare_verify_hook",), ()),
    ("  the hook's KV-only update", ("draft_extend_hook",), ()),
    ("  the hook's owed flushes", ("flush_kv",), ()),
    ("the decode forward outside verify (plain: the decode step)", ("tp_worker.py:forward_batch_generation",), (PREFILL_GRAPH,)),
    ("preparing the next decode (prepare_for_decode)", ("prepare_for_decode",), ()),
    ("processing a decode result, not waiting", ("process_batch_result_decode",), (SYNC,)),
    ("choosing the next batch (get_next_batch_to_run)", ("get_next_batch_to_run",), ()),
    ("the event loop's own lines", ("event_loop_overlap:",), ("run_batch", "get_next_batch_to_run", "process_batch_result", "pop_and_process")),
)  # fmt: skip


def parts(stacks: dict[str, int], tok_s: float) -> list[float]:
    """µs per output token of each of :data:`PARTS` (``stacks``: microseconds per stack)."""
    total = sum(stacks.values())
    out = []
    for _, must, skip in PARTS:
        us = sum(v for k, v in stacks.items() if all(m in k for m in must) and not any(m in k for m in skip))
        out.append(us / total * 1e6 / tok_s if total and tok_s > 0 else 0.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=Path, required=True, help="folder of <server>.json.gz scheduler windows")
    ap.add_argument("--summary", type=Path, required=True, help="the call's stack summaries (tok_s per server)")
    ap.add_argument("--conc", type=int, default=64)
    a = ap.parse_args()
    summary = json.loads(a.summary.read_text())["stacks"]
    files = sorted(a.windows.glob("*.json.gz"))
    if not files:
        ap.error(f"no <server>.json.gz under {a.windows}")
    cols: list[tuple[str, list[float]]] = []
    for path in files:
        label = path.name.removesuffix(".json.gz")
        key = f"{label}@c{a.conc}"
        if key not in summary:
            ap.error(f"{key} is not in {a.summary}")
        _, stacks = offswitch.scheduler_windows([path])
        cols.append((label, parts(stacks, float(summary[key]["tok_s"]))))
    print("| part (µs per output token) | " + " | ".join(label for label, _ in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for i, (name, _, _) in enumerate(PARTS):
        print(f"| {name} | " + " | ".join(f"{v[i]:.1f}" for _, v in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
