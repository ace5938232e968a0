"""Tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata with the `tokenizers` library.

Supported: byte-level BPE (`tokenizer.ggml.model = "gpt2"`), the family Qwen, OLMoE and
Llama-3 use. The pre-tokenizer split is chosen by `tokenizer.ggml.pre` from `PRE_TOKENIZERS`
(the same regexes llama.cpp and Hugging Face use); control tokens become special added tokens,
so `<|im_start|>` in a rendered chat template encodes as one id and decoding skips them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..authoring.tokenizer_data import QWEN2_SPLIT_REGEX, TOKEN_CONTROL, TOKEN_USER_DEFINED

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split regex or None for GPT-2's built-in one, NFC-normalize)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "qwen2": (QWEN2_SPLIT_REGEX, True),
    "llama-bpe": (_LLAMA3, False),
    "gpt-2": (None, False),
    "default": (None, False),
    "olmo": (None, False),
}


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing or of a kind this decoder does not build."""


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    regex, nfc = PRE_TOKENIZERS[pre]
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
    seq = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return seq, normalizers.NFC() if nfc else None


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


def build_bpe(tokens: list[str], merges: list[str], types: list[int] | None, pre: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` for a GGUF gpt2-style vocabulary."""
    pre_tokenizer, normalizer = _pre_tokenizer(pre)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.tokens has duplicate entries ({len(tokens) - len(vocab)})")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(merges, vocab), fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    types = types or []
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok


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

    @classmethod
    def from_metadata(cls, kv: Callable[[str, Any], Any]) -> "GGUFTokenizer":
        """`kv(key, default)` reads GGUF metadata (e.g. `ModelLayout.kv`)."""
        model = kv("tokenizer.ggml.model", None)
        if model != "gpt2":
            raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r}: only byte-level BPE ('gpt2') is built")
        tokens, merges = kv("tokenizer.ggml.tokens", None), kv("tokenizer.ggml.merges", None)
        if not tokens or merges is None:
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        tok = build_bpe(list(tokens), list(merges), kv("tokenizer.ggml.token_type", None),
                        str(kv("tokenizer.ggml.pre", "default")))
        bos, eos = kv("tokenizer.ggml.bos_token_id", None), kv("tokenizer.ggml.eos_token_id", None)
        stops = {int(i) for i in (eos, kv("tokenizer.ggml.eot_token_id", None)) if i is not None}
        pad = kv("tokenizer.ggml.padding_token_id", None)
        return cls(tok, None if bos is None else int(bos), None if eos is None else int(eos),
                   bool(kv("tokenizer.ggml.add_bos_token", False)), kv("tokenizer.chat_template", None),
                   frozenset(stops), int(pad if pad is not None else (eos if eos is not None else 0)))

    @classmethod
    def from_layout(cls, layout: Any) -> "GGUFTokenizer":
        return cls.from_metadata(layout.kv)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, idx: int) -> str | None:
        return self.tokenizer.id_to_token(idx)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's chat template (jinja2, sandboxed) applied to `messages`."""
        if not self.chat_template:
            raise TokenizerError("this model has no tokenizer.chat_template; prompt it without --chat")
        return _render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self._text(self.bos_id), eos_token=self._text(self.eos_id))

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
