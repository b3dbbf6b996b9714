"""Documents for a capture: decode uploads, tokenise, check limits, and the bundled sample documents.

Pure functions, no torch: the Streamlit process uses them to count tokens while the user edits the document set,
and the worker uses the same ``tokenize`` with the model's own tokenizer before it runs anything.

- ``decode_upload(name, data)`` → str; raises ``EmptyDocument`` (nothing but whitespace) or ``NotText`` (binary,
  or not UTF-8, with the byte offset of the first bad byte).
- ``check_text(name, text)`` → the text (stripped of a BOM), or ``EmptyDocument``.
- ``check_length(name, n_tokens, limit)`` raises ``DocumentTooLong`` with both numbers.
- ``load_fast_tokenizer(model_dir)`` → a ``tokenizers.Tokenizer`` from ``tokenizer.json`` (fast, no transformers).
- ``tokenize(tokenizer, text)`` → list[int] for either a ``tokenizers.Tokenizer`` or a transformers tokenizer,
  special tokens (BOS) included the way the model's tokenizer adds them.
- ``sample_documents()`` → the bundled public-domain texts in ``gdnviz/assets/samples/*.txt``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gdnviz import settings
from gdnviz.errors import BadTokenLimit, DocumentTooLong, EmptyDocument, NotText

SAMPLES_DIR = Path(__file__).resolve().parent / "assets" / "samples"
#: Bytes inspected for NUL bytes / control characters when deciding whether an upload is binary.
_SNIFF = 8192
_TEXT_CONTROL = {9, 10, 12, 13, 27}  # tab, newline, form feed, carriage return, escape


def max_tokens_default() -> int:
    """The per-document token limit the app starts with (``GDNVIZ_MAX_TOKENS``, ``gdnviz.settings``)."""
    return settings.get("GDNVIZ_MAX_TOKENS")


@dataclass(frozen=True)
class Document:
    """One document of a set: its display name and text (token ids are computed by whoever holds the tokenizer)."""

    name: str
    text: str


def check_text(name: str, text: str) -> str:
    """The text without a leading BOM; ``EmptyDocument`` when it holds nothing but whitespace."""
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise EmptyDocument(f"'{name}' is empty: paste some text or upload a .txt / .md file with content")
    return text


#: byte-order marks: (mark, encoding, byte order); UTF-32's first (its little-endian mark starts like UTF-16's)
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32", "little-endian"), (b"\x00\x00\xfe\xff", "UTF-32", "big-endian"),
         (b"\xff\xfe", "UTF-16", "little-endian"), (b"\xfe\xff", "UTF-16", "big-endian"))


def decode_upload(name: str, data: bytes) -> str:
    """Decode an uploaded file as UTF-8 text.

    Raises ``EmptyDocument`` for an empty or whitespace-only file and ``NotText`` for a UTF-16 / UTF-32 file (its
    byte-order mark; the message says how to convert it), a binary file (a NUL byte or many control characters
    near the start) or one that is not valid UTF-8, naming the byte offset.
    """
    if len(data) == 0:
        raise EmptyDocument(f"'{name}' is an empty file (0 bytes): upload a .txt or .md file with text in it")
    bom = next(((enc, order) for mark, enc, order in _BOMS if data.startswith(mark)), None)
    if bom is not None:
        enc, order = bom
        raise NotText(f"'{name}' is {enc} text (it starts with a {enc} {order} byte-order mark), not UTF-8: convert "
                      f"it with `iconv -f {enc} -t UTF-8 '{name}' > converted.txt` (or save it as UTF-8 in your "
                      "editor) and upload that")
    head = data[:_SNIFF]
    nul = head.find(b"\x00")
    if nul >= 0:
        raise NotText(f"'{name}' looks like a binary file (a NUL byte at byte offset {nul}), not text: upload a "
                      "UTF-8 .txt or .md file (convert PDFs and Word files to plain text first)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotText(f"'{name}' is not valid UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start} "
                      f"cannot be decoded ({e.reason}). Re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) "
                      "and upload it again") from None
    control = sum(1 for ch in text[:_SNIFF] if ord(ch) < 32 and ord(ch) not in _TEXT_CONTROL)
    if control > max(8, len(text[:_SNIFF]) // 20):
        first = next(i for i, ch in enumerate(text) if ord(ch) < 32 and ord(ch) not in _TEXT_CONTROL)
        raise NotText(f"'{name}' looks like a binary file ({control} control characters in its first "
                      f"{min(len(text), _SNIFF)} characters, the first at character {first}): upload plain text")
    return check_text(name, text)


def unique_name(name: str, taken) -> str:
    """``name``, or ``name (2)``, ``name (3)``, … : the first not in ``taken`` (names already in a document set)."""
    taken = set(taken)
    if name not in taken:
        return name
    k = 2
    while f"{name} ({k})" in taken:
        k += 1
    return f"{name} ({k})"


def check_token_limit(limit) -> int:
    """``limit`` (tokens per document) as a positive int, else ``BadTokenLimit`` naming it."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise BadTokenLimit(f"The token limit per document must be a positive integer, got {limit!r}.")
    return limit


def check_length(name: str, n_tokens: int, limit: int) -> None:
    """``DocumentTooLong`` when ``n_tokens`` exceeds ``limit``."""
    if n_tokens > limit:
        raise DocumentTooLong(f"'{name}' has {n_tokens:,} tokens, over the limit of {limit:,} tokens per document: "
                              f"shorten it (or split it into several documents), or raise the token limit if the "
                              f"device has the memory for it")


def load_fast_tokenizer(model_dir: str | os.PathLike):
    """``tokenizers.Tokenizer`` from ``model_dir/tokenizer.json``, or None when the checkpoint has none."""
    from tokenizers import Tokenizer

    p = Path(model_dir) / "tokenizer.json"
    if not p.exists():
        return None
    return Tokenizer.from_file(str(p))


def tokenize(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with the tokenizer's own special tokens (e.g. a BOS) added."""
    if tokenizer is None:
        raise ValueError("no tokenizer: this checkpoint has no tokenizer files (tokenizer.json) beside its weights")
    enc = tokenizer.encode(text)
    ids = getattr(enc, "ids", enc)
    return [int(i) for i in ids]


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token of a ``tokenizers.Tokenizer`` stands for: the longest vocabulary
    entry in UTF-8 (byte-level BPE writes a byte as a 1- or 2-byte character, so this over-counts, never under).
    A text of B bytes has at least B / max_token_bytes tokens."""
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1) or 1


def check_size(name: str, n_bytes: int, limit: int, bytes_per_token: int) -> None:
    """``DocumentTooLong`` when a file of ``n_bytes`` cannot fit ``limit`` tokens whatever its text (at most
    ``bytes_per_token`` bytes per token): checked before the file is decoded or tokenised."""
    least = -(-int(n_bytes) // int(bytes_per_token))
    if least > limit:
        raise DocumentTooLong(f"'{name}' is {n_bytes:,} bytes: at {bytes_per_token} bytes per token at most, that is "
                              f"at least {least:,} tokens, over the limit of {limit:,} tokens per document. Shorten "
                              "or split it, or raise the token limit if the device has the memory for it")


def sample_documents() -> list[Document]:
    """The bundled sample documents (public-domain texts), sorted by file name."""
    out = []
    for p in sorted(SAMPLES_DIR.glob("*.txt")):
        out.append(Document(name=p.name, text=p.read_text(encoding="utf-8")))
    return out


def sample_title(doc: Document) -> str:
    """The first line of a sample document (its title), for pickers."""
    return doc.text.strip().splitlines()[0].strip() if doc.text.strip() else doc.name


def read_text_file(path) -> str:
    """A UTF-8 text file's content, with the same checks as an upload (``NotText``, ``EmptyDocument``)."""
    p = Path(path)
    return decode_upload(p.name, p.read_bytes())
