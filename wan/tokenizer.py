"""The umT5 tokenizer as the Wan pipelines use it: clean the prompt, encode, append EOS, pad or
truncate to exactly 512 tokens, return ids and mask.

Three sources load the same vocabulary: a sentencepiece model file (`spiece.model`), a tokenizer
folder as the release ships it (`google/umt5-xxl/` with `tokenizer.json` and/or `spiece.model`;
`tokenizer.json` is preferred, since the official pipeline reads that one), and the raw bytes of a
sentencepiece model (ComfyUI's text-encoder files embed them as a uint8 tensor `spiece_model`).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import torch

PAD_ID = 0
EOS_ID = 1
TEXT_LEN = 512

# The Unicode White_Space characters: what `\s` means in the `regex` module the official cleaning
# uses (the standard `re` would also match \x1c-\x1f).
_WHITESPACE_RUN = re.compile(
    "[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+")

_FOLDER_FILES = ("tokenizer.json", "spiece.model")
# where a Wan checkpoint folder keeps its tokenizer
_RELEASE_SUBFOLDER = Path("google") / "umt5-xxl"


def clean_prompt(text: str) -> str:
    """The official prompt cleaning: fix mojibake, unescape HTML twice, collapse whitespace."""
    import ftfy

    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE_RUN.sub(" ", text).strip()


class _SentencePieceBackend:

    def __init__(self, processor):
        self._processor = processor

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def piece(self, index: int) -> str | None:
        size = self._processor.get_piece_size()
        return self._processor.id_to_piece(index) if 0 <= index < size else None

    def vocab_size(self) -> int:
        return self._processor.get_piece_size()


class _TokenizersBackend:

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        # EOS is appended by UMT5Tokenizer, the same way for both backends
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def piece(self, index: int) -> str | None:
        return self._tokenizer.id_to_token(index)

    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)


def _sentencepiece_from_bytes(data: bytes, source: str) -> _SentencePieceBackend:
    import sentencepiece

    if not data:
        raise ValueError(f"{source}: empty sentencepiece model")
    try:
        processor = sentencepiece.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, OSError, TypeError) as exc:
        raise ValueError(f"{source}: not a readable sentencepiece model ({exc})") from exc
    return _SentencePieceBackend(processor)


def _tokenizers_from_file(path: Path) -> _TokenizersBackend:
    from tokenizers import Tokenizer

    try:
        return _TokenizersBackend(Tokenizer.from_file(str(path)))
    except Exception as exc:  # the Rust side raises plain Exception for any parse error
        raise ValueError(f"{path}: not a readable tokenizer.json ({exc})") from exc


def _find_in_folder(folder: Path) -> Path:
    for candidate_folder in (folder, folder / _RELEASE_SUBFOLDER):
        for name in _FOLDER_FILES:
            if (candidate_folder / name).is_file():
                return candidate_folder / name
    raise FileNotFoundError(
        f"no tokenizer.json or spiece.model in {folder} (nor in {folder / _RELEASE_SUBFOLDER})")


def _to_bytes(data) -> bytes:
    if isinstance(data, torch.Tensor):
        return data.detach().cpu().contiguous().numpy().tobytes()
    if hasattr(data, "tobytes"):  # numpy arrays, memoryviews
        return data.tobytes()
    return bytes(data)


class UMT5Tokenizer:
    """Prompts -> (ids, mask), both int64 [B, length], as the official Wan pipeline makes them.

    Each prompt is cleaned, encoded without special tokens, cut to length - 1 tokens, ended with
    EOS (id 1) and padded with id 0; mask is 1 on the tokens and the EOS, 0 on the padding.
    """

    def __init__(self, backend, source: str, length: int = TEXT_LEN):
        if length < 1:
            raise ValueError(f"length must be at least 1 (room for EOS), got {length}")
        self._backend = backend
        self.source = source
        self.length = length
        self._check_special_ids()

    def _check_special_ids(self):
        found = {i: self._backend.piece(i) for i in (PAD_ID, EOS_ID)}
        if found != {PAD_ID: "<pad>", EOS_ID: "</s>"}:
            raise ValueError(f"{self.source}: not a umT5 vocabulary: ids 0 and 1 are "
                             f"{found[PAD_ID]!r} and {found[EOS_ID]!r}, "
                             f"expected '<pad>' and '</s>'")

    @classmethod
    def from_path(cls, path: str | Path, length: int = TEXT_LEN) -> "UMT5Tokenizer":
        """A sentencepiece `.model` file, a `tokenizer.json`, or a folder holding either (also a
        Wan checkpoint folder, whose tokenizer is under google/umt5-xxl/)."""
        path = Path(path)
        if path.is_dir():
            path = _find_in_folder(path)
        elif not path.is_file():
            raise FileNotFoundError(
                f"{path}: no such tokenizer (expected a sentencepiece .model file, a "
                f"tokenizer.json, or a folder with tokenizer.json or spiece.model)")
        if path.suffix == ".json":
            return cls(_tokenizers_from_file(path), str(path), length)
        return cls(_sentencepiece_from_bytes(path.read_bytes(), str(path)), str(path), length)

    @classmethod
    def from_spiece_bytes(cls, data, length: int = TEXT_LEN) -> "UMT5Tokenizer":
        """From a serialized sentencepiece model: bytes, or a uint8 tensor/array holding them."""
        raw = _to_bytes(data)
        source = f"<sentencepiece model, {len(raw)} bytes>"
        return cls(_sentencepiece_from_bytes(raw, source), source, length)

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of the cleaned prompt, without EOS, padding or truncation."""
        return self._backend.encode(clean_prompt(text))

    def __call__(self, texts: str | list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(texts, str):
            texts = [texts]
        ids = torch.full((len(texts), self.length), PAD_ID, dtype=torch.int64)
        mask = torch.zeros((len(texts), self.length), dtype=torch.int64)
        for row, text in enumerate(texts):
            tokens = self.encode(text)[:self.length - 1] + [EOS_ID]
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, :len(tokens)] = 1
        return ids, mask
