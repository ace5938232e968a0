"""A small byte-level BPE tokenizer for tiny models, and its GGUF metadata.

Trained with the `tokenizers` library on text every machine has: a sorted subset of the
Python standard library's own sources, so the same vocab size gives the same tokenizer on
one interpreter version with no download. The trained JSON is cached under
`$XDG_CACHE_HOME/moestream` (or `~/.cache/moestream`), keyed by vocab size, Python version
and `TOKENIZER_VERSION`.

`add_tokenizer_metadata` writes what llama.cpp's gpt2-style vocab loader reads
(`tokenizer.ggml.model = "gpt2"`, tokens, token types, "a b" merges, special ids).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TOKENIZER_VERSION = 2
# Qwen2's pre-tokenizer split (what `tokenizer.ggml.pre = "qwen2"` means to llama.cpp and
# transformers): single digits, letter runs, punctuation runs, newline and space runs.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS_MAX_BYTES = 2 << 20  # 2 MiB of stdlib source: a few seconds of training
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4  # llama.cpp token types
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # byte alphabet + specials + at least one merge

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moestream"


def corpus_files(max_bytes: int = CORPUS_MAX_BYTES) -> list[Path]:
    """A deterministic, sorted subset of the stdlib's top-level .py files, up to `max_bytes`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        out.append(path)
        total += size
    if not out:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return out


def _iter_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(vocab: int, texts: Iterable[str] | None = None, *,
                    normalizer: normalizers.Normalizer | None = None, pad: bool = True) -> Tokenizer:
    """Train a byte-level BPE (Qwen2 split) with exactly `vocab` tokens, specials included, uncached.

    `texts` default to the stdlib sample of `corpus_files()`. A corpus that runs out of merges
    before `vocab` gets reserved special tokens when `pad`, else raises RuntimeError."""
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab size {vocab} is too small: a byte-level BPE needs at least {MIN_VOCAB} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens + 1 merge)")
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_iter_texts(corpus_files()) if texts is None else texts, trainer=trainer)
    _pad_vocab(tok, vocab, pad)
    return tok


def _pad_vocab(tok: Tokenizer, vocab: int, pad: bool) -> None:
    # A small corpus may run out of merges before `vocab`; the embedding rows must equal vocab.
    missing = vocab - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0 and pad:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, wanted {vocab}")


def get_tokenizer(vocab: int) -> Tokenizer:
    """The trained tokenizer for `vocab`, from the cache when it is there."""
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    path = cache_dir() / f"bpe-v{TOKENIZER_VERSION}-py{py}-{vocab}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # a corrupt cache entry: retrain below
            pass
    tok = train_tokenizer(vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)  # atomic: concurrent test workers never read half a file
    return tok


def vocab_list(tok: Tokenizer) -> list[str]:
    """Token strings indexed by id; ids must be 0..n-1 with no gaps."""
    table = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(table)
    for text, idx in table.items():
        if not 0 <= idx < len(tokens) or tokens[idx]:
            raise ValueError(f"tokenizer ids are not contiguous: id {idx} for {text!r}")
        tokens[idx] = text
    return tokens


def merges_list(tok: Tokenizer) -> list[str]:
    """BPE merges as "a b" strings (llama.cpp format), in rank order."""
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in merges]


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tok: Tokenizer) -> None:
    """Write the gpt2-style (Qwen) tokenizer keys llama.cpp and transformers read."""
    tokens = vocab_list(tok)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([TOKEN_CONTROL if t in special else TOKEN_NORMAL for t in tokens])
    writer.add_token_merges(merges_list(tok))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    writer.add_bos_token_id(ids["<|endoftext|>"])  # Qwen: bos = pad = <|endoftext|>, not prepended
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN_CHAT_TEMPLATE)
