"""A diagnostic controller that answers every step with a scripted depth, and logs what it hears.

Not a policy: a labelled instrument for the H200 benchmarks. It speaks protocol v1 through the
project's own protocol module, so the hook sees exactly what ``controller serve`` would send.

Schedules (``--schedule``), indexed by the number of steps the instance has sent:
  static:K               always K
  alternate:A,B          A, B, A, B, ... (a switch at every step: the cost of switching)
  phases:K1xN1,K2xN2,... K1 for N1 steps, then K2 for N2 steps, ...; the last phase repeats
                         (a last phase written as a bare K holds K)
  file:PATH              the schedule written in PATH (any of the above), re-read when the file
                         changes; each change restarts the step count, so a benchmark switches
                         policies between points without restarting this process

Each step is appended to ``--record`` (JSON lines: seq, depth, bs, accept, step_us), so a
benchmark can read acceptance around a switch from the hook's own telemetry.

Usage: python3 bench/h200/scripted_controller.py --bind ipc:///tmp/x.sock --schedule alternate:0,3
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controller.protocol import Decision, Error, Hello, ProtocolError, Step, Welcome, decode, encode  # noqa: E402


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """``(depth, steps)`` phases; steps 0 = forever. Raises ``ValueError`` for a bad schedule."""
    kind, _, arg = text.partition(":")
    if kind == "static":
        return [(int(arg), 0)]
    if kind == "alternate":
        a, b = (int(x) for x in arg.split(","))
        return [(a, 1), (b, 1)]
    if kind == "file":
        raise ValueError("file: schedules are read by the serving loop")
    if kind == "phases":
        out = []
        for part in arg.split(","):
            depth, _, n = part.partition("x")
            out.append((int(depth), int(n or 0)))  # a bare K: K from then on
        return out
    raise ValueError(f"unknown schedule {text!r}: static:K, alternate:A,B or phases:KxN,...")


def depth_at(phases: list[tuple[int, int]], i: int) -> int:
    """The depth for the ``i``-th step; ``alternate`` cycles, ``phases`` holds its last phase."""
    if len(phases) == 2 and all(n == 1 for _, n in phases):
        return phases[i % 2][0]
    for depth, n in phases:
        if n == 0 or i < n:
            return depth
        i -= n
    return phases[-1][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", required=True)
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()
    control = Path(args.schedule[5:]) if args.schedule.startswith("file:") else None
    tag, mtime = args.schedule, -1.0
    phases = [(0, 0)] if control else parse_schedule(args.schedule)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(args.bind)
    # Line-buffered: a benchmark reads the record while this process still serves.
    out = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115
    counts: dict[str, int] = {}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print(f"serving {args.schedule} on {args.bind}", flush=True)
    while not stop:
        if not sock.poll(100):
            continue
        ident, frame = sock.recv_multipart()
        try:
            msg = decode(frame)
        except ProtocolError:
            continue
        if isinstance(msg, Hello):
            counts[msg.instance] = 0
            sock.send_multipart([ident, encode(Welcome(policy=f"scripted:{args.schedule}", features=0))])
            print(f"hello from {msg.instance}", flush=True)
        elif isinstance(msg, Step):
            if control is not None and control.exists() and control.stat().st_mtime != mtime:
                mtime = control.stat().st_mtime
                try:
                    text = control.read_text().strip()
                    phases, tag = parse_schedule(text), text
                    counts = dict.fromkeys(counts, 0)
                except ValueError as exc:
                    print(f"bad schedule in {control}: {exc}", flush=True)
            if msg.instance not in counts:  # as controller serve does: the hook then says hello
                sock.send_multipart([ident, encode(Error(code="unknown_instance", msg=msg.instance))])
                continue
            i = counts[msg.instance]
            counts[msg.instance] = i + 1
            depth = depth_at(phases, i)
            sock.send_multipart([ident, encode(Decision(instance=msg.instance, seq=msg.seq, depth=depth))])
            if out is not None:
                rec = {"i": i, "seq": msg.seq, "depth": msg.depth, "bs": msg.bs, "accept": list(msg.accept),
                       "step_us": msg.step_us, "sent": depth, "tag": tag}  # fmt: skip
                out.write(json.dumps(rec) + "\n")
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
