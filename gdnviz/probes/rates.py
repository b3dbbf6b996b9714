"""Measured throughput of generated RULER answers, kept in the memo: what every time estimate before a job is made of.

``gdnviz.probes.sweep.run_sweep`` (under every sweep, scan and budget) records, per (task, target length) it
generated answers for, the wall seconds its batches took and the number of answers, under a key of the model
fingerprint, dtype, device type ("cuda" / "cpu"), task, target length and segment length (``record``). The newest
record replaces the older one. ``estimate`` turns the answers a job still has to generate per (task, length) into
seconds at those rates; with any (task, length) never measured it gives no number (``seconds`` None) rather than a
guess. Rates depend on the batch size and the device's load too; the estimate says it is the last measured one.
"""
from __future__ import annotations

import math
import time

from gdnviz.store import content_hash

__all__ = ["record", "read", "estimate", "eta_text", "is_record"]
PREFIX = "rate:"


def is_record(key: str) -> bool:
    """True for a rate record's memo key (memo wrappers that count computed answers skip these)."""
    return key.startswith(PREFIX)


def _key(info, task: str, length: int, segment_len: int) -> str:
    dev = str(getattr(info, "device", "?")).split(":")[0]
    return PREFIX + content_hash(dict(fp=info.fingerprint, dtype=info.dtype, device=dev, task=task,
                                       length=int(length), L=int(segment_len)))


def record(store, info, task: str, length: int, segment_len: int, seconds: float, answers: int) -> None:
    """Store ``answers`` generated in ``seconds`` (wall) for this model, dtype, device type, task, length and L.
    ``store``: an object with ``set(key, value)`` (``gdnviz.probes.memo.MemoStore``). Nothing for 0 answers."""
    if answers < 1 or seconds <= 0:
        return
    store.set(_key(info, task, length, segment_len), dict(answers=int(answers), seconds=float(seconds),
                                                          answers_per_second=answers / float(seconds),
                                                          when=time.time()))


def read(store, info, task: str, length: int, segment_len: int) -> dict | None:
    """The last ``record``: dict(answers, seconds, answers_per_second, when (unix s)), or None (never measured, or
    a record that is not one). ``store``: an object with ``get(key)``."""
    got = store.get(_key(info, task, length, segment_len))
    try:
        ok = isinstance(got, dict) and float(got["answers_per_second"]) > 0 and math.isfinite(got["answers_per_second"])
    except (KeyError, TypeError, ValueError):
        ok = False
    return dict(got) if ok else None


def estimate(store, info, to_run: dict, segment_len: int) -> dict:
    """Seconds to generate ``to_run`` ({(task, length): answers}) at the measured rates: dict(seconds (None when a
    (task, length) with answers to run has no rate), answers_per_second (over the cells measured, weighted by
    their answers; None if none), missing: [[task, length]] without a rate)."""
    secs, n, missing = 0.0, 0, []
    for (task, length), k in to_run.items():
        if k <= 0:
            continue
        r = read(store, info, task, length, segment_len)
        if r is None:
            missing.append([task, int(length)])
            continue
        secs += k / r["answers_per_second"]
        n += k
    return dict(seconds=None if missing else secs, answers_per_second=(n / secs) if secs > 0 else None,
                missing=missing)


def _fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min" if s < 5400 else f"{s / 3600:.1f} h"


def eta_text(est: dict, to_run: int) -> str:
    """How an ``estimate`` of ``to_run`` answers reads: "about 3.2 min at the last measured 1.40 answers/s",
    "nothing to generate", or "no estimate yet (no earlier run of vt at 4,096 tokens on this model and device)"."""
    if to_run <= 0:
        return "nothing to generate"
    if est["seconds"] is None:
        miss = est["missing"]
        what = ", ".join(f"{t} at {int(l):,} tokens" for t, l in miss[:2]) + (f" and {len(miss) - 2} more"
                                                                              if len(miss) > 2 else "")
        return f"no estimate yet (no earlier run of {what} on this model, dtype and device)"
    return (f"about {_fmt_seconds(est['seconds'])} at the last measured {est['answers_per_second']:.2f} answers/s "
            "on this model and device")
