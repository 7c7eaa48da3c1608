"""The umT5 tokenizer: every source form loads the same vocabulary and gives the same ids,
prompts become exactly 512 ids with EOS kept, and unusable sources fail with clear errors."""

import json

import pytest
import sentencepiece
import torch
from tokenizers import Tokenizer

from wan_enhanced.wan import tiny_tokenizer
from wan_enhanced.wan.t5 import UMT5Encoder
from wan_enhanced.wan.tokenizer import EOS_ID, PAD_ID, UMT5Tokenizer, clean_prompt

SENTENCES = [
    "A cat walks through the park, slow motion.",
    "The quick brown fox jumps over the lazy dog 1234!",
    "Un chat marche dans la forêt près du château.",
    "Ein alter Mann läuft über die Straße im Regen.",
    "El perro corre hacia la montaña por la mañana.",
    "Cafe\u0301 au lait, e\u0301te\u0301 (decomposed accents)",
    "Кошка идёт по улице ночью.",
    "一只猫在公园里散步。",
    "猫が公園で歩いている。",
    "漢字とカタカナ、未知の文字",
    "   extra   spaces\tand\nnewlines   ",
    "Tom &amp; Jerry &lt;3 &amp;amp; friends &quot;quoted&quot;",
    "full-width ＡＢＣ and ligature ﬁsh, ① ½ ™",
    "emoji 😀 and symbols @#$%^&*",
    "",
]


@pytest.fixture(scope="module")
def spiece_bytes():
    return tiny_tokenizer.build_spiece_model()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, spiece_bytes):
    root = tmp_path_factory.mktemp("tokenizers")
    tiny_tokenizer.write_tokenizer_folder(root / "both")
    tiny_tokenizer.write_tokenizer_folder(root / "spm_only", tokenizer_json=False)
    tiny_tokenizer.write_tokenizer_folder(root / "json_only", spiece=False)
    # a Wan checkpoint folder keeps the tokenizer under google/umt5-xxl/
    tiny_tokenizer.write_tokenizer_folder(root / "Wan2.1-T2V-1.3B" / "google" / "umt5-xxl")
    (root / "renamed.model").write_bytes(spiece_bytes)
    return root


def _all_sources(folders, spiece_bytes) -> dict[str, UMT5Tokenizer]:
    return {
        "folder (tokenizer.json preferred)": UMT5Tokenizer.from_path(folders / "both"),
        "folder, spiece.model only": UMT5Tokenizer.from_path(folders / "spm_only"),
        "folder, tokenizer.json only": UMT5Tokenizer.from_path(folders / "json_only"),
        "checkpoint folder": UMT5Tokenizer.from_path(folders / "Wan2.1-T2V-1.3B"),
        "spiece.model file": UMT5Tokenizer.from_path(folders / "both" / "spiece.model"),
        "tokenizer.json file": UMT5Tokenizer.from_path(folders / "both" / "tokenizer.json"),
        "any .model file": UMT5Tokenizer.from_path(folders / "renamed.model"),
        "bytes": UMT5Tokenizer.from_spiece_bytes(spiece_bytes),
        "uint8 tensor": UMT5Tokenizer.from_spiece_bytes(
            torch.frombuffer(bytearray(spiece_bytes), dtype=torch.uint8)),
    }


def test_all_sources_agree(folders, spiece_bytes):
    sources = _all_sources(folders, spiece_bytes)
    assert sources["folder (tokenizer.json preferred)"].source.endswith("tokenizer.json")
    assert sources["checkpoint folder"].source.endswith("tokenizer.json")
    expected_ids, expected_mask = sources["bytes"](SENTENCES)
    assert expected_ids.shape == (len(SENTENCES), 512) and expected_ids.dtype == torch.int64
    for name, tokenizer in sources.items():
        assert tokenizer.vocab_size == 200, name
        ids, mask = tokenizer(SENTENCES)
        assert torch.equal(ids, expected_ids), name
        assert torch.equal(mask, expected_mask), name


def test_spiece_and_tokenizer_json_agree_on_raw_text(spiece_bytes):
    """Without the prompt cleaning too: the written tokenizer.json reproduces sentencepiece's
    normalisation (nmt_nfkc char map, whitespace handling, dummy prefix) and unigram search."""
    processor = sentencepiece.SentencePieceProcessor(model_proto=spiece_bytes)
    converted = Tokenizer.from_str(tiny_tokenizer.tokenizer_json_from_spiece(spiece_bytes))
    for text in SENTENCES + [" leading", "trailing ", "a  \u3000  b", "\xa0nbsp\xa0"]:
        assert processor.encode(text) == converted.encode(text, add_special_tokens=False).ids, text
    # the post-processor appends EOS like the release's tokenizer.json
    assert converted.encode("a cat").ids[-1] == EOS_ID


def test_literal_special_tokens_are_where_the_forms_differ(spiece_bytes):
    """tokenizer.json (what the official pipeline reads) turns the text "</s>" into the EOS id;
    sentencepiece never produces control ids from text and spells it out."""
    processor = sentencepiece.SentencePieceProcessor(model_proto=spiece_bytes)
    converted = Tokenizer.from_str(tiny_tokenizer.tokenizer_json_from_spiece(spiece_bytes))
    assert EOS_ID in converted.encode("a </s> b", add_special_tokens=False).ids
    assert EOS_ID not in processor.encode("a </s> b")


def test_spiece_model_is_deterministic_and_umt5_shaped():
    first = tiny_tokenizer.build_spiece_model(150)
    tiny_tokenizer.build_spiece_model.cache_clear()
    assert tiny_tokenizer.build_spiece_model(150) == first
    processor = sentencepiece.SentencePieceProcessor(model_proto=first)
    assert processor.get_piece_size() == 150
    assert (processor.pad_id(), processor.eos_id(), processor.unk_id(), processor.bos_id()) == (
        0, 1, 2, -1)
    assert len(tiny_tokenizer.corpus_sentences()) >= 300
    with pytest.raises(ValueError, match="below"):
        tiny_tokenizer.build_spiece_model(50)
    with pytest.raises(ValueError, match="cannot train"):
        tiny_tokenizer.build_spiece_model(5000)


def test_padding_to_512_with_eos(spiece_bytes):
    tokenizer = UMT5Tokenizer.from_spiece_bytes(spiece_bytes)
    tokens = tokenizer.encode("A cat walks through the park.")
    ids, mask = tokenizer("A cat walks through the park.")
    n = len(tokens)
    assert ids.shape == mask.shape == (1, 512) and mask.dtype == torch.int64
    assert ids[0, :n].tolist() == tokens and ids[0, n] == EOS_ID
    assert (ids[0, n + 1:] == PAD_ID).all()
    assert mask[0, :n + 1].sum() == n + 1 and mask[0, n + 1:].sum() == 0
    empty_ids, empty_mask = tokenizer("")
    assert empty_ids[0, 0] == EOS_ID and empty_mask.sum() == 1


def test_truncation_keeps_eos_last(spiece_bytes):
    tokenizer = UMT5Tokenizer.from_spiece_bytes(spiece_bytes)
    long_text = " ".join(tiny_tokenizer.corpus_sentences()[:80])
    tokens = tokenizer.encode(long_text)
    assert len(tokens) > 600
    ids, mask = tokenizer([long_text, "short"])
    assert ids.shape == (2, 512)
    assert ids[0, :511].tolist() == tokens[:511] and ids[0, 511] == EOS_ID
    assert mask[0].sum() == 512 and mask[1].sum() < 10
    short_ids, _ = UMT5Tokenizer.from_spiece_bytes(spiece_bytes, length=16)(long_text)
    assert short_ids.shape == (1, 16) and short_ids[0, -1] == EOS_ID


def test_prompt_cleaning():
    assert clean_prompt("  Tom &amp;amp; Jerry \t\n\u3000 run  ") == "Tom & Jerry run"
    assert clean_prompt("cafÃ©") == "café"  # mojibake repaired
    assert clean_prompt("a\u2003\u00a0\u2028b") == "a b"


def test_ids_feed_the_encoder(spiece_bytes):
    tokenizer = UMT5Tokenizer.from_spiece_bytes(spiece_bytes)
    ids, mask = tokenizer(["A cat walks.", "一只猫在公园里散步。"])
    torch.manual_seed(0)
    encoder = UMT5Encoder(vocab_size=256, dim=32, dim_attn=32, dim_ffn=64, num_heads=4,
                          num_layers=1).eval()
    with torch.no_grad():
        hidden = encoder(ids, mask)
        alone = encoder(ids[1:], mask[1:])
        changed = ids.clone()
        first_pad = int(mask[0].sum())
        changed[0, first_pad + 3] = 7  # a token behind the mask
        masked = encoder(changed, mask)
    assert hidden.shape == (2, 512, 32)
    # each prompt is encoded on its own: batching does not mix them
    assert torch.allclose(hidden[1], alone[0], atol=1e-5)
    # the two prompts' real tokens give different states
    assert not torch.allclose(hidden[0, :first_pad], hidden[1, :first_pad], atol=1e-3)
    # ids behind the mask do not reach the real tokens' states
    assert torch.allclose(masked[0, :first_pad], hidden[0, :first_pad], atol=1e-6)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        UMT5Tokenizer.from_path(tmp_path / "nothing-here")


def test_folder_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json or spiece.model in {tmp_path}"):
        UMT5Tokenizer.from_path(tmp_path)


def test_unreadable_files(tmp_path):
    broken_model = tmp_path / "spiece.model"
    broken_model.write_bytes(b"\x00\x01 definitely not a model")
    with pytest.raises(ValueError, match="spiece.model: not a readable sentencepiece model"):
        UMT5Tokenizer.from_path(broken_model)
    broken_json = tmp_path / "tokenizer.json"
    broken_json.write_text('{"version": ')
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizer.json"):
        UMT5Tokenizer.from_path(tmp_path)  # the folder prefers tokenizer.json
    with pytest.raises(ValueError, match="empty sentencepiece model"):
        UMT5Tokenizer.from_spiece_bytes(b"")
    with pytest.raises(ValueError, match="not a readable sentencepiece model"):
        UMT5Tokenizer.from_spiece_bytes(b"\x08\x96\x01garbage")


def test_foreign_vocabulary_is_refused(tmp_path):
    from tokenizers import models

    other = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    path.write_text(other.to_str())
    json.loads(path.read_text())
    with pytest.raises(ValueError, match="not a umT5 vocabulary"):
        UMT5Tokenizer.from_path(path)
