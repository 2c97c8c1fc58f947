"""With the off switch's resume loss (the first drafted step after depth 0 accepts nothing) a
policy that reads that step as evidence sees every probe fail. ``bench/resume_evidence.py``
prints the table; here 2 seeds at 4 requests check the mechanism, Featurizer version 7's
answer to it, and the hook's warm resume, which removes it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import resume_evidence  # noqa: E402

from env.deployments import load_deployment  # noqa: E402


def test_a_resume_read_as_evidence_keeps_goodput_off_and_version_7_drafts_again() -> None:
    (_, base), (_, lossy), (_, warm) = resume_evidence.worlds(load_deployment("h200-llama8b"))

    def tok(params: object, spec: str, version: int | None = None) -> float:
        return resume_evidence.run(params, spec, version, 4, 1, 2)  # C = 4, decided one step late

    s0, s3 = tok(base, "builtin:static:0"), tok(base, "builtin:static:3")
    assert s3 > 1.4 * s0  # at 4 requests drafting pays
    # Without the loss both versions find it.
    assert tok(base, "builtin:goodput", 5) > 0.95 * s3
    assert tok(base, "builtin:goodput", 7) > 0.95 * s3
    # With it, version 5 reads each probe's zeros and stays at depth 0; version 7 does not.
    assert tok(lossy, "builtin:goodput", 5) < 1.05 * s0
    assert tok(lossy, "builtin:goodput", 7) > 0.93 * s3
    # Resumed warm (the hook's default), nothing is lost: version 5 drafts again too.
    assert tok(warm, "builtin:goodput", 5) > 0.93 * s3
