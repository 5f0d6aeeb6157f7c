"""The recipe's tiny dataset and tokenizer (``launch/assets/``), registered with torchtitan 0.2.2.

torchtitan finds datasets by name in ``torchtitan.hf_datasets.text_datasets.DATASETS``; the
wheel only knows c4 (a download). :func:`register_tiny_dataset` adds ``"mxfp8ep_tiny"``: the
jsonl written by ``scripts/build_tiny_assets.py``, read into an in-memory HF ``Dataset`` (no
HF cache directory, no network, nothing two ranks could race on). Being map-style, torchtitan
checkpoints its position by sample index, so resumed runs continue where they stopped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "ASSETS_DIR",
    "DATASET_PATHS",
    "TINY_DATASET",
    "TINY_TEXT",
    "TOKENIZER_DIR",
    "TOKENIZER_FILES",
    "load_jsonl_dataset",
    "register_tiny_dataset",
]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TINY_TEXT = ASSETS_DIR / "tiny_text.jsonl"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
TINY_DATASET = "mxfp8ep_tiny"
# The datasets training.dataset may name and where each reads from without
# training.dataset_path: torchtitan 0.2.2's (a Hugging Face hub id or a path) plus ours.
# tests/test_titan_models.py checks this against torchtitan's DATASETS.
DATASET_PATHS = {
    "c4": "allenai/c4",
    "c4_test": "tests/assets/c4_test",
    "c4_validation": "allenai/c4",
    TINY_DATASET: str(TINY_TEXT),
}
# What torchtitan's HuggingFaceTokenizer loads from a tokenizer directory (one of them).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


def load_jsonl_dataset(path: str) -> Any:
    """Rows of a ``{"text": ...}`` jsonl file as an in-memory ``datasets.Dataset``."""
    from datasets import Dataset

    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list(rows)


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_tiny_dataset(name: str = TINY_DATASET, path: str | Path = TINY_TEXT) -> None:
    """Register a jsonl text file as torchtitan dataset ``name`` (overwrites: idempotent).

    ``training.dataset_path`` in the job config still overrides ``path`` per run.
    """
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[name] = DatasetConfig(
        path=str(path), loader=load_jsonl_dataset, sample_processor=_text
    )
