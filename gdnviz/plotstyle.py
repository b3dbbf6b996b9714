"""Figure conventions shared by every chart: a layer palette whose neighbours differ, log-axis ticks that do not
collide and read the same way along one axis, and byte sizes for people. Pure functions, no Altair import.
"""
from __future__ import annotations

import colorsys
import math
from typing import Iterable

#: Tableau 10: a qualitative palette; used as is for up to 10 layers.
TABLEAU10 = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
             "#bab0ac"]
GOLDEN_ANGLE = 137.50776405  # degrees: consecutive hues as far apart as a sequence can keep them


def layer_colors(n: int) -> list[str]:
    """``n`` colours for layer identity, in layer order: Tableau 10 for ``n ≤ 10``; beyond, hues stepped by the
    golden angle with lightness alternating 42% / 62%, so that any two consecutive layers differ in hue by at least
    ~137° or in lightness. Raises ``ValueError`` for ``n < 0``."""
    if n < 0:
        raise ValueError(f"n must be non-negative; got {n}")
    if n <= len(TABLEAU10):
        return TABLEAU10[:n]
    out = []
    for i in range(n):
        h = (i * GOLDEN_ANGLE % 360.0) / 360.0
        r, g, b = colorsys.hls_to_rgb(h, 0.42 if i % 2 == 0 else 0.62, 0.75)
        out.append("#{:02x}{:02x}{:02x}".format(round(255 * r), round(255 * g), round(255 * b)))
    return out


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis over ``[lo, hi]`` (``0 < lo ≤ hi``): 1-2-5 steps when the range spans at most
    two decades, powers of ten up to eight decades, every other power beyond (labels never collide at ≥ 40 px
    per label on a 300 px axis). Always at least one tick (the nearest power of ten below ``lo``)."""
    if not (lo > 0 and hi >= lo and math.isfinite(hi)):
        raise ValueError(f"log ticks need 0 < lo <= hi < inf; got lo={lo!r}, hi={hi!r}")
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    decades = math.log10(hi / lo)
    mult = (1, 2, 5) if decades <= 2 else (1,)
    step = 1 if decades <= 8 else 2
    ticks = [m * 10.0 ** e for e in range(e0, e1 + 1) if (e - e0) % step == 0 for m in mult]
    inside = [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
    return inside or [10.0 ** e0]


def log_format(ticks: Iterable[float]) -> str:
    """d3 format of a log axis's labels, one notation for all of them: exponent (``1e-8``) when any tick is below
    1e-3 or above 1e6, plain numbers with thousands separators (``0.01``, ``1,000``) otherwise."""
    t = [float(x) for x in ticks]
    if t and (min(t) < 1e-3 or max(t) > 1e6):
        return ".0e"
    return ",~g"


KIB, MIB, GIB, TIB = 2.0 ** 10, 2.0 ** 20, 2.0 ** 30, 2.0 ** 40


def human_bytes(b: float) -> str:
    """A byte count with a binary unit and three significant digits: ``512 B``, ``12.0 KiB``, ``1.50 GiB``."""
    b = float(b)
    if not math.isfinite(b) or b < 0:
        raise ValueError(f"a byte count must be finite and non-negative; got {b!r}")
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if b >= size:
            v = b / size
            return f"{v:,.{max(0, 2 - int(math.floor(math.log10(v))))}f} {unit}" if v < 1000 else f"{v:,.0f} {unit}"
    return f"{b:,.0f} B"


#: Vega expression of ``human_bytes`` for axis labels (``datum.value`` in bytes).
BYTES_LABEL_EXPR = ("datum.value >= 1099511627776 ? format(datum.value / 1099511627776, '.3~g') + ' TiB' : "
                    "datum.value >= 1073741824 ? format(datum.value / 1073741824, '.3~g') + ' GiB' : "
                    "datum.value >= 1048576 ? format(datum.value / 1048576, '.3~g') + ' MiB' : "
                    "datum.value >= 1024 ? format(datum.value / 1024, '.3~g') + ' KiB' : "
                    "format(datum.value, '.3~g') + ' B'")


def byte_ticks(lo: float, hi: float) -> list[float]:
    """Log-axis ticks for byte counts: 1, 10 and 100 of B, KiB, MiB, GiB, TiB inside ``[lo, hi]``, every other
    one when there are more than eight."""
    if not (lo > 0 and hi >= lo):
        raise ValueError(f"byte ticks need 0 < lo <= hi; got lo={lo!r}, hi={hi!r}")
    cand = [m * u for u in (1.0, KIB, MIB, GIB, TIB) for m in (1, 10, 100)]
    t = [x for x in cand if lo * (1 - 1e-9) <= x <= hi * (1 + 1e-9)]
    if len(t) > 8:
        t = t[::2]
    return t or [lo]
