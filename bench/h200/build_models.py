"""Build the random-weight target and EAGLE-3 drafts for the H200 run (runs on the device).

Nothing can be downloaded on the device machine, so the models are made there from random
numbers, with a construction that makes the target's greedy output predictable:

* Target (``LlamaForCausalLM``, tied embeddings): embedding std 1 and ``o_proj``/``down_proj``
  std 0.002 keep every layer's residual stream close to the current token's embedding, so the
  tied LM head picks that token again: greedy decoding repeats the last prompt token. Logit
  margin: about 4096 (a row with itself) against the largest of 32k cross terms, about 4.3 *
  64 * 1.7 ~ 470, so the repetition is robust to the layers' small contributions.
* ``same`` draft (``LlamaForCausalLMEagle3``): ``fc = [I 0 0]`` picks the target's low aux hidden
  state (~ the current token's embedding), the layer's outputs are small, and its LM head is
  the target's embedding matrix, so it proposes "the same token again" at every depth:
  acceptance ~ 1.
* ``noisy`` draft: the ``same`` draft whose LM head is ``E + sigma * N``; ``sigma`` is chosen by
  bisection so that a fraction ``--noisy-accept`` of the vocabulary still maps to itself. The
  target repeats one token per request, so each request accepts all drafts or none, and the
  mean acceptance over requests with random last tokens is that fraction.
* ``rand`` draft: every weight random: acceptance ~ 1/vocab ~ 0.

``--testbed`` builds the realistic acceptance testbed instead (``testbed.py`` defines it): the
target's LM head is its embedding permuted, so greedy decoding continues with ``PI[t]`` after
token ``t``, and one draft, ``tb``, proposes ``DRAFT[t]`` (right for each family's good tokens).
The ``tb`` draft reads the token, not the target's hidden state (see :func:`build_tb_draft`):

* ``fc`` is ``eps * [I 0 0]``, so the target's state only adds a small residual;
* attention: every query head of KV group ``g`` reads block ``g`` (``head_dim`` wide) of the
  normalized input embedding, scaled by ``alpha``; keys and values read the same block. A
  position's score with itself is ``alpha * sqrt(head_dim)`` (~22 at alpha 2), with any other
  position ~N(0, alpha^2), so each position attends to itself even at 32k tokens of context;
* ``o_proj`` writes the first query head of group ``g`` into block ``g`` times ``K``, the MLP is
  near zero, and ``norm_output`` (a config flag SGLang reads) hands the normalized output to
  the next draft step, so the previous step's token stays ``K/2`` times weaker than this one's;
* the LM head's row ``j`` is the first ``kv_heads * head_dim`` dims of the normalized embedding
  of ``DRAFT^-1[j]``, so the top proposal after token ``x`` is ``DRAFT[x]``.

Shapes: ``--shape 8b`` is Llama-3.1-8B's decoder (hidden 4096, 32 layers, 32/8 heads, MLP 14336)
with a 32000-token vocabulary (7.1 B parameters), the shape of ``shared/reference/h200_llama8b``;
``--shape tiny`` (hidden 1024, 4 layers) is for quick checks.

Usage (device): python3 bench/h200/build_models.py --out /root/models --shape 8b
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import testbed  # noqa: E402  (run as a script from bench/h200)

VOCAB = testbed.VOCAB


@dataclass(frozen=True)
class Shape:
    """Decoder shape of the target (the drafts use the same width, one layer)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int


SHAPES = {
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336),
    "tiny": Shape(hidden=1024, layers=4, heads=16, kv_heads=4, mlp=2816),
}


# Llama-3.1-8B's 128k: the long stages (realgpu.py --long-input) send prompts up to 32k, and
# SGLang refuses a --context-length above this. In build.json, so a machine's cached models
# built with fewer positions are rebuilt (run.build_models).
POSITIONS = 131072


def _llama_config(shape: Shape, layers: int, **extra: object) -> dict[str, object]:
    head_dim = shape.hidden // shape.heads
    cfg: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "vocab_size": VOCAB,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
    }
    cfg.update(extra)
    return cfg


def _write(out: Path, cfg: dict[str, object], tensors: dict, tokenizer: Path | None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 1}))
    # Shards of at most ~4 GB keep host memory for the copy small.
    shard: dict = {}
    size = 0
    index: dict[str, str] = {}
    n = 0
    names = list(tensors)

    def flush() -> None:
        nonlocal shard, size, n
        if not shard:
            return
        n += 1
        fname = f"model-{n:05d}.safetensors"
        save_file({k: v.contiguous().cpu() for k, v in shard.items()}, str(out / fname))
        for k in shard:
            index[k] = fname
        shard, size = {}, 0

    for name in names:
        t = tensors[name]
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= 4 << 30:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            shutil.copy(f, out / f.name)


def build_target(
    shape: Shape, gen, device: str, out_std: float = 0.002, perm: list[int] | None = None
) -> dict:
    """Random target whose greedy decoding repeats the last prompt token (see module doc).

    With ``perm`` (the testbed's ``PI``) the LM head is untied and greedy decoding continues
    with ``PI[t]`` after ``t`` instead.

    ``out_std`` is the std of ``o_proj``/``down_proj``: 0.002 keeps the repetition; 0.02 (a
    usual random init) makes every token depend on the whole context through attention, so a
    greedy comparison between two servers checks every kernel, not just the embedding.
    """
    import torch

    bf = torch.bfloat16
    head_dim = shape.hidden // shape.heads

    def rnd(*size: int, std: float):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * std).to(bf)

    h = shape.hidden
    t: dict = {
        "model.embed_tokens.weight": rnd(VOCAB, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=bf),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(shape.heads * head_dim, h, std=0.02)
        t[p + "self_attn.k_proj.weight"] = rnd(shape.kv_heads * head_dim, h, std=0.02)
        t[p + "self_attn.v_proj.weight"] = rnd(shape.kv_heads * head_dim, h, std=0.02)
        t[p + "self_attn.o_proj.weight"] = rnd(h, shape.heads * head_dim, std=out_std)
        t[p + "mlp.gate_proj.weight"] = rnd(shape.mlp, h, std=0.02)
        t[p + "mlp.up_proj.weight"] = rnd(shape.mlp, h, std=0.02)
        t[p + "mlp.down_proj.weight"] = rnd(h, shape.mlp, std=out_std)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=bf)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=bf)
    if perm is not None:
        # Untied head, row j = embedding of PI^-1[j]: the residual stream ~ e_t picks PI[t].
        inv = torch.tensor(testbed.inverse(perm), device=device)
        t["lm_head.weight"] = t["model.embed_tokens.weight"][inv].clone()
    return t


def build_draft(shape: Shape, embed, lm_head, gen, device: str, random_all: bool) -> dict:
    """One-layer EAGLE-3 draft. ``random_all`` gives the ~0-acceptance draft."""
    import torch

    bf = torch.bfloat16
    h = shape.hidden
    head_dim = h // shape.heads

    def rnd(*size: int, std: float):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * std).to(bf)

    small = 0.02 if random_all else 0.002
    if random_all:
        fc = rnd(h, 3 * h, std=0.02)
    else:
        fc = torch.zeros(h, 3 * h, dtype=bf, device=device)
        fc[:, :h] = torch.eye(h, dtype=bf, device=device)  # low aux state ~ the current token's embedding
    return {
        "fc.weight": fc,
        # SGLang replaces the draft's embedding with the target's; stored for completeness.
        "embed_tokens.weight": embed.clone(),
        "lm_head.weight": lm_head.clone(),
        "norm.weight": torch.ones(h, dtype=bf),
        "layers.0.hidden_norm.weight": torch.ones(h, dtype=bf),
        "layers.0.input_layernorm.weight": torch.ones(h, dtype=bf),
        "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=bf),
        "layers.0.self_attn.q_proj.weight": rnd(shape.heads * head_dim, 2 * h, std=0.02),
        "layers.0.self_attn.k_proj.weight": rnd(shape.kv_heads * head_dim, 2 * h, std=0.02),
        "layers.0.self_attn.v_proj.weight": rnd(shape.kv_heads * head_dim, 2 * h, std=0.02),
        "layers.0.self_attn.o_proj.weight": rnd(h, shape.heads * head_dim, std=small),
        "layers.0.mlp.gate_proj.weight": rnd(shape.mlp, h, std=0.02),
        "layers.0.mlp.up_proj.weight": rnd(shape.mlp, h, std=0.02),
        "layers.0.mlp.down_proj.weight": rnd(h, shape.mlp, std=small),
    }


def build_tb_draft(
    shape: Shape,
    embed,
    draft_map: list[int],
    gen,
    device: str,
    alpha: float = 2.0,
    k_out: float = 16.0,
    eps: float = 0.01,
) -> dict:
    """The testbed's draft: proposes ``draft_map[t]`` after token ``t`` (module doc, ``--testbed``)."""
    import torch

    bf = torch.bfloat16
    h = shape.hidden
    d = h // shape.heads
    group = shape.heads // shape.kv_heads
    width = shape.kv_heads * d  # the embedding dims the attention carries

    def rnd(*size: int, std: float):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * std).to(bf)

    fc = torch.zeros(h, 3 * h, dtype=bf, device=device)
    fc[:, :h] = eps * torch.eye(h, dtype=bf, device=device)
    q = torch.zeros(shape.heads * d, 2 * h, dtype=bf, device=device)
    kv = torch.zeros(shape.kv_heads * d, 2 * h, dtype=bf, device=device)
    o = torch.zeros(h, shape.heads * d, dtype=bf, device=device)
    eye = torch.eye(d, dtype=bf, device=device)
    for g in range(shape.kv_heads):
        block = slice(g * d, (g + 1) * d)  # embedding dims of group g (the first half of the input)
        kv[block, block] = eye
        for i in range(g * group, (g + 1) * group):
            q[i * d : (i + 1) * d, block] = alpha * eye
        o[block, g * group * d : (g * group + 1) * d] = k_out * eye
    e = embed.float()
    e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-5)  # what input_layernorm hands over
    inv = torch.tensor(testbed.inverse(draft_map), device=device)
    head = torch.zeros(embed.shape, dtype=bf, device=device)
    head[:, :width] = e[inv, :width].to(bf)
    return {
        "fc.weight": fc,
        "embed_tokens.weight": embed.clone(),  # SGLang uses the target's; stored for completeness
        "lm_head.weight": head,
        "norm.weight": torch.ones(h, dtype=bf),
        "layers.0.hidden_norm.weight": torch.ones(h, dtype=bf),
        "layers.0.input_layernorm.weight": torch.ones(h, dtype=bf),
        "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=bf),
        "layers.0.self_attn.q_proj.weight": q,
        "layers.0.self_attn.k_proj.weight": kv.clone(),
        "layers.0.self_attn.v_proj.weight": kv,
        "layers.0.self_attn.o_proj.weight": o,
        "layers.0.mlp.gate_proj.weight": rnd(shape.mlp, h, std=0.02),
        "layers.0.mlp.up_proj.weight": rnd(shape.mlp, h, std=0.02),
        "layers.0.mlp.down_proj.weight": rnd(h, shape.mlp, std=1e-4),
    }


def self_map_fraction(embed, head, sample: int = 4096) -> float:
    """Fraction of tokens t with argmax_j <norm(e_t), head_j> == t (the draft's first proposal).

    Estimated on ``sample`` evenly spaced tokens (binomial error < 0.8% at 4096).
    """
    import torch

    ids = torch.linspace(0, VOCAB - 1, sample, device=embed.device).long()
    dtype = head.dtype if embed.is_cuda else torch.float32  # CPU bf16 matmuls are very slow
    e = embed[ids].float()
    e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-5)
    pred = (e.to(dtype) @ head.to(dtype).T).argmax(-1)
    return float((pred == ids).float().mean())


def noisy_head(embed, gen, device: str, target_fraction: float) -> tuple[object, float, float]:
    """``E + sigma N`` with sigma bisected so that ``target_fraction`` of tokens map to themselves."""
    import torch

    noise = torch.randn(embed.shape, generator=gen, device=device, dtype=torch.float32)
    lo, hi = 0.0, 64.0
    best = (embed, 0.0, 1.0)
    for _ in range(14):
        sigma = (lo + hi) / 2
        head = (embed.float() + sigma * noise).to(embed.dtype)
        frac = self_map_fraction(embed, head)
        best = (head, sigma, frac)
        if abs(frac - target_fraction) < 0.01:
            break
        if frac > target_fraction:
            lo = sigma
        else:
            hi = sigma
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--drafts", default="same,rand", help="comma list of same, noisy, rand")
    parser.add_argument("--noisy-accept", type=float, default=0.7)
    parser.add_argument("--tokenizer", type=Path, default=Path(".h200pack/tokenizer"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--testbed",
        action="store_true",
        help="the realistic acceptance testbed (testbed.py): a permutation target and the 'tb' draft; "
        "--drafts may add rand",
    )
    parser.add_argument(
        "--target-out-std",
        type=float,
        default=0.002,
        help="std of the target's o_proj/down_proj: 0.002 repeats the last token (the drafts' "
        "acceptance is built on that); 0.02 makes outputs depend on the whole context",
    )
    args = parser.parse_args()

    import torch

    tic = time.time()
    shape = SHAPES[args.shape]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    tok = args.tokenizer if args.tokenizer.is_dir() else None
    report: dict[str, object] = {"shape": args.shape, **shape.__dict__, "vocab": VOCAB, "positions": POSITIONS}

    pi, dmap, good = testbed.maps(args.seed) if args.testbed else (None, None, None)
    target = build_target(shape, gen, device, args.target_out_std, perm=pi)
    report["target_out_std"] = args.target_out_std
    report["testbed"] = args.testbed
    if good is not None:
        report["good_fraction"] = {
            f.name: sum(good[f.lo : f.hi]) / (f.hi - f.lo) for f in testbed.FAMILIES.values()
        }
    params = sum(v.numel() for v in target.values())
    report["target_params"] = params
    embed = target["model.embed_tokens.weight"]
    report["target_self_map_fraction"] = self_map_fraction(embed, embed)
    _write(
        args.out / "target", _llama_config(shape, shape.layers, tie_word_embeddings=pi is None), target, tok
    )
    report["target_s"] = round(time.time() - tic, 1)

    draft_cfg = _llama_config(
        shape,
        1,
        architectures=["LlamaForCausalLMEagle3"],
        tie_word_embeddings=False,
        draft_vocab_size=VOCAB,
    )
    if shape.layers < 8:
        # SGLang's default aux layers (2, L/2, L-3) do not exist in a small target.
        draft_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    for name in args.drafts.split(","):
        if name == "tb":
            if dmap is None:
                raise SystemExit("the 'tb' draft needs --testbed")
            d = build_tb_draft(shape, embed, dmap, gen, device)
            cfg = {**draft_cfg, "norm_output": True}
            _write(args.out / "draft_tb", cfg, d, tok)
            report["draft_tb_self_map_fraction"] = None  # acceptance is per family: good_fraction
            del d
            continue
        if name == "same":
            head, frac = embed, report["target_self_map_fraction"]
            d = build_draft(shape, embed, head, gen, device, random_all=False)
        elif name == "noisy":
            head, sigma, frac = noisy_head(embed, gen, device, args.noisy_accept)
            report["noisy_sigma"] = sigma
            d = build_draft(shape, embed, head, gen, device, random_all=False)
        elif name == "rand":
            head = (torch.randn(embed.shape, generator=gen, device=device) * 0.02).to(embed.dtype)
            frac = self_map_fraction(embed, head)
            d = build_draft(shape, embed, head, gen, device, random_all=True)
        else:
            raise SystemExit(f"unknown draft {name!r}")
        report[f"draft_{name}_self_map_fraction"] = frac
        _write(args.out / f"draft_{name}", draft_cfg, d, tok)
        del d
    report["total_s"] = round(time.time() - tic, 1)
    (args.out / "build.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
