"""The page every report of hetsim shares (``report.html`` of simulate, plan and a grid sweep,
``memory_report.html`` of a scenario's sweep): its head and style, the heading, the one sentence
that says what to use and why (:func:`answer`, highlighted at the top), the body, then the
figures. plotly.js is embedded once, so the page opens offline; figure ``i`` is drawn in the div
``figure-i``, which ``tests/test_reports_render.py`` opens in a browser to check it rendered.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence

import plotly.graph_objects as go

from sim.vocabulary import Calibration

_STYLE = ("body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
          "td,th{padding:4px 10px;text-align:left} th{border-bottom:1px solid #888} "
          ".answer{font-size:1.2em;background:#fff7d6;padding:0.6em;border-left:4px solid gold}")


def answer(sentence: str) -> str:
    """The sentence that answers the report's question, as the highlighted paragraph at its top."""
    return f"<p class='answer'>{html.escape(sentence)}</p>"


def priced_by(calibrated: bool) -> str:
    """How a report's figures were priced, for its description: from a profile, or uncalibrated."""
    return "calibrated from a profile" if calibrated else "roofline compute and datasheet links (uncalibrated)"


def calibration_line(modes: Mapping[str, Calibration]) -> str:
    """Which variants each calibration mode priced (``modes``: variant name -> mode, in display
    order), one line: ``calibration: replay (same-cluster mode: ...) for a, b; prediction (...) for c``."""
    by_mode: dict[Calibration, list[str]] = {}
    for variant, mode in modes.items():
        by_mode.setdefault(mode, []).append(variant)
    return "calibration: " + "; ".join(f"{mode.value} ({mode.meaning}) for {', '.join(by_mode[mode])}"
                                       for mode in Calibration if mode in by_mode)


def came_from_html(modes: Mapping[str, Calibration], sources: Sequence[str]) -> str:
    """A report's "What came from where" section: :func:`calibration_line` of ``modes``, then
    ``sources``, one item each (the profile's context compared with the scenario, term by term,
    and where each fitted or default term came from)."""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in sources)
    return ("<h2>What came from where</h2>" + f"<p>{html.escape(calibration_line(modes))}</p>"
            + (f"<ul>{items}</ul>" if items else ""))


def report_page(title: str, parts: Iterable[str], figures: Sequence[go.Figure], after: Iterable[str] = ()) -> str:
    """The whole page: ``title`` as its title and heading, the HTML ``parts`` (the answer first),
    ``figures`` in the divs ``figure-0``, ``figure-1``, ..., then the HTML ``after`` them (a long table)."""
    body = [fig.to_html(full_html=False, include_plotlyjs=i == 0, div_id=f"figure-{i}")
            for i, fig in enumerate(figures)]
    return "\n".join(["<!DOCTYPE html><html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
                      f"<style>{_STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>", *parts, *body,
                      *after, "</body></html>"])
