"""Tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata with the `tokenizers` library.

Two tokenizer models, as llama.cpp's vocab loader reads them:

- `gpt2`: byte-level BPE (Qwen, Llama 3, DeepSeek-V3, Kimi-K2, gpt-oss, GLM-4, OLMoE). The split before
  the merges is chosen by `tokenizer.ggml.pre` from `PRE_TOKENIZERS`, written as the model's own
  `tokenizer.json` writes it (llama.cpp re-spells some of them for its regex engine).
- `llama`: SentencePiece BPE (Mistral, Mixtral, Llama 1/2): tokens with scores, `<0xNN>` byte
  tokens for characters outside the vocabulary, and `▁` for spaces. llama.cpp merges the
  adjacent pair whose concatenation has the highest score; the same ranking written as BPE merges
  gives `tokenizers` the same ids.

Token types follow llama.cpp (gguf.TokenType): CONTROL tokens (`<|im_start|>`, `<s>`) are matched
whole in the text and rendered only when asked (`skip_special=False`), as are UNKNOWN ones;
USER_DEFINED tokens are matched whole and always rendered; UNUSED ones (`[PAD123]`) are never
produced by encoding and never rendered, as llama.cpp's `token_to_piece` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf import TokenType

from ...common.layout import ModelLayout
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # ▁: SentencePiece's spelling of a space

# -- byte-level BPE pre-tokenizers ---------------------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"  # (upper-ish, lower-ish) letters
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}*{_CASED[1]}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}+{_CASED[1]}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}*{_CASED[1]}+|[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}+{_CASED[1]}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"))
# Kimi-K2's tiktoken `pat_str` (tokenization_kimi.py): o200k-like, but Han runs are pieces of their own and
# the letter classes exclude Han (class intersection, which Oniguruma reads as tiktoken's engine does);
# llama.cpp runs the same split in a hand-written handler (unicode.cpp) behind a `\p{Han}+` trigger.
_NOT_HAN_UPPER, _NOT_HAN_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2 = (rf"[\p{{Han}}]+|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")  # llama.cpp's fallback


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` splits text before the merges, and its llama.cpp defaults."""

    splits: tuple[str, ...]  # regexes applied in turn, each piece kept ("isolated")
    nfc: bool = False  # the model's tokenizer.json normalizes to NFC first
    ignore_merges: bool = False  # a piece that is itself a token is taken whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_P_LLAMA3 = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_P_QWEN2 = PreTokenizer((QWEN2_SPLIT_REGEX,), nfc=True)
_P_GPT2 = PreTokenizer((_GPT2,))
_P_GPT4O = PreTokenizer((_GPT4O,))
_P_DEEPSEEK3 = PreTokenizer(_DEEPSEEK3)
_P_STARCODER = PreTokenizer((r"\p{N}", _GPT2))
# tokenizer.ggml.pre -> split; names grouped as llama.cpp's vocab loader groups them
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    **dict.fromkeys(("gpt-2", "phi-2", "olmo", "mpt", "jais", "exaone4"), _P_GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _P_LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _P_QWEN2),
    "qwen35": PreTokenizer((_QWEN35,), nfc=True),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _P_DEEPSEEK3),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _P_GPT4O),
    "kimi-k2": PreTokenizer((_KIMI_K2,)),  # Kimi-K2 (deepseek2 weights): no normalizer, merges by rank
    **dict.fromkeys(("glm4", "chatglm-bpe"), PreTokenizer((_LLAMA3,))),  # GLM-4's split is Llama 3's
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("starcoder", "refact", "smollm", "codeshell", "command-r"), _P_STARCODER),
}
TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values built here


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing or of a kind this decoder does not build."""


def _pre_tokenizer(pre: str) -> PreTokenizer:
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r} for a 'gpt2' vocabulary "
                             f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    return PRE_TOKENIZERS[pre]


def _byte_level_pipeline(spec: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in spec.splits]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _merges(raw: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """"left right" strings -> pairs, checked against the vocab (the Rust BPE panics otherwise)."""
    out = []
    for i, m in enumerate(raw):
        cut = m.find(" ", 1)  # byte-level tokens hold no real space
        left, right = m[:cut], m[cut + 1:]
        if cut < 0 or left not in vocab or right not in vocab or left + right not in vocab:
            raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {m!r}: not two vocabulary tokens whose "
                                 f"concatenation is in the vocabulary")
        out.append((left, right))
    return out


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.tokens has duplicate entries ({len(tokens) - len(vocab)})")
    return vocab


def _add_typed_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL/UNKNOWN as special added tokens, USER_DEFINED as plain ones: both matched whole."""
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.UNKNOWN)]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == TokenType.USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)


def build_bpe(tokens: list[str], merges: list[str], types: list[int] | None, pre: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` for a GGUF `gpt2` (byte-level BPE) vocabulary."""
    spec = _pre_tokenizer(pre)
    vocab = _vocab(tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(merges, vocab), fuse_unk=False, byte_fallback=False,
                               ignore_merges=spec.ignore_merges))
    tok.pre_tokenizer = _byte_level_pipeline(spec)
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    _add_typed_tokens(tok, tokens, list(types or []))
    return tok


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece merging: every split of a NORMAL token
    into two vocabulary tokens, ranked by the merged token's score (best first, then lower id)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, text in enumerate(tokens):
        if types[i] != TokenType.NORMAL:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm(tokens: list[str], scores: list[float] | None, types: list[int] | None,
              add_space_prefix: bool = True) -> Tokenizer:
    """A `tokenizers.Tokenizer` for a GGUF `llama` (SentencePiece BPE, byte fallback) vocabulary."""
    vocab = _vocab(tokens)
    types = list(types or [TokenType.NORMAL] * len(tokens))
    if scores is None or len(scores) != len(tokens) or len(types) != len(tokens):
        raise TokenizerError(f"a 'llama' vocabulary needs tokenizer.ggml.scores and token_type for each of its "
                             f"{len(tokens)} tokens")
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:  # llama.cpp's byte_to_token would fail the same way
        raise TokenizerError(f"'llama' vocabulary lacks byte-fallback tokens ({len(missing)} missing, e.g. {missing[0]})")
    unk = next((tokens[i] for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, list(scores), types), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    # llama.cpp escapes spaces as ▁ and, with add_space_prefix, puts one before every run of text
    # (at the start and after each special token): the normalizer runs once per such run.
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    # No Strip of the first space here: a continuation keeps it (GGUFTokenizer.decode(lstrip=...)).
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_typed_tokens(tok, tokens, types)
    return tok


def spm_piece_bytes(tokens: list[str], types: list[int]) -> tuple[bytes, ...]:
    """What each SentencePiece token prints: `<0xNN>` byte tokens their byte, ▁ a space.

    Decoding joins these bytes and then reads UTF-8 once, rather than `tokenizers`' ByteFallback,
    which turns every byte of a run of byte tokens into U+FFFD when the run is not valid UTF-8
    (`j` then a stray byte: "��" whole, "j" then "�" token by token)."""
    return tuple(bytes([int(t[3:5], 16)]) if ty == TokenType.BYTE and len(t) == 6 and t.startswith("<0x")
                 else t.replace(SPACE, " ").encode() if ty == TokenType.NORMAL
                 else t.encode() for t, ty in zip(tokens, types))  # others as written (llama.cpp)


def _hidden_ids(types: list[int] | None, model: str) -> tuple[frozenset[int], frozenset[int]]:
    """(ids never rendered, ids rendered only when asked), as llama.cpp's token_to_piece."""
    rendered = {TokenType.NORMAL, TokenType.USER_DEFINED} | ({TokenType.BYTE} if model == "llama" else set())
    types = types or []
    special = frozenset(i for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.UNKNOWN))
    never = frozenset(i for i, t in enumerate(types) if t not in rendered and i not in special)
    return never, special


def _opt_id(kv: Callable[[str, Any], Any], key: str, default: int | None, n: int) -> int | None:
    value = kv(key, default)
    return int(value) if value is not None and 0 <= int(value) < n else None


@dataclass
class GGUFTokenizer:
    """Encode/decode, special ids and the chat template of one model."""

    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool = False
    chat_template: str | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    pad_id: int = 0
    model: str = "gpt2"  # tokenizer.ggml.model
    never_rendered: frozenset[int] = field(default_factory=frozenset)  # UNUSED and other odd types
    special_ids: frozenset[int] = field(default_factory=frozenset)  # CONTROL / UNKNOWN
    space_prefix: bool = False  # encode put a ▁ before the text: decode(lstrip=True) removes it
    piece_bytes: tuple[bytes, ...] | None = None  # SentencePiece: each token's bytes, as llama.cpp prints it
    _skipped: frozenset[int] = field(init=False, repr=False)  # what decode drops by default

    def __post_init__(self) -> None:
        self._skipped = self.never_rendered | self.special_ids

    @classmethod
    def from_metadata(cls, kv: Callable[[str, Any], Any]) -> GGUFTokenizer:
        """`kv(key, default)` reads GGUF metadata (e.g. `ModelLayout.kv`)."""
        model = kv("tokenizer.ggml.model", None)
        if model is None:
            raise TokenizerError("the file has no tokenizer (no tokenizer.ggml.model key)")
        if model not in TOKENIZER_MODELS:
            raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r} "
                                 f"(supported: {', '.join(TOKENIZER_MODELS)})")
        tokens = kv("tokenizer.ggml.tokens", None)
        if not tokens:
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens")
        tokens, types = list(tokens), kv("tokenizer.ggml.token_type", None)
        types = [int(t) for t in types] if types is not None else None
        if model == "llama":
            return cls._spm(kv, tokens, types)
        return cls._bpe(kv, tokens, types)

    @classmethod
    def _bpe(cls, kv: Callable[[str, Any], Any], tokens: list[str], types: list[int] | None) -> GGUFTokenizer:
        merges = kv("tokenizer.ggml.merges", None)
        if merges is None:
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.merges (a 'gpt2' vocabulary needs them)")
        pre = str(kv("tokenizer.ggml.pre", "default"))
        tok, spec = build_bpe(tokens, list(merges), types, pre), PRE_TOKENIZERS[pre]
        n = len(tokens)
        return cls._finish(kv, tok, "gpt2", types, _opt_id(kv, "tokenizer.ggml.bos_token_id", None, n),
                           _opt_id(kv, "tokenizer.ggml.eos_token_id", None, n), spec.add_bos, space_prefix=False)

    @classmethod
    def _spm(cls, kv: Callable[[str, Any], Any], tokens: list[str], types: list[int] | None) -> GGUFTokenizer:
        scores = kv("tokenizer.ggml.scores", None)
        prefix = bool(kv("tokenizer.ggml.add_space_prefix", True))
        tok = build_spm(tokens, None if scores is None else [float(s) for s in scores], types, prefix)
        n = len(tokens)  # llama.cpp's SentencePiece defaults: <unk> 0, <s> 1, </s> 2, BOS added
        out = cls._finish(kv, tok, "llama", types, _opt_id(kv, "tokenizer.ggml.bos_token_id", 1, n),
                          _opt_id(kv, "tokenizer.ggml.eos_token_id", 2, n), True, space_prefix=prefix)
        out.piece_bytes = spm_piece_bytes(tokens, types or [TokenType.NORMAL] * n)
        return out

    @classmethod
    def _finish(cls, kv: Callable[[str, Any], Any], tok: Tokenizer, model: str, types: list[int] | None,
                bos: int | None, eos: int | None, add_bos_default: bool, space_prefix: bool) -> GGUFTokenizer:
        eot = kv("tokenizer.ggml.eot_token_id", None)
        stops = {int(i) for i in (eos, eot) if i is not None}
        pad = kv("tokenizer.ggml.padding_token_id", None)
        never, special = _hidden_ids(types, model)
        add_bos = bool(kv("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
        return cls(tok, bos, eos, add_bos, kv("tokenizer.chat_template", None), frozenset(stops),
                   int(pad if pad is not None else (eos if eos is not None else 0)), model, never, special,
                   space_prefix)

    @classmethod
    def from_layout(cls, layout: ModelLayout) -> GGUFTokenizer:
        return cls.from_metadata(layout.kv)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special: bool = True, lstrip: bool = False) -> str:
        """The text of `ids`: CONTROL/UNKNOWN tokens only when not `skip_special`, UNUSED ones never.

        A SentencePiece vocabulary spells a word's leading space into its token (`▁Paris`); it is
        kept, so a continuation printed after its prompt reads " Paris" (llama.cpp's
        token_to_piece). `lstrip` drops the one space encode's prefix added before the text."""
        hidden = self._skipped if skip_special else self.never_rendered
        kept = [i for i in ids if i not in hidden] if hidden else list(ids)
        if self.piece_bytes is None:
            text = self.tokenizer.decode(kept, skip_special_tokens=False)
        else:  # one U+FFFD per invalid sequence: a prefix decodes as the start of the whole (streaming)
            text = b"".join(self.piece_bytes[i] for i in kept if 0 <= i < len(self.piece_bytes)).decode(
                "utf-8", errors="replace")
        return text[1:] if lstrip and self.space_prefix and text.startswith(" ") else text

    def token_text(self, idx: int) -> str | None:
        return self.tokenizer.id_to_token(idx)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The model's chat template (jinja2, sandboxed) applied to `messages` (and `tools`, OpenAI's
        list, for templates with a tools section; left undefined when None, as transformers does)."""
        if not self.chat_template:
            raise TokenizerError("this model has no tokenizer.chat_template; prompt it without --chat")
        extra = {"tools": tools} if tools is not None else {}
        return _render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self._text(self.bos_id), eos_token=self._text(self.eos_id), **extra)

    def _text(self, idx: int | None) -> str:
        return "" if idx is None else (self.token_text(idx) or "")


def _raise(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _render(template: str, **context: Any) -> str:
    import json

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template).render(**context)
    except TemplateError as e:
        raise TokenizerError(f"chat template failed to render: {e}") from None
