"""A tiny random Llama with its own byte-level BPE tokenizer, built locally (nothing downloaded).

Used by the end-to-end hook test and ``bench/bench_hook.py`` to start a real SGLang server on CPU.
Deterministic: the same ``seed`` gives the same weights and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target model verifies them in one pass",
    "a scheduler runs decode steps in batches and streams telemetry to a controller",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { }",
    "Once upon a time there was a tiny language model that produced random words.",
]


def build_tiny_llama(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write a 2-layer random ``LlamaForCausalLM`` and a matching fast tokenizer to ``out_dir``.

    Args:
        out_dir: folder to create (reused if it already holds a model built with this seed).
        seed: torch / tokenizer seed.
        vocab_size: BPE vocabulary size (the model's embedding size matches it).

    Returns:
        ``out_dir`` as a :class:`Path`, usable as ``--model-path``.
    """
    out = Path(out_dir)
    stamp = out / "specdepth_tiny.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"seed": seed, "vocab_size": vocab_size}:
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=2048
    )
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}))
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
