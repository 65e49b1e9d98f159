"""Presentation: terminal tables (rich) and HTML reports (plotly) of the kernel's results.

Only the command line and the validation top import it; ``sim/``, ``models/`` and ``runtime/``
produce data (result tables, traces) and never import it (``tests/test_layering.py``).
"""
