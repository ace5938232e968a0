"""Grammar-constrained decoding with llguidance: JSON (any object, or one JSON schema) and the
tool-call grammars of `serve/http/tools.py`, as a token mask applied to one sequence's logits.

Why llguidance (PyPI `llguidance`): one abi3 wheel with no dependencies (a Rust core, no
compiler, no CUDA, no transformers), masks in ~50 us a token, JSON schema and Lark grammars,
and it is the engine vLLM, SGLang and llama.cpp use. xgrammar was the alternative; its wheel
pulls transformers and a TVM runtime.

A `Constraint` is per sequence (its matcher holds the parse state); the `GrammarBook` builds
the tokenizer view once per model and compiles grammars (checked at request time, so a bad
schema is the request's 400, not the engine's failure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .tokenizer import GGUFTokenizer

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a weak model cannot spend its budget on spaces


class GrammarError(ValueError):
    """A grammar (schema, tool list) the engine cannot compile; the message names what is wrong."""


def json_schema_grammar(schema: Any) -> str:
    import llguidance

    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"JSON schema: {e}") from None


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarBook:
    """The model's tokenizer as llguidance sees it, and grammar checking against it."""

    def __init__(self, tok: GGUFTokenizer, n_vocab: int | None = None):
        import llguidance

        # the tokenizers-library JSON of our GGUF-built tokenizer: llguidance reads every token's
        # bytes from it (byte-level BPE and SentencePiece byte fallback alike); `n_vocab`: the
        # model's logits width, often padded past the tokenizer's last token (never allowed)
        self.vocab_size = max(tok.vocab_size, n_vocab or 0)
        self.stop_ids = sorted(tok.stop_ids)
        self.lltok = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=self.vocab_size,
                                            eos_token=self.stop_ids or None)

    def check(self, grammar: str) -> None:
        """Raise GrammarError naming the problem if `grammar` does not compile."""
        import llguidance

        bad, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if bad:
            raise GrammarError(msgs[0] if msgs else "grammar does not compile")

    def constraint(self, grammar: str) -> Constraint:
        import llguidance

        m = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return Constraint(m, self.vocab_size)


@dataclass
class Constraint:
    """One sequence's parse state: which tokens may come next, and what was accepted."""

    matcher: Any  # llguidance.LLMatcher
    vocab_size: int

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] (float32, cpu) with every token the grammar forbids at -inf."""
        # (not llguidance.torch: its import compiles a kernel we do not need for one row)
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(V / 32)]
        allowed = unpack_bits(words, logits.shape[-1])  # [<= V] bool
        out = torch.full_like(logits, float("-inf"))  # a logit past the grammar's vocabulary stays banned
        out[:, :allowed.shape[0]] = logits[:, :allowed.shape[0]].masked_fill(~allowed, float("-inf"))
        return out

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it (it never should)."""
        return bool(self.matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (no stop token needed)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """llguidance's bitmask (int32 words, bit i of word w = token 32w + i) as [n] bool."""
    shifts = torch.arange(32, dtype=torch.int32)  # [32]
    bits = (words[:, None] >> shifts) & 1  # [W, 32]
    return bits.reshape(-1)[:n].bool()


def schema_of(response_format: dict) -> str:
    """The grammar of an OpenAI `response_format` (json_object or json_schema); text -> ""."""
    kind = response_format.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
            raise GrammarError("response_format.json_schema must be an object with a schema")
        return json_schema_grammar(spec.get("schema", {"type": "object"}))
    raise GrammarError(f"response_format.type must be text, json_object or json_schema, got {json.dumps(kind)}")
