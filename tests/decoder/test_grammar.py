"""Grammar-constrained decoding (llguidance) on the shipped model's tokenizer, driven by random
logits: whatever the model would prefer, the masked choice is valid JSON for the schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

import moestream

MODEL = Path(moestream.__file__).parent / "data" / "tiny-qwen3moe-q8_0.gguf"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": -5, "maximum": 5},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    from moestream.common.layout import ModelLayout
    from moestream.decoder.generation.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_layout(ModelLayout(MODEL))


def sample(book, grammar: str, tok, width: int, seed: int, steps: int = 300) -> tuple[list[int], str]:
    c = book.constraint(grammar)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        logits = c.mask(torch.randn(1, width, generator=g) * 3)  # [1, width]
        assert torch.isinf(logits[0, book.vocab_size - (width > tok.vocab_size):]).all() or width == tok.vocab_size
        t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        if t in tok.stop_ids:
            return out, "stop"
        assert c.accept(t), c.error
        out.append(t)
        if c.finished:
            return out, "finished"
    return out, "length"


@pytest.mark.parametrize("seed", range(4))
def test_schema_constrained_sampling_gives_valid_json(tok, seed):
    from moestream.decoder.generation.grammar import GrammarBook, json_schema_grammar

    width = tok.vocab_size + 64  # logits padded past the tokenizer, as real models' often are
    book = GrammarBook(tok, width)
    out, how = sample(book, json_schema_grammar(SCHEMA), tok, width, seed)
    assert how in ("stop", "finished")
    assert max(out) < tok.vocab_size  # never a padding id
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


def test_a_bad_schema_is_a_grammar_error(tok):
    from moestream.decoder.generation.grammar import GrammarBook, GrammarError, json_schema_grammar

    with pytest.raises(GrammarError):
        GrammarBook(tok).check(json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/no"}}}))
    with pytest.raises(GrammarError):
        json_schema_grammar(["not", "a", "schema"])


def test_unpack_bits_reads_llguidance_words():
    from moestream.decoder.generation.grammar import unpack_bits

    words = torch.tensor([0b101, -2**31], dtype=torch.int32)  # bits 0 and 2; then bit 31 of word 1
    got = unpack_bits(words, 64).nonzero().flatten().tolist()
    assert got == [0, 2, 63]
