"""Every environment variable gdnviz reads: one table, one parsing rule.

``get(name)`` reads ``os.environ`` at each call (tests and subprocesses may change it) and parses the value by the
setting's kind; unset or empty means the default. Kinds:

- ``text``: the value, stripped;
- ``path``: a folder, ``~`` expanded (``None`` when unset and the default is empty);
- ``path_or_off``: like ``path``, but ``0`` turns the feature off (``False``);
- ``int`` / ``float``: a number, at least ``minimum``;
- ``flag``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case).

A value that does not parse raises :class:`gdnviz.errors.BadSetting` naming the variable, the value and what it
takes; nothing falls back silently. The package reads no ``GDNVIZ_*`` variable outside this module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gdnviz.errors import BadSetting

__all__ = ["Setting", "SETTINGS", "get", "table"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``name``, ``kind`` (module docstring), ``default`` (as the variable would be
    written), ``purpose`` (one line), ``audience`` ("user": in the README; "developer": tests and debugging)."""

    name: str
    kind: str
    default: str
    purpose: str
    audience: str = "user"
    minimum: float | None = None


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("GDNVIZ_DEFAULT_MODEL", "text", "demo",
            "model the app opens first: a checkpoint folder, an org/name in the local HF cache, or demo"),
    Setting("GDNVIZ_CACHE_DIR", "path", "",
            "folder of the job queue, results and memo (default: cache/ in the repository)"),
    Setting("GDNVIZ_MEMO_GB", "float", "20", "size limit of the on-disk memo in GiB (least recently stored go first)",
            minimum=0.0),
    Setting("GDNVIZ_MAX_TOKENS", "int", "32768", "longest document the app accepts, in tokens", minimum=1),
    Setting("GDNVIZ_KERNEL_CACHE", "path_or_off", "",
            "folder of compiled CUDA kernels (default ~/.cache/gdnviz/cuda_kernels; 0: compile in every process)"),
    Setting("GDNVIZ_WARMUP", "flag", "1",
            "warm the GPU kernels up when a model loads on CUDA (0: the first job pays compilation instead)"),
    Setting("GDNVIZ_CLUSTER", "text", "",
            "Dask cluster the app's worker runs sweeps, scans, budgets and loss sweeps on: local, tcp://HOST:PORT or a "
            "scheduler file (empty: here)"),
    Setting("GDNVIZ_NO_WORKER", "flag", "0",
            "1: the app starts no worker process (jobs wait for one started by hand, or tests run them)"),
    Setting("GDNVIZ_POLL_SECONDS", "float", "0.5",
            "seconds between the app's polls of a running job (0: no polling, for AppTest)", "developer",
            minimum=0.0),
    Setting("GDNVIZ_TEST_JOB_DELAY", "float", "0",
            "test hook: the worker sleeps this many seconds at every progress step of a job", "developer",
            minimum=0.0),
    Setting("GDNVIZ_TEST_STALL_AT", "text", "",
            "test hook: the worker stalls for good at a job's first progress step whose text contains this (a unit "
            "that never returns; empty: never)", "developer"),
    Setting("GDNVIZ_TEST_CRASH", "int", "0",
            "test hook: the worker exits with this code mid-job (0: never)", "developer", minimum=0),
    Setting("GDNVIZ_TEST_OOM", "flag", "0",
            "test hook: jobs raise torch.cuda.OutOfMemoryError mid-job", "developer"),
)}


def get(name: str):
    """The parsed value of setting ``name`` (module docstring); KeyError for a name not in :data:`SETTINGS`."""
    s = SETTINGS[name]
    raw = os.environ.get(name, "").strip()
    value = raw or s.default
    if s.kind == "text":
        return value
    if s.kind in ("path", "path_or_off"):
        if s.kind == "path_or_off" and value == "0":
            return False
        return Path(value).expanduser() if value else None
    if s.kind == "flag":
        low = value.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise BadSetting(f"{name}={raw!r}: takes 1/true/yes/on or 0/false/no/off ({s.purpose}).")
    number = int if s.kind == "int" else float
    try:
        v = number(value)
    except ValueError:
        raise BadSetting(f"{name}={raw!r} is not {'an integer' if number is int else 'a number'} "
                         f"(default {s.default}: {s.purpose}).") from None
    if s.minimum is not None and v < s.minimum:
        raise BadSetting(f"{name}={raw!r} is below its minimum {s.minimum:g} ({s.purpose}).")
    return v


def table(audience: str | None = None) -> list[Setting]:
    """The settings (of one ``audience``, or all), in table order: what the README and docs/settings.md list."""
    return [s for s in SETTINGS.values() if audience is None or s.audience == audience]
