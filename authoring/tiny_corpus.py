"""The tiny model's corpus and tokenizer: the Python standard library's own sources.

Every `.py` file of the running interpreter's stdlib, sorted, without tests, the `encodings`
codec tables and site-packages; a file is held out when its relative path hashes to 0 mod 20.
The byte-level BPE is trained with the exact pre-tokenizer (Qwen2 split + NFC) that
`decoder.tokenizer` rebuilds from GGUF metadata, and the corpus is encoded with that rebuilt
tokenizer, so the ids a model trains on are the ids the decoder feeds it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
from gguf import TokenType

ENDOFTEXT = "<|endoftext|>"  # the document separator the factory's vocabulary holds

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "__pycache__"})
HELD_OUT_MOD = 20


# -- corpus -----------------------------------------------------------------------------------
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """Sorted stdlib .py paths relative to `root`, without tests, codec tables and site-packages."""
    root = root or stdlib_dir()
    rels = (p.relative_to(root) for p in root.rglob("*.py"))
    return sorted(r.as_posix() for r in rels if not EXCLUDED_DIRS.intersection(r.parts[:-1]))


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELD_OUT_MOD == 0


def split_texts(split: str, root: Path | None = None) -> list[str]:
    """The texts of the "train" or "heldout" split, in sorted path order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_dir()
    want = split == "heldout"
    rels = [r for r in corpus_files(root) if is_held_out(r) == want]
    return [(root / r).read_text(encoding="utf-8", errors="replace") for r in rels]


# -- tokenizer --------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE trained with the same split (Qwen2 regex + NFC) the decoder rebuilds from GGUF."""
    from .tokenizer_data import train_tokenizer as train_bpe
    from ..decoder.generation.tokenizer import build_bpe

    probe = build_bpe(["a"], [], None, "qwen2")  # the decoder's own normalizer (NFC) for "qwen2"
    # no padding: reserved tokens would be special here but normal to inference_tokenizer
    return train_bpe(vocab, texts, normalizer=probe.normalizer, pad=False)


def inference_tokenizer(tok):
    """`tok` as the decoder rebuilds it from GGUF metadata, so training ids == inference ids."""
    from .tokenizer_data import SPECIAL_TOKENS, merges_list, vocab_list
    from ..decoder.generation.tokenizer import build_bpe

    tokens = vocab_list(tok)
    types = [TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t in tokens]
    return build_bpe(tokens, merges_list(tok), types, "qwen2")


def encode_texts(tok, texts: list[str]) -> np.ndarray:
    """All texts as one id stream, each document followed by <|endoftext|>."""
    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def unigram_loss(train_ids: np.ndarray, eval_ids: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats/token) of `eval_ids` under add-one-smoothed unigram counts of `train_ids`."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[eval_ids].mean())


def unigram_entropy(ids: np.ndarray) -> float:
    """Entropy (nats) of the empirical token distribution of `ids`: the best any unigram model scores on them."""
    counts = np.bincount(ids).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
