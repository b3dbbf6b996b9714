"""Damage single entries of a gdnviz store on disk, the way a full disk, a crash mid-write or a bad copy would:
truncate, garble or delete one value of one diskcache table (a row of its sqlite file, or the file that holds a
large value). A test tool (tests/test_store_fuzz.py); the store itself never calls it."""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path

#: the diskcache directories of a store (gdnviz.store): job records and the queue, memo, previous runs, heartbeats
AREAS = ("jobs", "memo", "runs", "workers")
HOW = ("truncate", "garble", "delete")


def rows(area_dir: Path) -> list[tuple]:
    """(rowid, key, filename, size of the stored value) of every entry of one diskcache directory."""
    with sqlite3.connect(area_dir / "cache.db") as db:
        out = db.execute("SELECT rowid, key, filename, length(value) FROM Cache ORDER BY rowid").fetchall()
    return out


def damage(area_dir: Path, rowid: int, how: str) -> str:
    """Damage the value of row ``rowid``; returns where ('db' or the value file's name)."""
    with sqlite3.connect(area_dir / "cache.db") as db:
        filename, value = db.execute("SELECT filename, value FROM Cache WHERE rowid = ?", (rowid,)).fetchone()
        if how == "delete":
            db.execute("DELETE FROM Cache WHERE rowid = ?", (rowid,))
            if filename:
                os.remove(area_dir / filename)
            return filename or "db"
        if filename:
            path = area_dir / filename
            data = path.read_bytes()
            path.write_bytes(_mutate(data, how))
            return filename
        data = bytes(value) if isinstance(value, (bytes, memoryview)) else str(value).encode()
        db.execute("UPDATE Cache SET value = ? WHERE rowid = ?", (sqlite3.Binary(_mutate(data, how)), rowid))
        return "db"


def _mutate(data: bytes, how: str) -> bytes:
    if how == "truncate":
        return data[: len(data) // 2]
    b = bytearray(data)  # garble: 14 bytes in the middle, each flipped
    mid = max(0, len(b) // 2 - 7)
    for i in range(mid, min(len(b), mid + 14)):
        b[i] ^= 0x5A
    return bytes(b)
