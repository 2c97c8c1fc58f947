"""``controller demo``: a served policy steering the simulator end to end; each run records apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.cli import main


@pytest.mark.slow
def test_each_demo_run_records_and_summarizes_only_its_own_trace(tmp_path: Path, capsys) -> None:
    outputs = []
    for _ in range(2):
        rc = main(
            ["demo", "--policy", "builtin:sglang-adaptive", "--duration-s", "2", "--record", str(tmp_path)]
        )
        outputs.append(capsys.readouterr().out)
        assert rc == 0, outputs[-1]
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(runs) == 2 and not any(p.is_file() for p in tmp_path.iterdir())
    for run, out in zip(runs, outputs, strict=True):
        assert len(list(run.glob("*.msgpack"))) == 1  # one controller session, one trace file
        assert f"recording to {run}/" in out
        assert f"{run}: 1 file(s)" in out  # the summary read this run's folder alone
        assert "parity: the in-process replay picked the served decisions at 100.0%" in out
