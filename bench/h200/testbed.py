"""The realistic acceptance testbed: task families, the target's permutation, the drafter's map.

Nothing can be downloaded on the device, so the testbed's models are built from random numbers
(``build_models.py --testbed``). What makes them realistic is defined here, as plain data shared
by the model builder, the load generator and the analysis:

* **The target** continues greedily with ``PI[t]`` after token ``t``: a fixed random
  permutation of each family's token range, so outputs vary token by token and stay inside the
  family of their prompt. Verification does real work.
* **The drafter** proposes ``DRAFT[t]`` after ``t``. For a fraction ``q`` of each family's tokens
  (the "good" ones, drawn at random) that is ``PI[t]``; for the others it is ``PI[rho(t)]``, a
  wrong token (``rho`` is a derangement of the family's bad tokens, so ``DRAFT`` stays a
  permutation and every row of the drafter's LM head is one token's embedding).
* A request lives in one family (its prompt's tokens are drawn from the family's range), and its
  tokens walk the permutation's cycle, so each draft position is accepted with probability
  about ``q`` given the one before it: acceptance is per position, per request, by task.

Families, calibrated to ``shared/reference/acceptance.md`` (a constant per-position rate ``q``
gives accepted length ``(1 - q**(k+1)) / (1 - q)`` at depth ``k``):

=======  ==========  =====  ==========================================================
family   tokens      q      target
=======  ==========  =====  ==========================================================
chat     3-11999     0.72   MT-bench, k=3: accepted length 2.60, per position .73/.71/.68
code     12000-21999 0.74   HumanEval/GSM8K-like, k=7: accepted length 3.4-3.5
docs     22000-31999 0.065  long documents: 5-8% acceptance
=======  ==========  =====  ==========================================================

What this construction cannot give: per-position rates that fall with depth inside one request
(0.73 -> 0.68 in the reference; here each request's rate is flat, about ``q``), and acceptance
that falls with context length (the drafter attends to its own position only).

Stdlib only: it runs under the device image's python3 before the carried packages are unpacked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = 32000
FIRST = 3  # 0-2 are special (bos, eos, pad): the permutation leaves them alone


@dataclass(frozen=True)
class Family:
    """A task family: a token range ``[lo, hi)`` and its drafter's per-position acceptance."""

    name: str
    lo: int
    hi: int
    q: float
    target: str  # the published figure it is calibrated to

    def accepted_length(self, depth: int) -> float:
        """Expected tokens per verify step at ``depth`` (bonus included), for a flat rate ``q``."""
        return sum(self.q**i for i in range(depth + 1))


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("chat", FIRST, 12000, 0.72, "MT-bench k=3: accepted length 2.60; per position 0.73/0.71/0.68"),
        Family("code", 12000, 22000, 0.74, "HumanEval/GSM8K k=7: accepted length 3.4-3.5"),
        Family("docs", 22000, VOCAB, 0.065, "long documents: 5-8% acceptance"),
    )
}


def family_of(token: int) -> Family | None:
    for f in FAMILIES.values():
        if f.lo <= token < f.hi:
            return f
    return None


def maps(seed: int = 0) -> tuple[list[int], list[int], list[bool]]:
    """``(PI, DRAFT, good)``: the target's next token, the drafter's proposal, and which tokens are good.

    Deterministic in ``seed``; each family's range is permuted within itself.
    """
    rng = random.Random(seed)
    pi = list(range(VOCAB))
    draft = list(range(VOCAB))
    good = [True] * VOCAB
    for f in FAMILIES.values():
        ids = list(range(f.lo, f.hi))
        img = ids[:]
        rng.shuffle(img)
        for t, u in zip(ids, img):
            pi[t] = u
        bad = [t for t in ids if rng.random() >= f.q]
        for t in bad:
            good[t] = False
        for t in ids:
            draft[t] = pi[t]
        if len(bad) >= 2:
            rng.shuffle(bad)
            for i, t in enumerate(bad):  # a cyclic shift of a shuffled list: no fixed point
                draft[t] = pi[bad[(i + 1) % len(bad)]]
    return pi, draft, good


def inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for t, u in enumerate(perm):
        inv[u] = t
    return inv


def prompt(rng: random.Random, family: str, length: int) -> list[int]:
    """``length`` random tokens from ``family``'s range (``""``: anywhere but the specials)."""
    if not family:
        return [rng.randrange(FIRST, VOCAB) for _ in range(length)]
    f = FAMILIES[family]
    return [rng.randrange(f.lo, f.hi) for _ in range(length)]
