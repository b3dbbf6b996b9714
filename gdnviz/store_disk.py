"""The diskcache ``Disk`` of gdnviz's store: every pickled value carries the sha256 of its pickle.

diskcache pickles dicts, lists and other non-primitive values into its sqlite file (or a value file when large).
A damaged pickle either fails to load or, worse, loads as a slightly different value. Here such a value is
stored as ``CHECKED_MAGIC + sha256(pickle) + pickle`` (as bytes), and reading it verifies the digest first:
a damaged value raises ``CorruptStoreEntry``, never returns something else. str / int / float / bytes values are
stored as diskcache stores them (the memo's bytes carry their own checksum, ``gdnviz.store``); values stored
before this format (plain pickles) are read as they are.
"""
from __future__ import annotations

import hashlib
import pickle

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW

from gdnviz.errors import CorruptStoreEntry

CHECKED_MAGIC = b"GDNVPK1\x00"
_HEAD = len(CHECKED_MAGIC) + 32


class CheckedDisk(diskcache.Disk):
    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if not read and type(value) not in (str, int, float, bytes):
            data = pickle.dumps(value, protocol=self.pickle_protocol)
            value = CHECKED_MAGIC + hashlib.sha256(data).digest() + data
        return super().store(value, read, key=key)

    def fetch(self, mode, filename, value, read):
        data = super().fetch(mode, filename, value, read)
        if mode in (MODE_RAW, MODE_BINARY) and not read and isinstance(data, bytes) \
                and data[:len(CHECKED_MAGIC)] == CHECKED_MAGIC:
            digest, payload = data[len(CHECKED_MAGIC):_HEAD], data[_HEAD:]
            if len(digest) != 32 or hashlib.sha256(payload).digest() != digest:
                raise CorruptStoreEntry(f"the stored value is damaged (its checksum does not match; "
                                        f"{len(payload):,} bytes{', in ' + filename if filename else ''})")
            return pickle.loads(payload)
        return data
