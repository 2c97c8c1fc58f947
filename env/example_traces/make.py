"""Regenerate the bundled example traces: ``python -m env.example_traces.make``.

These traces are SIMULATED: the simulator (``env.engine``) running a bundled deployment,
recorded with ``controller.traces.TraceWriter`` exactly as the live controller records a
hook (``hello``, each ``step``, each ``decision``, plus ``rx_ns``). They exist so that
``controller fit --traces`` and ``controller train --traces`` work out of the box; they are
not measurements of any server.

The depth schedule cycles through every allowed depth in blocks of 40 steps, so every depth
is seen at every load (what a fit needs); workloads span light to saturated load.
"""

from __future__ import annotations

import gzip
import shutil
from dataclasses import replace
from pathlib import Path

from controller.protocol import DEFAULT_DEPTHS as DEPTHS
from controller.protocol import Decision, Hello
from controller.traces import TraceWriter
from env.deployments import load_deployment
from env.engine import Engine

HERE = Path(__file__).resolve().parent
RUNS = {
    "h200-llama8b": [("closed:4", 1200), ("closed:32", 1500), ("poisson:12", 1500), ("closed:128", 800)],
    "seed": [("closed:1", 1200), ("closed:8", 1200), ("closed:48", 800)],
}
START_NS = 1_767_225_600_000_000_000  # a fixed wall clock so regenerating gives identical files


def make(deployment: str, seed: int = 0) -> Path:
    params = load_deployment(deployment)
    folder = HERE / deployment
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for i, (workload, n_steps) in enumerate(RUNS[deployment]):
        instance = f"{deployment}-sim-{workload.replace(':', '')}"
        eng = Engine(replace(params, engine=replace(params.engine, instance=instance)), workload)
        eng.reset(seed + i)
        hello = Hello(
            instance=instance, depths=DEPTHS, engine="specdepth-sim (simulated)", model=deployment, tp=1
        )
        with TraceWriter(folder, instance, start_ns=START_NS + i, flush_bytes=1 << 16) as w:
            w.write(hello.to_wire(), eng.start_ns)
            for k in range(n_steps):
                depth = DEPTHS[(k // 40) % len(DEPTHS)]
                rec = eng.step(depth)
                rx = rec.ts_ns + 50_000  # 50 µs transport
                w.write(rec.to_wire(), rx)
                nxt = DEPTHS[((k + 1) // 40) % len(DEPTHS)]
                w.write(Decision(instance=instance, seq=rec.seq, depth=nxt).to_wire(), rx + 20_000)
        gzip_in_place(w.path)
    return folder


def gzip_in_place(path: Path) -> Path:
    """``path`` → ``path.gz`` (mtime 0: regenerating gives identical bytes); readers take both."""
    out = path.with_name(path.name + ".gz")
    with path.open("rb") as src, gzip.GzipFile(out, "wb", 9, mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return out


def main() -> None:
    for name in RUNS:
        folder = make(name)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"wrote {folder} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
