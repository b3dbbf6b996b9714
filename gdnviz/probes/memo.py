"""The memo a probe (sweep, loss sweep) stores its per-sample results in."""
from __future__ import annotations

from pathlib import Path


class MemoStore:
    """diskcache.Cache for a path, the object itself for a mapping-like store, a dict for None."""

    def __init__(self, store):
        self.owned = None
        if store is None:
            self.c = {}
        elif isinstance(store, (str, Path)):
            import diskcache

            self.c = self.owned = diskcache.Cache(str(store))
        else:
            self.c = store

    def get(self, key):
        return self.c.get(key)

    def set(self, key, value):
        self.c[key] = value

    def close(self):
        if self.owned is not None:
            self.owned.close()
