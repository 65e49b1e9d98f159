"""What the calibration profiles say about the master's LM head (issue 20/18): its row in each
shipped profile against the layer ops timed in the same calibration, and the LM head measured in
real generations per strategy (``terms.csv``); no testbed, a few seconds.

The LM head is the one decode op that only the master computes while the other ranks wait in the
next step's broadcast (:mod:`sim.strategies.tensor_parallel`), and the only one that streams a
154 MB matrix (GPT-2: 50257 x 768 fp32) per call. Per profile it prints:

* ``lm_head ms``: the median over the decode rows of the row statistic the simulator charges
  (:data:`sim.profile.CHARGED`, the mean) and of the row medians;
* ``spread``: the median over those rows of p90 / p10;
* ``head/mlp_down``: the LM head's bytes per second over ``mlp_down``'s (``traffic_bytes`` over
  the row median): ``mlp_down`` runs on every rank at once, so the ratio drops where the LM head
  alone was slowed (for instance by other processes while it ran), and rises with the ranks per
  core (``mlp_down`` shares its core, the LM head does not).

Then, per report with a ``terms.csv``, the LM head measured in each strategy's generations
(median over phases and prompts, ms): one calibration run's strategies side by side.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_lm_head_rows.py``
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from models.errors import ConfigError
from sim.profile import CHARGED, load_profile
from sim.vocabulary import MeasurementKind

ROOT = Path(__file__).resolve().parent.parent
HEAD, REFERENCE = "lm_head", "mlp_down"
TERM = f"compute:{HEAD}"  # validation.terms' label of the LM head's compute


def profile_summary(path: Path) -> dict | None:
    """One profile's LM head decode rows: charged and median time (ms), spread (p90 / p10) and
    its bytes per second over ``mlp_down``'s; None for a profile without them (training)."""
    rows = load_profile(path).rows
    decode = rows[(rows["measurement"] == str(MeasurementKind.COMPUTE)) & (rows["new_tokens"] == 1)]
    head, reference = decode[decode["op"] == HEAD], decode[decode["op"] == REFERENCE]
    if head.empty or reference.empty:
        return None
    rate = lambda r: float((r["traffic_bytes"] / r["median"]).median())  # noqa: E731 - bytes/s
    return {"profile": str(path.relative_to(ROOT)),
            "charged_ms": float(head[CHARGED[MeasurementKind.COMPUTE]].median()) * 1e3,
            "median_ms": float(head["median"].median()) * 1e3,
            "spread": float((head["p90"] / head["p10"]).median()),
            "head_over_mlp_down": rate(head) / rate(reference)}


def per_strategy(terms: Path) -> pd.DataFrame:
    """The LM head measured in each strategy's generations of one report (ms), per cluster."""
    rows = pd.read_csv(terms)
    rows = rows[rows["term"] == TERM]
    return rows.pivot_table(index="scenario", columns="variant", values="measured_s", aggfunc="median") * 1e3


def main() -> None:
    profiles = sorted(p for p in (ROOT / "validation").rglob("*.csv")
                      if (p.parent.name == "profiles" or p.name.startswith("profile"))
                      and HEAD in p.read_text())
    summaries = []
    for path in profiles:
        try:
            summary = profile_summary(path)
        except ConfigError as error:  # a profile of an older version: said, not summarised
            print(f"{path.relative_to(ROOT)}: skipped ({error})")
            continue
        if summary is not None:
            summaries.append(summary)
    print(pd.DataFrame(summaries).round(2).to_string(index=False))
    for terms in sorted((ROOT / "validation").glob("*/terms.csv")):
        table = per_strategy(terms)
        if not table.empty:
            print(f"\n{terms.relative_to(ROOT)}: LM head measured per strategy, ms")
            print(table.round(1).to_string())


if __name__ == "__main__":
    main()
