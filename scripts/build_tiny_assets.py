"""Build the recipe's tiny training text and tokenizer (committed under ``launch/titan/assets/``,
package data of the recipe).

Why: torchtitan 0.2.2's wheel ships neither a tokenizer nor a test dataset, and CI has no
network. So we write our own small corpus and train a byte-level BPE tokenizer on it.

* ``launch/titan/assets/tiny_text.jsonl``: one ``{"text": ...}`` document per line, generated from a
  fixed seed by a small grammar (facts about numbers, colours, places and MoE routing). It has enough
  regularity that a 2-layer model's loss falls visibly within a few steps, and enough variety
  that it does not collapse to memorisation immediately. Written by this script, nothing
  downloaded.
* ``launch/titan/assets/tokenizer/tokenizer.json`` + ``tokenizer_config.json``: byte-level BPE with at most
  ``TINY_VOCAB_SIZE`` (512) ids, trained on that text; loadable by torchtitan's
  ``HuggingFaceTokenizer`` (it loads a directory).

Run from the repo root: ``python scripts/build_tiny_assets.py``. Deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "launch" / "titan" / "assets"
VOCAB_SIZE = 512  # == launch.titan.models.TINY_VOCAB_SIZE
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
COLOURS = ["red", "green", "blue", "yellow", "white", "black", "orange", "purple"]
THINGS = ["apple", "river", "stone", "garden", "window", "bridge", "letter", "lantern"]
PLACES = ["the north", "the valley", "the old town", "the harbour", "the hills", "the library"]
PEOPLE = ["Ada", "Boris", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana"]
VERBS = ["found", "painted", "carried", "counted", "remembered", "described", "opened"]


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 5), rng.randint(0, 5)
    return f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."


def _counting(rng: random.Random) -> str:
    start = rng.randint(0, 6)
    seq = ", ".join(NUMBERS[start : start + 5])
    return f"Counting up: {seq}."


def _story(rng: random.Random) -> str:
    who, what, colour = rng.choice(PEOPLE), rng.choice(THINGS), rng.choice(COLOURS)
    verb, where = rng.choice(VERBS), rng.choice(PLACES)
    article = "an" if colour[0] in "aeiou" else "a"
    return f"{who} {verb} {article} {colour} {what} in {where}."


def _routing(rng: random.Random) -> str:
    token, expert, rank = rng.randint(0, 99), rng.randint(0, 7), rng.randint(0, 1)
    return (
        f"Token {token} is routed to expert {expert}, which lives on rank {rank}; "
        f"the all-to-all sends it there and brings the result back."
    )


def _colour_fact(rng: random.Random) -> str:
    thing, colour = rng.choice(THINGS), rng.choice(COLOURS)
    return f"The {thing} is {colour}. What colour is the {thing}? It is {colour}."


GENERATORS = (_arithmetic, _counting, _story, _routing, _colour_fact)


def make_corpus(num_docs: int, seed: int = 1234) -> list[str]:
    """``num_docs`` documents of 3-8 sentences each, reproducible from ``seed``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        n = rng.randint(3, 8)
        docs.append(" ".join(rng.choice(GENERATORS)(rng) for _ in range(n)))
    return docs


def write_jsonl(docs: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")


def train_tokenizer(docs: list[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic merges
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(out_dir / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=800)
    parser.add_argument("--out", type=Path, default=ASSETS)
    args = parser.parse_args()
    docs = make_corpus(args.docs)
    write_jsonl(docs, args.out / "tiny_text.jsonl")
    train_tokenizer(docs, args.out / "tokenizer")
    size = (args.out / "tiny_text.jsonl").stat().st_size
    print(f"wrote {len(docs)} docs ({size / 1024:.0f} KiB) and a {VOCAB_SIZE}-id tokenizer to {args.out}")


if __name__ == "__main__":
    main()
