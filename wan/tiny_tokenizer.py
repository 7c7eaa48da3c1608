"""A small umT5-style tokenizer built in memory, for tests, the demo and tiny checkpoints.

`build_spiece_model` trains a sentencepiece unigram model on a built-in multilingual corpus with
umT5's special ids (pad 0, eos 1, unk 2, no bos) and nmt_nfkc normalisation; training is single
threaded, so the same vocabulary size gives the same bytes every time. `write_tokenizer_json`
writes the equivalent HF `tokenizer.json`, so both forms the official release ships (spiece.model
and tokenizer.json) can be exercised without downloading anything.
"""

from __future__ import annotations

import functools
import io
import itertools
import struct
from pathlib import Path

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 200

# Phrase lists per language; sentences are their deterministic combinations. The character set
# is kept small (137 characters) so that vocabularies of 200 pieces still hold subwords; the
# corpus supports 140 to 327 pieces.
_PHRASES = {
    "en": (["a cat", "the dog", "an old man", "a young woman", "the red robot", "a small bird",
            "two children", "a white horse"],
           ["walks through", "looks at", "runs across", "sits near", "dances in", "flies over",
            "sleeps under", "waits beside"],
           ["the park", "a quiet street", "the dark forest", "the beach at sunset",
            "a busy market", "the snowy mountain", "an old bridge", "the city at night"],
           ["slow motion", "cinematic light", "close up shot", "soft rain falling",
            "golden hour", "wide angle view"]),
    "fr": (["un chat", "le chien", "une vieille femme", "un enfant", "la petite fille",
            "un oiseau"],
           ["marche dans", "regarde", "traverse", "danse près de", "dort sous", "attend devant"],
           ["la forêt", "une rue étroite", "le marché", "la plage à l'aube",
            "un café près de la gare", "le château"],
           ["lumière douce", "très lentement", "en été", "sous la pluie"]),
    "de": (["eine Katze", "der Hund", "ein alter Mann", "das Kind", "eine junge Frau"],
           ["läuft über", "schläft unter", "schaut auf", "tanzt vor", "wartet an"],
           ["die Straße", "den großen Baum", "das schöne Schloss", "die Brücke",
            "den grünen Wald"],
           ["im Regen", "bei Nacht", "in Zeitlupe", "im Winter"]),
    "es": (["un gato", "el perro", "una niña", "el viejo pescador", "un caballo"],
           ["camina por", "mira", "corre hacia", "duerme junto a", "baila en"],
           ["la montaña", "el río", "una ciudad pequeña", "la plaza", "el jardín"],
           ["por la mañana", "con música", "a cámara lenta", "bajo la lluvia"]),
    "ru": (["кошка", "собака", "старик", "девочка", "птица"],
           ["идёт по", "смотрит на", "бежит через", "спит у"],
           ["улице", "лесу", "реке", "городу", "дому"],
           ["ночью", "зимой", "медленно"]),
}
# Chinese and Japanese are written without spaces: subject + place + action.
_CJK = {
    "zh": (["一只猫", "小狗", "老人", "女孩", "小鸟"],
           ["在公园里", "在海边", "在城市中", "在雨中", "在山上"],
           ["散步", "看着天空", "跳舞", "睡觉", "奔跑"]),
    "ja": (["猫が", "犬が", "女の子が", "鳥が"],
           ["公園で", "海で", "町で", "雨の中で"],
           ["歩いている", "見ている", "走っている", "眠っている"]),
}


def corpus_sentences() -> list[str]:
    """A few hundred short prompt-like sentences in seven languages, always the same ones."""
    sentences = []
    for subjects, verbs, places, styles in _PHRASES.values():
        for i, (s, v, p) in enumerate(itertools.product(subjects, verbs, places)):
            if i % 3 == 0:  # a third of the combinations keeps the corpus small
                sentence = f"{s} {v} {p}, {styles[i % len(styles)]}."
                sentences.append(sentence[0].upper() + sentence[1:])
    for subjects, places, actions in _CJK.values():
        for s, p, a in itertools.product(subjects, places, actions):
            sentences.append(f"{s}{p}{a}。")
    return sentences


@functools.lru_cache(maxsize=4)
def build_spiece_model(vocab_size: int = DEFAULT_VOCAB_SIZE) -> bytes:
    """The serialized sentencepiece model (what `spiece.model` holds), trained on the corpus.

    pad=0, eos=1, unk=2 and no bos, like umT5; every corpus character is a piece, so text in the
    corpus languages needs no unknown token while characters outside it map to unk.
    """
    import sentencepiece as spm

    sentences = corpus_sentences()
    # every character is a piece (the space as "▁"), plus the three special pieces
    minimum = len(set("".join(sentences))) + 3
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is below {minimum}, the corpus characters "
                         f"plus the special pieces")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, model_type="unigram",
            vocab_size=vocab_size, character_coverage=1.0, normalization_rule_name="nmt_nfkc",
            pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1, num_threads=1,
            minloglevel=2)
    except RuntimeError as exc:  # sentencepiece reports a too-large vocabulary this way
        raise ValueError(f"cannot train a {vocab_size}-piece model on the built-in corpus: "
                         f"{exc}") from exc
    return model.getvalue()


# ---------------------------------------------------------------------------------------------
# Reading the model file. sentencepiece's Python API does not expose the normaliser settings,
# so the few fields needed are read straight from the protobuf wire format.

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes):
    """(field number, value) pairs of one protobuf message; value is int or bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(buf, pos)
        elif wire_type == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire_type == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire_type == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        yield number, value


def read_spiece_model(data: bytes) -> tuple[list[tuple[str, float, int]], dict]:
    """([(piece, score, type), ...], normaliser settings) of a serialized sentencepiece model."""
    pieces = []
    normalizer = {"precompiled_charsmap": b"", "add_dummy_prefix": True,
                  "remove_extra_whitespaces": True, "escape_whitespaces": True}
    normalizer_fields = {2: "precompiled_charsmap", 3: "add_dummy_prefix",
                         4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
    try:
        for number, value in _fields(data):
            if number == 1:  # SentencePiece {1: piece, 2: score, 3: type}
                entry = dict(_fields(value))
                score = struct.unpack("<f", entry[2])[0] if 2 in entry else 0.0
                pieces.append((entry[1].decode("utf-8"), score, entry.get(3, _NORMAL)))
            elif number == 3:  # NormalizerSpec
                for field, spec_value in _fields(value):
                    if field in normalizer_fields:
                        name = normalizer_fields[field]
                        normalizer[name] = spec_value if field == 2 else bool(spec_value)
    except (IndexError, KeyError, UnicodeDecodeError, struct.error) as exc:
        raise ValueError(f"not a sentencepiece model ({len(data)} bytes): {exc}") from exc
    if not pieces:
        raise ValueError(f"not a sentencepiece model ({len(data)} bytes): no pieces")
    return pieces, normalizer


def tokenizer_json_from_spiece(data: bytes) -> str:
    """The HF `tokenizer.json` text equivalent to a sentencepiece unigram model."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    pieces, spec = read_spiece_model(data)
    if not spec["escape_whitespaces"]:
        raise ValueError("sentencepiece models that keep raw spaces are not supported")
    unknown = [i for i, (_, _, kind) in enumerate(pieces) if kind == _UNKNOWN]
    if len(unknown) != 1:
        raise ValueError(f"expected one unknown piece, found {len(unknown)}")
    byte_fallback = any(kind == _BYTE for _, _, kind in pieces)
    tokenizer = Tokenizer(models.Unigram([(p, s) for p, s, _ in pieces], unk_id=unknown[0],
                                         byte_fallback=byte_fallback))

    steps = []
    if spec["precompiled_charsmap"]:
        steps.append(normalizers.Precompiled(spec["precompiled_charsmap"]))
    if spec["remove_extra_whitespaces"]:
        # sentencepiece drops leading/trailing spaces and collapses runs, after its char map
        steps += [normalizers.Replace(Regex(" {2,}"), " "),
                  normalizers.Replace(Regex(r"\A | \z"), "")]
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    scheme = "always" if spec["add_dummy_prefix"] else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)

    specials = [p for p, _, kind in pieces if kind in (_CONTROL, _UNKNOWN)]
    tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False)
                                  for p in specials])
    user_defined = [p for p, _, kind in pieces if kind == _USER_DEFINED]
    if user_defined:
        tokenizer.add_tokens([AddedToken(p, normalized=False) for p in user_defined])

    eos = [(p, i) for i, (p, _, kind) in enumerate(pieces) if p == "</s>" and kind == _CONTROL]
    if eos:
        piece, index = eos[0]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {piece}", pair=f"$A {piece} $B {piece}", special_tokens=[(piece, index)])
    return tokenizer.to_str(pretty=True)


def write_tokenizer_json(spiece_bytes: bytes, path: str | Path) -> Path:
    """Write the `tokenizer.json` equivalent of a sentencepiece model to `path`."""
    path = Path(path)
    path.write_text(tokenizer_json_from_spiece(spiece_bytes), encoding="utf-8")
    return path


def write_tokenizer_folder(folder: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE,
                           spiece: bool = True, tokenizer_json: bool = True) -> Path:
    """A tokenizer folder laid out like the release's `google/umt5-xxl/`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = build_spiece_model(vocab_size)
    if spiece:
        (folder / "spiece.model").write_bytes(data)
    if tokenizer_json:
        write_tokenizer_json(data, folder / "tokenizer.json")
    return folder
