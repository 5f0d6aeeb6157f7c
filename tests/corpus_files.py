"""Small corpus folders for tests, laid out as scripts/build_corpus.py lays them out
(launch.titan.data.CORPUS_FILES), without building one from packages."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from launch.titan.data import CORPUS_FILES, TOKENIZER_DIR

WORDS = ("the kernel maps each page of the file into memory when a process reads it; a signal "
         "handler runs on the thread that received the signal, and the scheduler picks the next "
         "task from the run queue by its virtual runtime").split()


def sample_texts(n: int, words: int = 120, offset: int = 0) -> list[str]:
    """``n`` distinct documents of plain English-like text."""
    return [" ".join(WORDS[(i * 7 + j + offset) % len(WORDS)] for j in range(words)) + f" doc {i + offset}."
            for i in range(n)]


def write_corpus(root: Path, train: list[str], validation: list[str], *,
                 tokenizer: Path = TOKENIZER_DIR, manifest: bool = True) -> Path:
    """A corpus folder with these texts and a copy of ``tokenizer``; the manifest counts
    tokens with it as build_corpus.py does."""
    root.mkdir(parents=True, exist_ok=True)
    for name, texts in ((CORPUS_FILES.train, train), (CORPUS_FILES.validation, validation)):
        with gzip.open(root / name, "wt", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t, "source": "test"}) + "\n")
    shutil.copytree(tokenizer, root / CORPUS_FILES.tokenizer, dirs_exist_ok=True)
    if manifest:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(root / CORPUS_FILES.tokenizer / "tokenizer.json"))
        splits = {name: {"tokens": sum(len(e.ids) for e in tok.encode_batch(texts))}
                  for name, texts in (("train", train), ("validation", validation))}
        (root / CORPUS_FILES.manifest).write_text(json.dumps({"splits": splits}))
    return root
