"""The H200 testbed's models do what ``bench/h200/testbed.py`` says, checked on CPU at the tiny shape.

The target is loaded by transformers' own Llama and decoded greedily. SGLang's EAGLE-3 drafter
cannot run on this machine (speculation needs a GPU), so the drafter is checked against a
forward pass written here from SGLang's ``llama_eagle3.py`` (one decoder layer: embeddings and
the fc'd target state concatenated into attention, RoPE, grouped-query causal attention, the
MLP, the final norm, ``norm_output``). The device run measures the real thing per family.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "h200"))

import testbed  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tb")
    subprocess.run(
        [sys.executable, str(ROOT / "bench/h200/build_models.py"), "--out", str(out), "--shape", "tiny",
         "--testbed", "--drafts", "tb", "--tokenizer", str(out / "none")],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def test_families_are_disjoint_and_calibrated() -> None:
    fams = list(testbed.FAMILIES.values())
    assert fams[0].lo == testbed.FIRST and fams[-1].hi == testbed.VOCAB
    assert all(a.hi == b.lo for a, b in zip(fams, fams[1:]))
    assert abs(testbed.FAMILIES["chat"].accepted_length(3) - 2.60) < 0.05
    assert 3.4 <= testbed.FAMILIES["code"].accepted_length(7) <= 3.55
    assert 0.05 <= testbed.FAMILIES["docs"].q <= 0.08


def test_maps_are_permutations_within_families() -> None:
    pi, draft, good = testbed.maps(0)
    assert sorted(pi) == list(range(testbed.VOCAB)) and sorted(draft) == list(range(testbed.VOCAB))
    for f in testbed.FAMILIES.values():
        ids = range(f.lo, f.hi)
        assert all(f.lo <= pi[t] < f.hi for t in ids)
        assert all((draft[t] == pi[t]) == good[t] for t in ids)  # wrong exactly on the bad tokens
        assert abs(sum(good[t] for t in ids) / len(ids) - f.q) < 0.02
    assert testbed.maps(0) == (pi, draft, good) and testbed.maps(1)[0] != pi


def test_target_continues_with_the_permutation(models: Path) -> None:
    pi, _, _ = testbed.maps(0)
    model = transformers.LlamaForCausalLM.from_pretrained(models / "target", torch_dtype=torch.float32)
    rng = random.Random(3)
    for family in testbed.FAMILIES:
        ids = testbed.prompt(rng, family, 48)
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
        want, t = [], ids[-1]
        for _ in range(8):
            t = pi[t]
            want.append(t)
        assert out == want, family


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def draft_forward(w: dict, cfg: dict, embed: torch.Tensor, ids: list[int], hidden: torch.Tensor) -> tuple:
    """SGLang's ``LlamaForCausalLMEagle3`` forward over one sequence: (logits, the next step's hidden)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    p = "layers.0."
    emb = embed[torch.tensor(ids)]
    if hidden.shape[-1] != h:
        hidden = hidden @ w["fc.weight"].T
    residual = hidden
    x = torch.cat([_rms(emb, w[p + "input_layernorm.weight"]), _rms(hidden, w[p + "hidden_norm.weight"])], -1)
    n = len(ids)
    pos = torch.arange(n)
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d), pos, cfg["rope_theta"])
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, d), pos, cfg["rope_theta"])
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
    residual = o + residual
    y = _rms(residual, w[p + "post_attention_layernorm.weight"])
    y = (
        torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
    ) @ w[p + "mlp.down_proj.weight"].T
    out = _rms(y + residual, w["norm.weight"])
    assert cfg.get("norm_output") is True  # the next step reads the normalized output
    return out @ w["lm_head.weight"].T, out


def test_draft_proposes_the_map_at_every_depth(models: Path) -> None:
    from safetensors.torch import load_file

    _, dmap, _ = testbed.maps(0)
    cfg = json.loads((models / "draft_tb" / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(models / "draft_tb" / "model-00001.safetensors")).items()}
    embed = load_file(str(models / "target" / "model-00001.safetensors"))["model.embed_tokens.weight"].float()
    rng = random.Random(5)
    ids = testbed.prompt(rng, "", 400)  # every family, 400 tokens of context
    aux = torch.randn(len(ids), 3 * cfg["hidden_size"])  # the target's states: fc scales them to ~0
    logits, out = draft_forward(w, cfg, embed, ids, aux)
    first = logits.argmax(-1).tolist()
    assert sum(a == dmap[t] for a, t in zip(first, ids)) / len(ids) >= 0.99
    # Chained steps: each reads the previous step's normalized output and its own proposal.
    hidden, tokens = out, first
    for _ in range(3):
        logits, hidden = draft_forward(w, cfg, embed, tokens, hidden)
        nxt = logits.argmax(-1).tolist()
        assert sum(a == dmap[t] for a, t in zip(nxt, tokens)) / len(tokens) >= 0.99
        tokens = nxt
