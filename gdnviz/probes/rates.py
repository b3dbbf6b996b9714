"""Measured throughput of generated RULER answers, kept in the memo: what every time estimate before a job is made of.

``gdnviz.probes.sweep.run_sweep`` (under every sweep, scan and budget) records, per (task, target length) it
generated answers for, the wall seconds its batches took, the number of answers and the rows its batches had, under
a key of the model fingerprint, dtype, device type ("cuda" / "cpu"), task, target length, segment length and the
batch size it was asked for (an int, or None: chosen from free memory) (``record``). The newest record replaces the
older one. ``estimate`` turns the answers a job still has to generate per (task, length) into seconds at the rates
measured at the job's own batch size; with any (task, length) never measured at it, it gives no number
(``seconds`` None) rather than a guess from another batch size. The device's load still varies: the estimate says
it is the last measured rate, at which batch size.
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


def _batch(batch_size) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be a positive integer or None (chosen from free memory), got "
                         f"{batch_size!r}")
    return batch_size


def _key(info, task: str, length: int, segment_len: int, batch_size: int | None) -> str:
    dev = getattr(info, "memo_device", None) or str(getattr(info, "device", "?")).split(":")[0]
    return PREFIX + content_hash(dict(fp=info.fingerprint, dtype=info.dtype, device=dev, task=task,
                                       length=int(length), L=int(segment_len), batch=_batch(batch_size)))


def record(store, info, task: str, length: int, segment_len: int, batch_size: int | None, seconds: float,
           answers: int, rows: int) -> None:
    """Store ``answers`` generated in ``seconds`` (wall) for this model, dtype, device type, task, length, L and
    requested ``batch_size`` (None: chosen from free memory); ``rows``: the most samples one of its batches had.
    ``store``: an object with ``set(key, value)`` (``gdnviz.probes.memo.MemoStore``). Nothing for 0 answers."""
    if answers < 1 or seconds <= 0:
        return
    store.set(_key(info, task, length, segment_len, batch_size),
              dict(answers=int(answers), seconds=float(seconds), answers_per_second=answers / float(seconds),
                   batch_size=_batch(batch_size), rows=int(rows), when=time.time()))


def read(store, info, task: str, length: int, segment_len: int, batch_size: int | None) -> dict | None:
    """The last ``record`` at this batch size: dict(answers, seconds, answers_per_second, batch_size, rows, when
    (unix s)), or None (never measured at it, or a record that is not one). ``store``: an object with
    ``get(key)``."""
    got = store.get(_key(info, task, length, segment_len, batch_size))
    try:
        ok = isinstance(got, dict) and float(got["answers_per_second"]) > 0 and math.isfinite(got["answers_per_second"])
    except (KeyError, TypeError, ValueError):
        ok = False
    return dict(got) if ok else None


def estimate(store, info, to_run: dict, segment_len: int, batch_size: int | None) -> dict:
    """Seconds to generate ``to_run`` ({(task, length): answers}) at the rates measured at ``batch_size`` (None:
    chosen from free memory): dict(seconds (None when a (task, length) with answers to run has no rate at it),
    answers_per_second (over the cells measured, weighted by their answers; None if none), missing: [[task,
    length]] without a rate, batch_size, rows: the largest batch rows of the rates used (None if none))."""
    secs, n, missing, rows = 0.0, 0, [], None
    for (task, length), k in to_run.items():
        if k <= 0:
            continue
        r = read(store, info, task, length, segment_len, batch_size)
        if r is None:
            missing.append([task, int(length)])
            continue
        secs += k / r["answers_per_second"]
        n += k
        rows = max(rows or 0, int(r.get("rows") or 0)) or None
    return dict(seconds=None if missing else secs, answers_per_second=(n / secs) if secs > 0 else None,
                missing=missing, batch_size=_batch(batch_size), rows=rows)


def _batch_text(est: dict) -> str:
    b = est.get("batch_size")
    if b is not None:
        return f"batch size {int(b)}"
    return "the batch size chosen from free memory" + (f" ({est['rows']} rows)" if est.get("rows") else "")


def _fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min" if s < 5400 else f"{s / 3600:.1f} h"


def eta_text(est: dict, to_run: int) -> str:
    """How an ``estimate`` of ``to_run`` answers reads: "about 3.2 min at the last measured 1.40 answers/s at batch
    size 8 on this model and device", "nothing to generate", or "no estimate yet (no earlier run of vt at 4,096
    tokens at batch size 8 on this model, dtype and device)"."""
    if to_run <= 0:
        return "nothing to generate"
    at = "with " + _batch_text(est) if est.get("batch_size") is None else "at " + _batch_text(est)
    if est["seconds"] is None:
        miss = est["missing"]
        what = ", ".join(f"{t} at {int(l):,} tokens" for t, l in miss[:2]) + (f" and {len(miss) - 2} more"
                                                                              if len(miss) > 2 else "")
        return f"no estimate yet (no earlier run of {what} {at} on this model, dtype and device)"
    return (f"about {_fmt_seconds(est['seconds'])} at the last measured {est['answers_per_second']:.2f} answers/s "
            f"{at} on this model and device")
