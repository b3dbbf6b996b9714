"""Altair charts as Vega-Lite specs for the page, built without Altair's JSON-schema validation.

Validating a layered chart against the Vega-Lite schema costs 50–300 ms per chart on every rerun (most of the
time a page took); the chart builders of ``gdnviz.figures`` are validated by tests/test_figures.py instead.

``spec(chart)`` → a plain Vega-Lite dict with its data inline under ``"datasets"`` (lists of records), the form
vl-convert exports and ``st.cache_data`` stores; ``for_page(spec)`` → the same spec with each dataset a DataFrame,
which Streamlit sends as Arrow.
"""
from __future__ import annotations

from contextlib import contextmanager

import pandas as pd


@contextmanager
def fast_build():
    """Altair objects built inside skip their construction-time schema validation."""
    from altair.utils import schemapi

    with schemapi.debug_mode(False):
        yield


def spec(chart) -> dict:
    """The Vega-Lite spec of an Altair chart (or a spec dict, returned as is), data inline, unvalidated."""
    if isinstance(chart, dict):
        return chart
    with fast_build():
        d = chart.to_dict(validate=False)
    view = d.get("config", {}).get("view", {})
    for k in ("continuousWidth", "continuousHeight"):  # Altair's default theme; the charts set their own size
        view.pop(k, None)
    return d


def for_page(s: dict) -> dict:
    """``s`` with each inline dataset as a DataFrame (Streamlit serialises those as Arrow)."""
    ds = s.get("datasets") or {}
    return {**s, "datasets": {k: pd.DataFrame.from_records(v) if isinstance(v, list) else v for k, v in ds.items()}}
