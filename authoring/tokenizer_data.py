"""Small tokenizers for tiny models, and their GGUF metadata, in the two kinds llama.cpp writes.

Trained with the `tokenizers` library on text every machine has: a sorted subset of the
Python standard library's own sources, so the same vocab size gives the same tokenizer on
one interpreter version with no download. The trained JSON is cached under
`$XDG_CACHE_HOME/moestream` (or `~/.cache/moestream`), keyed by vocab size, Python version
and `TOKENIZER_VERSION`.

- "bpe": byte-level BPE with Qwen2's split; `add_tokenizer_metadata` writes what llama.cpp's
  gpt2-style vocab loader reads (`tokenizer.ggml.model = "gpt2"`, tokens, types, "a b" merges).
- "kimi": the same byte-level BPE trained with Kimi-K2's split (`tokenizer.ggml.pre = "kimi-k2"`),
  for tiny Kimi-K2-style files (deepseek2 weights); written as a `ByteLevelVocab` naming its split.
- "spm": a SentencePiece-style BPE with byte fallback, as Mistral/Mixtral ship;
  `add_spm_metadata` writes it as convert_hf_to_gguf.py writes a SentencePiece model
  (`tokenizer.ggml.model = "llama"`: `<unk> <s> </s>`, the 256 `<0xNN>` byte tokens, pieces with
  scores falling with merge rank, then the single characters, token types, no merges).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
from gguf import TokenType
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's split (`tokenizer.ggml.pre = "qwen2"`): single digits, letter runs, punctuation runs, newline and space runs
from ..decoder.generation.tokenizer import PRE_TOKENIZERS, QWEN2_SPLIT_REGEX, SPACE

TOKENIZER_VERSION = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS_MAX_BYTES = 2 << 20  # 2 MiB of stdlib source: a few seconds of training
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # byte alphabet + specials + at least one merge
TOKENIZER_KINDS = ("bpe", "spm", "kimi")
BPE_SPLITS = {"bpe": "qwen2", "kimi": "kimi-k2"}  # byte-level kind -> the tokenizer.ggml.pre it is trained with
SPM_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in Llama/Mistral
SPM_BYTES = tuple(f"<0x{b:02X}>" for b in range(256))
SPM_MAX_CHARS = 96  # most frequent characters kept as tokens; the rest fall back to bytes
MIN_SPM_VOCAB = len(SPM_SPECIALS) + len(SPM_BYTES) + 8

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Mistral's [INST] format; no {{ bos_token }}: encode adds BOS (add_bos_token = true)
MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class ByteLevelVocab:
    """A byte-level BPE and the `tokenizer.ggml.pre` whose split it was trained with."""

    tokenizer: Tokenizer
    pre: str


@dataclass(frozen=True)
class SpmVocab:
    """A SentencePiece-style vocabulary as GGUF stores it: tokens, scores and llama.cpp token types."""

    tokens: list[str]
    scores: list[float]
    types: list[int]


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
                    normalizer: normalizers.Normalizer | None = None, pad: bool = True,
                    pre: str = "qwen2") -> Tokenizer:
    """Train a byte-level BPE (the split of `tokenizer.ggml.pre` `pre`, Qwen2's by default) with exactly
    `vocab` tokens, specials included, uncached.

    `texts` default to the stdlib sample of `corpus_files()`. A corpus that runs out of merges
    before `vocab` gets reserved special tokens when `pad`, else raises RuntimeError."""
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab size {vocab} is too small: a byte-level BPE needs at least {MIN_VOCAB} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens + 1 merge)")
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    splits = (QWEN2_SPLIT_REGEX,) if pre == "qwen2" else PRE_TOKENIZERS[pre].splits
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
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


def get_tokenizer(vocab: int, pre: str = "qwen2") -> Tokenizer:
    """The trained tokenizer for `vocab` (and split `pre`), from the cache when it is there."""
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    split = "" if pre == "qwen2" else f"-{pre}"
    path = cache_dir() / f"bpe{split}-v{TOKENIZER_VERSION}-py{py}-{vocab}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # a corrupt cache entry: retrain below
            pass
    tok = train_tokenizer(vocab, pre=pre)
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


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tok: Tokenizer | ByteLevelVocab | SpmVocab) -> None:
    """Write the tokenizer keys llama.cpp and transformers read: gpt2-style (Qwen's split for a
    `Tokenizer`, its own for a `ByteLevelVocab`), SentencePiece-style (Mistral) for an `SpmVocab`."""
    if isinstance(tok, SpmVocab):
        add_spm_metadata(writer, tok)
        return
    pre = "qwen2"
    if isinstance(tok, ByteLevelVocab):
        tok, pre = tok.tokenizer, tok.pre
    tokens = vocab_list(tok)
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges_list(tok))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    writer.add_bos_token_id(ids["<|endoftext|>"])  # Qwen: bos = pad = <|endoftext|>, not prepended
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN_CHAT_TEMPLATE)


def get_vocab(kind: str, vocab: int) -> Tokenizer | ByteLevelVocab | SpmVocab:
    """The factory's tokenizer of `kind` ("bpe", "kimi" or "spm") with `vocab` tokens."""
    if kind == "bpe":
        return get_tokenizer(vocab)
    if kind in BPE_SPLITS:
        return ByteLevelVocab(get_tokenizer(vocab, BPE_SPLITS[kind]), BPE_SPLITS[kind])
    if kind == "spm":
        return get_spm_vocab(vocab)
    raise ValueError(f"unknown tokenizer kind {kind!r} (supported: {', '.join(TOKENIZER_KINDS)})")


def train_spm(vocab: int, texts: Iterable[str] | None = None) -> SpmVocab:
    """A SentencePiece-style BPE with `vocab` tokens: specials, 256 byte tokens, learned pieces.

    Trained with `tokenizers` on ▁-escaped text split before each ▁ (SentencePiece's
    split_by_whitespace); a corpus that runs out of merges is padded with UNUSED `[PAD<id>]`
    tokens, as convert_hf_to_gguf.py pads a vocabulary smaller than the embedding."""
    if vocab < MIN_SPM_VOCAB:
        raise ValueError(f"vocab size {vocab} is too small for a SentencePiece vocabulary: it needs at least "
                         f"{MIN_SPM_VOCAB} ({len(SPM_SPECIALS)} specials + 256 byte tokens + a few pieces)")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    n_learn = vocab - len(SPM_SPECIALS) - len(SPM_BYTES)
    trainer = trainers.BpeTrainer(vocab_size=n_learn, limit_alphabet=min(SPM_MAX_CHARS, n_learn), show_progress=False)
    tok.train_from_iterator(_iter_texts(corpus_files()) if texts is None else texts, trainer=trainer)
    return _spm_vocab(tok, vocab)


def _spm_vocab(tok: Tokenizer, vocab: int) -> SpmVocab:
    """Merged pieces in merge order (score -rank), then single characters, as SentencePiece orders them."""
    merged = ["".join(pair) for pair in (m.split(" ") if isinstance(m, str) else m
                                          for m in json.loads(tok.to_str())["model"]["merges"])]
    table, formed = tok.get_vocab(), set(merged)
    chars = sorted((t for t in table if t not in formed), key=table.__getitem__)
    reserved = set(SPM_SPECIALS) | set(SPM_BYTES)
    pieces = [t for t in dict.fromkeys(merged + chars) if t not in reserved][:vocab - len(reserved)]
    tokens = [*SPM_SPECIALS, *SPM_BYTES, *pieces]
    pad = [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
             + [TokenType.NORMAL] * len(pieces) + [TokenType.UNUSED] * len(pad))
    scores = [0.0] * len(reserved) + [-float(i) for i in range(len(pieces))] + [-1e9] * len(pad)
    return SpmVocab(tokens + pad, scores, [int(t) for t in types])


def get_spm_vocab(vocab: int) -> SpmVocab:
    """The trained SentencePiece-style vocabulary for `vocab`, from the cache when it is there."""
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    path = cache_dir() / f"spm-v{TOKENIZER_VERSION}-py{py}-{vocab}.json"
    if path.is_file():
        try:
            return SpmVocab(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError):  # a corrupt cache entry: retrain below
            pass
    spm = train_spm(vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(spm), ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)  # atomic: concurrent test workers never read half a file
    return spm


def add_spm_metadata(writer: gguf.GGUFWriter, spm: SpmVocab) -> None:
    """Write a SentencePiece vocabulary as convert_hf_to_gguf.py does for Mistral/Mixtral."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(spm.tokens)
    writer.add_token_scores(spm.scores)
    writer.add_token_types(spm.types)
    ids = {t: spm.tokens.index(t) for t in SPM_SPECIALS}
    writer.add_unk_token_id(ids["<unk>"])
    writer.add_bos_token_id(ids["<s>"])
    writer.add_eos_token_id(ids["</s>"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(MISTRAL_CHAT_TEMPLATE)
