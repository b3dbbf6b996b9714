"""Measured throughput of the long jobs (RULER answers, tokens through the model), kept in the memo: what every time
estimate before a job is made of.

``gdnviz.probes.sweep.run_sweep`` (under every sweep, scan and budget) records, per (task, target length) it
generated answers for, the wall seconds its batches took, the number of answers and the rows its batches had, under
a key of the model fingerprint, dtype, device type ("cuda" / "cpu"), task, target length, segment length and the
batch size it was asked for (an int, or None: chosen from free memory) (``record``). The newest record replaces the
older one. ``estimate`` turns the answers a job still has to generate per (task, length) into seconds at the rates
measured at the job's own batch size; with any (task, length) never measured at it, it gives no number
(``seconds`` None) rather than a guess from another batch size. The device's load still varies: the estimate says
it is the last measured rate, at which batch size.

The other long jobs are measured in tokens through the model per wall second (``record_job``), under a key of the
job (``JOBS``), the model fingerprint, dtype, device type and segment length. What each one times, loading the
model and tokenising excluded: a capture, every document it captured (its forward and the statistics,
``CaptureResult.meta["seconds"]``) over their tokens; loss vs rank, every (document, setting) it computed, apart
for the untouched and the truncated passes (a truncated pass costs more: on CUDA an untouched GDN layer is one
kernel call, a truncated one a segment loop with a decomposition at every boundary; the number of heads cut is not
in the key), over the documents' tokens; truncate & compare, its generations and loss passes, untouched and
truncated together, over the prompt and new tokens of both runs and the loss documents twice; state patching, the
whole comparison (3 generations, 2 continuation passes) over every token they ran. Prompt and new tokens count
alike, so a rate measured at another prompt length or number of new tokens moves the real time away from the
estimate. A job answered from the memo, or on a Dask cluster (several workers at once), records nothing; a
cancelled capture or loss run records what it finished. ``estimate_job`` / ``job_eta_text`` give no number for a
job (or a part of it) never measured on this model, dtype, device type and segment length.
"""
from __future__ import annotations

import math
import time

from gdnviz.store import content_hash

__all__ = ["record", "read", "estimate", "eta_text", "is_record", "JOBS", "record_job", "read_job", "estimate_job",
           "job_eta_text"]
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


def _device(info) -> str:
    return getattr(info, "memo_device", None) or str(getattr(info, "device", "?")).split(":")[0]


def _key(info, task: str, length: int, segment_len: int, batch_size: int | None) -> str:
    return PREFIX + content_hash(dict(fp=info.fingerprint, dtype=info.dtype, device=_device(info), task=task,
                                       length=int(length), L=int(segment_len), batch=_batch(batch_size)))


def _measured(got, field: str) -> dict | None:
    """A stored record as a dict when its ``field`` is a finite rate > 0, else None (absent, damaged, foreign)."""
    try:
        ok = isinstance(got, dict) and float(got[field]) > 0 and math.isfinite(got[field])
    except (KeyError, TypeError, ValueError):
        ok = False
    return dict(got) if ok else None


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
    return _measured(store.get(_key(info, task, length, segment_len, batch_size)), "answers_per_second")


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


#: The jobs measured in tokens per second (module docstring): {job: (its label, the parts timed apart)}; a job of
#: one part has the part "".
JOBS = {"capture": ("capture", ("",)), "loss": ("loss vs rank run", ("untouched", "truncated")),
        "truncate": ("truncate & compare run", ("",)), "patch": ("state patching run", ("",))}


def _parts(job: str, tokens) -> dict:
    """{part: tokens} of an int (a one-part job) or a dict; ValueError for a job or part not in ``JOBS``."""
    if job not in JOBS:
        raise ValueError(f"no throughput is measured for job {job!r}: one of {', '.join(JOBS)}")
    parts = tokens if isinstance(tokens, dict) else {"": tokens}
    bad = [p for p in parts if p not in JOBS[job][1]]
    if bad:
        raise ValueError(f"{job} has no part {bad[0]!r}: its parts are {JOBS[job][1]}")
    return {p: int(k) for p, k in parts.items()}


def _job_key(info, job: str, part: str, segment_len: int) -> str:
    _parts(job, {part: 0})
    return PREFIX + content_hash(dict(fp=info.fingerprint, dtype=info.dtype, device=_device(info), job=job, part=part,
                                       L=int(segment_len)))


def record_job(store, info, job: str, segment_len: int, seconds: float, tokens: int, part: str = "") -> None:
    """Store ``tokens`` run through the model in ``seconds`` (wall, the model's work only: module docstring) by
    ``job`` (a key of ``JOBS``; ``part``: one of its parts) for this model, dtype, device type and segment length;
    the newest replaces the older. ``store``: an object with ``set(key, value)``. Nothing for 0 tokens."""
    key = _job_key(info, job, part, segment_len)
    if tokens < 1 or seconds <= 0:
        return
    store.set(key, dict(tokens=int(tokens), seconds=float(seconds), tokens_per_second=tokens / float(seconds),
                        when=time.time()))


def read_job(store, info, job: str, segment_len: int, part: str = "") -> dict | None:
    """The last ``record_job``: dict(tokens, seconds, tokens_per_second, when (unix s)), or None (never measured,
    or a record that is not one). ``store``: an object with ``get(key)``."""
    return _measured(store.get(_job_key(info, job, part, segment_len)), "tokens_per_second")


def estimate_job(store, info, job: str, tokens, segment_len: int) -> dict:
    """Seconds to run ``tokens`` (an int, or {part: tokens} for a job of parts) through ``job`` at its last
    measured rates: dict(job, segment_len, tokens (all parts), seconds (None when a part with tokens has no rate),
    tokens_per_second ({part: rate} of the parts with tokens measured), missing ([parts] without a rate))."""
    secs, rates_, missing = 0.0, {}, []
    parts = _parts(job, tokens)
    for part, k in parts.items():
        if k <= 0:
            continue
        r = read_job(store, info, job, segment_len, part)
        if r is None:
            missing.append(part)
            continue
        rates_[part] = r["tokens_per_second"]
        secs += k / r["tokens_per_second"]
    return dict(job=job, segment_len=int(segment_len), tokens=sum(max(k, 0) for k in parts.values()),
                seconds=None if missing else secs, tokens_per_second=rates_, missing=missing)


def job_eta_text(est: dict) -> str:
    """How an ``estimate_job`` reads: "about 12 s at the last measured 1,330 tokens/s (a capture at L = 256 on this
    model and device)", "… 1,200 tokens/s untouched, 800 tokens/s truncated (a loss vs rank run …)", "nothing to
    run", or "no estimate yet (no earlier capture at L = 256 on this model, dtype and device)"."""
    if est["tokens"] <= 0:
        return "nothing to run"
    label, L = JOBS[est["job"]][0], int(est["segment_len"])
    if est["seconds"] is None:
        part = [p for p in est["missing"] if p]
        with_ = f" with {' and '.join(part)} passes" if part and est["tokens_per_second"] else ""
        return f"no estimate yet (no earlier {label}{with_} at L = {L} on this model, dtype and device)"
    rate = ", ".join(f"{_fmt_rate(r)} tokens/s" + (f" {p}" if p else "") for p, r in est["tokens_per_second"].items())
    return (f"about {_fmt_seconds(est['seconds'])} at the last measured {rate} (a{'n' if label[0] in 'aeiou' else ''} "
            f"{label} at L = {L} on this model and device)")


def _fmt_rate(r: float) -> str:
    return f"{r:,.0f}" if r >= 100 else f"{r:.3g}"
