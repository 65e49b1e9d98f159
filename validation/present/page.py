"""The page every report of hetsim shares (``report.html`` of simulate, plan and a grid sweep,
``memory_report.html`` of a scenario's sweep): its head and style, the heading, the one sentence
that says what to use and why (:func:`answer`, highlighted at the top), the body, then the
figures. plotly.js is embedded once, so the page opens offline; figure ``i`` is drawn in the div
``figure-i``, which ``tests/test_reports_render.py`` opens in a browser to check it rendered.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

import plotly.graph_objects as go

_STYLE = ("body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
          "td,th{padding:4px 10px;text-align:left} th{border-bottom:1px solid #888} "
          ".answer{font-size:1.2em;background:#fff7d6;padding:0.6em;border-left:4px solid gold}")


def answer(sentence: str) -> str:
    """The sentence that answers the report's question, as the highlighted paragraph at its top."""
    return f"<p class='answer'>{html.escape(sentence)}</p>"


def priced_by(calibrated: bool) -> str:
    """How a report's figures were priced, for its description: from a profile, or uncalibrated."""
    return "calibrated from a profile" if calibrated else "roofline compute and datasheet links (uncalibrated)"


def report_page(title: str, parts: Iterable[str], figures: Sequence[go.Figure], after: Iterable[str] = ()) -> str:
    """The whole page: ``title`` as its title and heading, the HTML ``parts`` (the answer first),
    ``figures`` in the divs ``figure-0``, ``figure-1``, ..., then the HTML ``after`` them (a long table)."""
    body = [fig.to_html(full_html=False, include_plotlyjs=i == 0, div_id=f"figure-{i}")
            for i, fig in enumerate(figures)]
    return "\n".join(["<!DOCTYPE html><html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
                      f"<style>{_STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>", *parts, *body,
                      *after, "</body></html>"])
