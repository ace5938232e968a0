"""The GGUF tokenizer against independent references.

References: Hugging Face's `Qwen2Tokenizer` built from the vocab and merges read straight
out of the file with gguf-py (its pre-tokenizer and normalizer are HF's, not ours), HF's own
chat-template renderer, and the factory's trained `tokenizers` JSON on plain prose.
"""

from __future__ import annotations

import pytest
from gguf import GGUFReader
from moestream.common.layout import ModelLayout
from moestream.decoder.generation.tokenizer import GGUFTokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world, this is a test.",
    "def f(x):\n\treturn x ** 2  # 12345 and 3.14159\n\n\n",
    "I'M here, don't SHOUT; it's they'll we'd you've",
    "héllo wörld — naïve café, 你好世界 🙂 ok",
    "a   b    c\r\n  indented\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "caf\u0065\u0301 vs caf\u00e9",  # NFC: decomposed and composed é encode alike
    "",
]


def _field(reader: GGUFReader, key: str):
    return reader.get_field(key).contents()


@pytest.fixture(scope="module")
def ours(tiny_model):
    return GGUFTokenizer.from_layout(ModelLayout(tiny_model))


@pytest.fixture(scope="module")
def reference(tiny_model):
    reader = GGUFReader(tiny_model)
    tokens, merges = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.merges")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    pairs = [tuple(m.split(" ")) for m in merges]  # byte-level tokens hold no real space
    ref = transformers.Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs)
    ref.add_tokens([transformers.AddedToken(t, special=True) for t, k in zip(tokens, types) if k == 3],
                   special_tokens=True)
    ref.chat_template = _field(reader, "tokenizer.chat_template")
    return ref


@pytest.mark.parametrize("text", TEXTS)
def test_matches_hf_qwen2_tokenizer(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special=False) == reference.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t and "\u0301" not in t])
def test_round_trip(ours, text):
    assert ours.decode(ours.encode(text)) == text


def test_special_tokens(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.tokenizer.token_to_id("<|im_start|>") and ids[-1] == ours.eos_id
    assert ours.decode(ids) == "user\nhi"  # specials skipped on output
    assert ours.eos_id in ours.stop_ids and not ours.add_bos


def test_plain_prose_matches_the_factory_tokenizer(ours, tiny_model):
    """On prose both pre-tokenizer regexes split alike, so the ids must equal the trained JSON's."""
    from moestream.authoring.tokenizer_data import get_tokenizer
    from tokenizers import Tokenizer

    trained: Tokenizer = get_tokenizer(ModelLayout(tiny_model).hparams.n_vocab)
    text = "The quick brown fox jumps over the lazy dog while reading the source of a module"
    assert ours.encode(text) == trained.encode(text, add_special_tokens=False).ids


def test_chat_template_matches_hf(ours, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    mine = ours.render_chat(messages)
    assert mine == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert mine.endswith("<|im_start|>assistant\n")


def test_unsupported_metadata_is_named():
    meta = {"tokenizer.ggml.model": "rwkv"}
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model 'rwkv'"):
        GGUFTokenizer.from_metadata(lambda k, d=None: meta.get(k, d))
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.pre": "mystery"}
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre 'mystery'"):
        GGUFTokenizer.from_metadata(lambda k, d=None: meta.get(k, d))
    meta["tokenizer.ggml.pre"] = "qwen2"
    with pytest.raises(TokenizerError, match=r"merges\[0\] = 'a b'"):  # "ab" is not a token
        GGUFTokenizer.from_metadata(lambda k, d=None: meta.get(k, d))
    meta["tokenizer.ggml.tokens"] = ["a", "b", "ab"]
    no_template = GGUFTokenizer.from_metadata(lambda k, d=None: meta.get(k, d))
    assert no_template.encode("ab") == [2]
    with pytest.raises(TokenizerError, match="no tokenizer.chat_template"):
        no_template.render_chat([{"role": "user", "content": "x"}])
