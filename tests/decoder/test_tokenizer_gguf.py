"""Tokenizers from GGUF metadata, both kinds llama.cpp writes, against independent references.

For each kind a reference tokenizer is trained here, written into a GGUF the way llama.cpp's
convert_hf_to_gguf.py writes it, and ours is rebuilt from that file alone:

- `llama` (SentencePiece): a real SentencePiece BPE model (the `sentencepiece` library, byte
  fallback, identity normalization as Llama/Mistral). Ids and text must equal SentencePiece's own.
- `gpt2` (byte-level BPE), one per `tokenizer.ggml.pre` family: a `tokenizers` BPE whose
  normalizer / pre-tokenizer / model options are written as that model's hub `tokenizer.json`
  spells them (not taken from `decoder.tokenizer`); ids and text must equal it.

Where transformers' GGUF loader (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, its own
conversion of the vocabulary) supports the variant, its ids must agree too.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import gguf
import pytest
from gguf import GGUFReader, TokenType
from moestream.decoder.generation.loop import TextStream
from moestream.decoder.generation.tokenizer import PRE_TOKENIZERS, GGUFTokenizer, TokenizerError
from tokenizers import AddedToken, Tokenizer, pre_tokenizers, trainers

TEXTS = [
    "Hello world, this is a test. I'M here, don't SHOUT; it's they'll we'd you've",
    "你好，世界！这是一个测试。日本語のテキストとカタカナ、ひらがな。",
    "مرحبا بالعالم، هذا اختبار للنص العربي.",
    "Привет, мир! Это тест кириллицы: ЁЖИК и ёжик.",
    "नमस्ते दुनिया, यह देवनागरी लिपि का परीक्षण है।",
    "emoji 🙂 👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 and 🇯🇵 ok",
    "a   b    c\t\td\r\n  indented\n\n\n   trailing   ",
    "def f(x):\n\treturn x ** 2  # 12345 and 3.14159\n\nclass A:\n    pass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; } // C++ 2024-12-01",
    "héllo wörld — naïve café, résumé",
    "caf\u0065\u0301 vs caf\u00e9",  # decomposed é: NFC variants fold it
    # where the splits differ: contractions, case changes, digit runs, CJK next to Latin, marks, slashes
    "it's what they'd said: don't, isn't; I'M SURE you've",
    "getElementById(parseJSON) XMLHttpRequest HTTPServer camelCase",
    "see path/to/file.py and obj.method().append(1234567) or $1,299.99",
    "abc你好def 東京Tokyo タワーtower",
    "مَرْحَبًا हिन्दी किताब",
    "",
]
CORPUS_SENTENCES = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "我们今天学习中文，世界很大，测试文本用于训练分词器。东京是日本的首都。",
    "ひらがなとカタカナを使った日本語の文章です。テキストを学習します。",
    "العالم كبير والنص العربي جميل، نحن نتعلم اللغة كل يوم.",
    "Мир большой, мы изучаем русский язык и пишем тесты каждый день.",
    "दुनिया बड़ी है, हम हर दिन हिंदी भाषा सीखते हैं और परीक्षण लिखते हैं।",
    "Numbers like 2024, 3.14 and 1000000 appear; emoji 🙂 appear too.",
    "isn't it? don't, won't, can't; I'm sure you're right and we'll see what they've done, it's theirs.",
    "getElementById setTimeout XMLHttpRequest parseJSON camelCase snake_case HTTPServer JSONDecoder",
    "path/to/file.py ./run.sh --flag=value obj.method().append(x) self.assertEqual(a, b) os.path.join",
    "Call 1234567 or 12345678901, pay $1,299.99 by 2024-12-01 at 10:30.",
    "abc你好def東京Tokyo東京タワーtower你好world",
    "नमस्ते नमस्ते हिन्दी किताब मिन्दी",
    "مَرْحَبًا بِكُمْ يَا أَصْدِقَاء",
]


def corpus(max_bytes: int = 150_000) -> list[str]:
    """Multilingual sentences plus a slice of the stdlib's own source (code, whitespace runs)."""
    out, total = [s for s in CORPUS_SENTENCES for _ in range(50)], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            out.append(line)
            total += len(line)
        if total > max_bytes:
            return out
    return out


def write_vocab(path: Path, arch: str, keys: dict) -> Path:
    """A GGUF holding only tokenizer metadata (no tensors), as gguf-py writes it."""
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in keys.items():
        getattr(w, add)(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def from_file(path: Path) -> GGUFTokenizer:
    reader = GGUFReader(path)

    def kv(key, default=None):
        field = reader.get_field(key)
        return default if field is None else field.contents()

    return GGUFTokenizer.from_metadata(kv)


def streamed(tok: GGUFTokenizer, ids, pieces: list[str] | None = None) -> str:
    """The text `generate` prints for `ids`, token by token (TextStream), its pieces into `pieces`."""
    pieces = [] if pieces is None else pieces
    stream = TextStream(tok.decode, lambda _i, t: pieces.append(t))
    for i in ids:
        stream(0, i)
    stream.flush()
    return "".join(pieces)


def hf_gguf(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# -- llama: SentencePiece -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """(SentencePieceProcessor, GGUF path): Llama/Mistral trainer options, written as convert_hf_to_gguf does."""
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_prefix=str(d / "m"), model_type="bpe", vocab_size=1200,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<tool>"], control_symbols=["<ctl>"], minloglevel=2, num_threads=2)
    sp = spm.SentencePieceProcessor(model_file=str(d / "m.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(TokenType.UNKNOWN if sp.is_unknown(i) else TokenType.CONTROL if sp.is_control(i)
                     else TokenType.UNUSED if sp.is_unused(i) else TokenType.BYTE if sp.is_byte(i)
                     else TokenType.USER_DEFINED if tokens[-1] == "<tool>" else TokenType.NORMAL)
    pads = [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + 3)]  # embedding rows past the vocab
    keys = dict(add_tokenizer_model="llama", add_tokenizer_pre="default", add_token_list=tokens + pads,
                add_token_scores=scores + [-1000.0] * 3, add_token_types=types + [TokenType.UNUSED] * 3,
                add_unk_token_id=sp.unk_id(), add_bos_token_id=sp.bos_id(), add_eos_token_id=sp.eos_id(),
                add_add_bos_token=True, add_add_eos_token=False)
    return sp, write_vocab(d / "spm.gguf", "llama", keys)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_ids_and_text(sentencepiece_model, text):
    sp, path = sentencepiece_model
    ours = from_file(path)
    ids = ours.encode(text)
    assert ids[0] == sp.bos_id() and ids[1:] == sp.encode(text)
    assert ours.decode(ids, lstrip=True) == sp.decode(ids[1:]) == text
    assert ours.decode(ids) == " " * bool(text) + text  # a continuation keeps the word's space


def test_sentencepiece_matches_transformers_gguf(sentencepiece_model):
    """transformers' GGUF loader uses Metaspace(prepend_scheme="first"), which differs from
    SentencePiece and llama.cpp only on text that starts with a space (one ▁ fewer)."""
    _, path = sentencepiece_model
    ours, hf = from_file(path), hf_gguf(path)
    for text in (t for t in TEXTS if not t[:1].isspace()):
        assert ours.encode(text)[1:] == hf.encode(text, add_special_tokens=False), text


def test_sentencepiece_byte_fallback_streams(sentencepiece_model):
    """Token by token, byte-fallback pieces of one character come out as that character, whole."""
    _, path = sentencepiece_model
    ours = from_file(path)
    text = "emoji 👨‍👩‍👧‍👦 and ✓ mixed with 你好 and नमस्ते\n\tend"
    ids = ours.encode(text)[1:]
    assert any(ours.token_text(i).startswith("<0x") for i in ids)
    pieces: list[str] = []
    assert streamed(ours, ids, pieces) == ours.decode(ids) == " " + text
    assert all("\ufffd" not in p for p in pieces)


def test_sentencepiece_stray_bytes_stream_as_they_decode(sentencepiece_model):
    """A sampled model may emit byte tokens that are no valid UTF-8: the text printed token by
    token must still be the text of the whole (one U+FFFD per invalid sequence, as bytes.decode)."""
    _, path = sentencepiece_model
    ours = from_file(path)
    byte = {b: ours.tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0x6A, 0xA3, 0xE4, 0xF0, 0x9F)}
    word = ours.encode("hello")[1:]
    cases = {(byte[0x6A], byte[0xA3], *word): "j\ufffd hello", (byte[0xF0], byte[0x9F], *word, byte[0xE4]):
             "\ufffd hello\ufffd", (byte[0xE4], byte[0x6A]): "\ufffdj"}
    for seq, expected in cases.items():
        assert streamed(ours, seq) == ours.decode(list(seq)) == expected


def test_sentencepiece_special_tokens(sentencepiece_model):
    """As llama.cpp: control and user-defined tokens are matched whole, a ▁ starts each run of
    text after them; control/unknown are rendered only when asked, user-defined always, unused never."""
    sp, path = sentencepiece_model
    ours = from_file(path)
    ctl, tool, pad = sp.piece_to_id("<ctl>"), sp.piece_to_id("<tool>"), ours.vocab_size - 1
    ids = ours.encode("<ctl>call<tool>x</s>")
    assert ids == [sp.bos_id(), ctl, *sp.encode("call"), tool, *sp.encode("x"), sp.eos_id()]
    assert ours.decode(ids) == " call<tool> x"
    assert ours.decode(ids, skip_special=False) == "<s><ctl> call<tool> x</s>"
    assert ours.decode([*ids, pad, sp.unk_id()]) == " call<tool> x"
    assert ours.decode([pad, sp.unk_id()], skip_special=False) == "<unk>"
    assert pad not in ours.encode(ours.token_text(pad))


# -- gpt2: byte-level BPE, one per pre-tokenizer family ---------------------------------------
def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
_NFC = {"type": "NFC"}
# The split regexes as the models' tokenizer.json files write them (Llama-3, Qwen2, DeepSeek-V3,
# gpt-oss/o200k, Mistral tekken, GLM-4); StarCoder's as its Digits + ByteLevel pair.
_LLAMA3_JSON = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K_JSON = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
               "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
               "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
               "[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_TEKKEN_JSON = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
                "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|"
                " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_DEEPSEEK3_JSON = ["\\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+",
                   ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
                    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")]
# Kimi-K2 ships a tiktoken tokenizer: its `pat_str` as tokenization_kimi.py writes it (class intersection)
_KIMI_PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
_LLAMACPP_DEFAULT = ["[\\p{P}\\$\\+<=>\\^~\\|]+",
                     "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                     "\\p{N}+", "[0-9][0-9][0-9]"]  # llama.cpp's regex_exprs; no hub model uses it


def _qwen_regex(module: str) -> str:
    pytest.importorskip("transformers")
    import importlib

    return importlib.import_module(f"transformers.models.{module}").PRETOKENIZE_REGEX


# pre -> (normalizer, pre_tokenizer, ignore_merges) of the hub tokenizer.json
REFERENCES = {
    "gpt-2": lambda: (None, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
                      False),
    "llama-bpe": lambda: (None, {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_JSON), _BYTE_LEVEL]}, True),
    "qwen2": lambda: (_NFC, {"type": "Sequence", "pretokenizers": [
        _split(_qwen_regex("qwen2.tokenization_qwen2")), _BYTE_LEVEL]}, False),
    "qwen35": lambda: (_NFC, {"type": "Sequence", "pretokenizers": [
        _split(_qwen_regex("qwen3_5.tokenization_qwen3_5")), _BYTE_LEVEL]}, False),
    "deepseek-v3": lambda: ({"type": "Sequence", "normalizers": []}, {"type": "Sequence", "pretokenizers": [
        *map(_split, _DEEPSEEK3_JSON), _BYTE_LEVEL]}, False),
    "gpt-4o": lambda: (None, {"type": "Sequence", "pretokenizers": [_split(_O200K_JSON), _BYTE_LEVEL]}, False),
    "tekken": lambda: (None, {"type": "Sequence", "pretokenizers": [_split(_TEKKEN_JSON), _BYTE_LEVEL]}, True),
    "glm4": lambda: (None, {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_JSON), _BYTE_LEVEL]}, False),
    "kimi-k2": lambda: (None, {"type": "Sequence", "pretokenizers": [_split(_KIMI_PAT), _BYTE_LEVEL]}, False),
    "starcoder": lambda: (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}, False),
    "default": lambda: (None, {"type": "Sequence", "pretokenizers": [*map(_split, _LLAMACPP_DEFAULT), _BYTE_LEVEL]},
                        False),
}
TRANSFORMERS_GGUF_PRES = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "gpt-4o", "tekken")  # with its own split table
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<think>"


def _reference_tokenizer(pre: str) -> Tokenizer:
    normalizer, pre_tokenizer, ignore_merges = REFERENCES[pre]()
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": ignore_merges, "vocab": {}, "merges": []}}
    tok = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(USER_TOKEN, special=False, normalized=False)])
    return tok


def _write_gpt2(tok: Tokenizer, pre: str, path: Path) -> Path:
    """As convert_hf_to_gguf.py's `_set_vocab_gpt2`: added special -> CONTROL, other added ->
    USER_DEFINED, rows past the vocabulary -> UNUSED `[PAD<id>]`."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    types = [TokenType.NORMAL if t not in added else TokenType.CONTROL if added[t] else TokenType.USER_DEFINED
             for t in tokens]
    pads = [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + 3)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    keys = dict(add_tokenizer_model="gpt2", add_tokenizer_pre=pre, add_token_list=tokens + pads,
                add_token_types=types + [TokenType.UNUSED] * 3, add_token_merges=merges,
                add_bos_token_id=vocab["<|endoftext|>"], add_eos_token_id=vocab["<|im_end|>"],
                add_add_bos_token=False)
    return write_vocab(path, "qwen2", keys)


@pytest.fixture(scope="module", params=sorted(REFERENCES))
def byte_level(request, tmp_path_factory):
    pre = request.param
    ref = _reference_tokenizer(pre)
    return pre, ref, _write_gpt2(ref, pre, tmp_path_factory.mktemp("bpe") / f"{pre}.gguf")


def test_byte_level_ids_and_text(byte_level):
    pre, ref, path = byte_level
    ours = from_file(path)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n<think>ok</think>"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids, (pre, text)
        assert ours.decode(ids, skip_special=False) == ref.decode(ids, skip_special_tokens=False), (pre, text)
        if "<|" not in text and not (PRE_TOKENIZERS[pre].nfc and "\u0301" in text):
            assert ours.decode(ids) == text


def test_byte_level_matches_transformers_gguf(byte_level):
    """transformers' GGUF loader applies no NFC, so decomposed text is left out for qwen variants."""
    pre, _, path = byte_level
    if pre not in TRANSFORMERS_GGUF_PRES:
        pytest.skip(f"transformers' GGUF loader has no split for tokenizer.ggml.pre={pre!r}")
    ours, hf = from_file(path), hf_gguf(path)
    for text in TEXTS:
        if PRE_TOKENIZERS[pre].nfc and "\u0301" in text:
            continue
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), (pre, text)


def test_byte_level_special_tokens(byte_level):
    _, ref, path = byte_level
    ours = from_file(path)
    start, end, think = (ref.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", USER_TOKEN))
    pad = ours.vocab_size - 1
    ids = ours.encode("<|im_start|>a<think>b<|im_end|>")
    assert ids[0] == start and think in ids and ids[-1] == end
    assert ours.decode(ids) == "a<think>b"
    assert ours.decode([*ids, pad]) == "a<think>b"  # UNUSED rows never render
    assert ours.decode([*ids, pad], skip_special=False) == "<|im_start|>a<think>b<|im_end|>"
    assert pad not in ours.encode(ours.token_text(pad))


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def tiktoken_encode(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    """Kimi's own algorithm, written out: special tokens whole, the rest split by `pat_str` with the
    `regex` module (another engine than ours, class intersection in its V1 mode), then each piece's
    bytes merged pair by pair, lowest-ranked concatenation first, as tiktoken does."""
    regex = pytest.importorskip("regex")
    out: list[int] = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            out.append(specials[part])
            continue
        for piece in regex.findall(_KIMI_PAT, part, flags=regex.V1):
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 60))
                if parts[best] + parts[best + 1] not in ranks:
                    break
                parts[best:best + 2] = [parts[best] + parts[best + 1]]
            out.extend(ranks[p] for p in parts)
    return out


def test_kimi_k2_matches_a_tiktoken_style_reference(tmp_path):
    """Kimi-K2's tokenizer is tiktoken: ranks = the trained vocabulary's ids (merged tokens get their
    ids in merge order), the split its pat_str run by the `regex` module, not by Oniguruma."""
    ref = _reference_tokenizer("kimi-k2")
    ours = from_file(_write_gpt2(ref, "kimi-k2", tmp_path / "kimi.gguf"))
    to_byte = {c: b for b, c in _byte_chars().items()}
    vocab = ref.get_vocab(with_added_tokens=False)
    ranks = {bytes(to_byte[c] for c in tok): i for tok, i in vocab.items() if tok not in SPECIALS}
    specials = {t: ref.token_to_id(t) for t in SPECIALS}
    regex, split, spell = pytest.importorskip("regex"), ours.tokenizer.pre_tokenizer, _byte_chars()
    for text in TEXTS + ["<|im_start|>user\n东京Tokyo<|im_end|>\n", "ABCdefGHI 漢字かなカナ한국어 ÀÉÎ"]:
        assert ours.encode(text) == tiktoken_encode(text, ranks, specials), text
        if "<|" not in text:  # the split alone, piece for piece (in GPT-2's byte spelling)
            want = ["".join(spell[b] for b in p.encode()) for p in regex.findall(_KIMI_PAT, text, flags=regex.V1)]
            assert [p for p, _ in split.pre_tokenize_str(text)] == want, text


# -- errors ----------------------------------------------------------------------------------------
def _meta(**kv):
    return lambda key, default=None: kv.get(key, default)


def test_unsupported_model_lists_supported():
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.model 't5'.*supported: gpt2, llama"):
        GGUFTokenizer.from_metadata(_meta(**{"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}))


def test_unsupported_pre_lists_supported():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.pre": "bailingmoe"}
    with pytest.raises(TokenizerError, match=r"'bailingmoe'.*supported: .*deepseek-v3.*gpt-4o.*kimi-k2.*llama-bpe.*qwen2"):
        GGUFTokenizer.from_metadata(_meta(**meta))


def test_sentencepiece_without_byte_tokens_or_scores_is_named():
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"]}
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.scores"):
        GGUFTokenizer.from_metadata(_meta(**meta))
    meta.update({"tokenizer.ggml.scores": [0.0, 0.0], "tokenizer.ggml.token_type": [2, 1]})
    with pytest.raises(TokenizerError, match=r"lacks byte-fallback tokens \(256 missing, e.g. <0x00>\)"):
        GGUFTokenizer.from_metadata(_meta(**meta))


# -- the factory's vocabularies ----------------------------------------------------------------
@pytest.mark.parametrize(("arch", "kind", "model"), [("llama", None, "llama"), ("llama", "bpe", "gpt2"),
                                                      ("qwen3moe", "spm", "llama")])
def test_make_model_writes_the_vocabulary_kind(make_tiny_model, arch, kind, model):
    """Mixtral files (`--arch llama`) default to SentencePiece, as real ones; either kind on request."""
    from moestream.common.layout import ModelLayout

    path = make_tiny_model(arch=arch, tokenizer=kind) if kind else make_tiny_model(arch=arch)
    layout = ModelLayout(path)
    assert layout.kv("tokenizer.ggml.model", None) == model
    ours = GGUFTokenizer.from_layout(layout)
    assert ours.vocab_size == layout.hparams.n_vocab
    text = "def f(x):\n    return x  # héllo 你好 🙂"
    assert ours.decode(ours.encode(text), lstrip=True) == text
    if model == "llama":
        assert ours.add_bos and ours.encode(text)[0] == ours.bos_id
        assert ours.encode(text)[1:] == hf_gguf(path).encode(text, add_special_tokens=False)


def test_kimi_k2_file_tokenizes_as_kimi_and_generates(make_tiny_model, capsys):
    """A Kimi-K2-style file (deepseek2 weights, `tokenizer.ggml.pre = "kimi-k2"`, as llama.cpp's converter
    writes Kimi-K2): ids equal the tiktoken-style reference on the file's own vocabulary, and
    `generate` prints the decode of the ids it made."""
    from moestream.common.layout import ModelLayout
    from moestream.decoder import cli

    path = make_tiny_model(arch="deepseek2", tokenizer="kimi")
    layout = ModelLayout(path)
    assert layout.kv("tokenizer.ggml.pre") == "kimi-k2"
    ours = GGUFTokenizer.from_layout(layout)
    to_byte = {c: b for b, c in _byte_chars().items()}
    ranks, specials = {}, {}
    for i in range(ours.vocab_size):
        tok = ours.token_text(i)
        if tok.startswith("<|"):
            specials[tok] = i
        else:
            ranks[bytes(to_byte[c] for c in tok)] = i
    for text in TEXTS[:12]:
        assert ours.encode(text) == tiktoken_encode(text, ranks, {"<|im_end|>": specials["<|im_end|>"]}), text
    assert cli.main(["--model", str(path), "--prompt", "东京Tokyo 你好", "-n", "6", "--no-progress", "--resident",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"][0] == ours.decode(out["tokens"][0])


def test_make_model_rejects_unknown_tokenizer(tmp_path):
    from moestream.authoring.make_model import make_model

    with pytest.raises(ValueError, match=r"unknown tokenizer 'wordpiece' \(supported: bpe, spm, kimi\)"):
        make_model(tmp_path / "x.gguf", tokenizer="wordpiece")


def test_mixtral_sentencepiece_file_generates_the_same_text_both_ways(make_tiny_model, capsys):
    """`generate --resident` and `--iod` (a real daemon, a quarter of the experts cached) print the
    same text for a SentencePiece Mixtral file, and the streamed print is the decode of the ids."""
    from moestream.common.layout import ModelLayout
    from moestream.tools.spawn import spawn_daemon
    from moestream.decoder import cli

    path = make_tiny_model(arch="llama")
    args = ["--model", str(path), "--prompt", "Hello wörld, 你好 🙂", "-n", "12", "--no-progress"]
    assert cli.main([*args, "--resident"]) == 0
    printed = capsys.readouterr().out  # token by token
    with spawn_daemon(path, arena_slots=4) as daemon:
        assert cli.main([*args, "--iod", daemon.endpoint, "--json"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    tokens, text = streamed["tokens"][0], streamed["text"][0]
    assert printed == text + "\n" == GGUFTokenizer.from_layout(ModelLayout(path)).decode(tokens) + "\n"
