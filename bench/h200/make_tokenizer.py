"""Train the 32000-token byte-level BPE tokenizer that the H200 run's random models use.

Nothing can be downloaded on the device machine, so the tokenizer is trained here, on local
text (Python sources of the installed packages), and carried in ``.h200pack/tokenizer/``.
The benchmark sends token ids, so the tokenizer only has to load; its merges do not matter.

Usage: python bench/h200/make_tokenizer.py --out .h200pack/tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 32000


def _corpus(limit_bytes: int) -> Iterator[str]:
    """Yield local Python sources until ``limit_bytes`` have been read."""
    seen = 0
    for root in sys.path:
        base = Path(root)
        if not base.is_dir() or "site-packages" not in str(base):
            continue
        for path in sorted(base.rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue
            seen += len(text)
            yield text
            if seen >= limit_bytes:
                return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for tokenizer.json + config")
    parser.add_argument("--corpus-mb", type=int, default=40, help="MB of local text to train on")
    args = parser.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(args.corpus_mb * 1_000_000), trainer=trainer)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 8192,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    print(f"tokenizer with {tok.get_vocab_size()} tokens -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
