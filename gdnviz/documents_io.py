"""Read user text safely: UTF-8 only, no binary, nothing empty (shared by the CLI and the app)."""
from __future__ import annotations

from pathlib import Path

from gdnviz.errors import EmptyDocument, NotText


def decode_text(data: bytes, name: str = "document") -> str:
    """bytes → str, or NotText (binary / not UTF-8, with the byte offset) / EmptyDocument (nothing but whitespace)."""
    if b"\x00" in data[:65536]:
        raise NotText(f"{name} looks binary (it contains NUL bytes): upload a UTF-8 text file (.txt or .md)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise NotText(f"{name} is not valid UTF-8 (bad byte 0x{data[e.start]:02x} at offset {e.start}): "
                      "save it as UTF-8 text and upload it again") from None
    if not text.strip():
        raise EmptyDocument(f"{name} is empty: paste or upload some text")
    return text


def read_text_file(path) -> str:
    p = Path(path)
    return decode_text(p.read_bytes(), p.name)
