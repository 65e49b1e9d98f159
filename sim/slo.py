"""Latency objectives as a user writes them, shared by a serving workload's ``slo`` and a plan's.

``ttft`` and ``tpot`` are durations with a unit (``2s``, ``100ms``), parsed to seconds, each an
upper bound; ``percentile`` (an integer in 1..100, default 90) says over which share of the requests
of a serving load they must hold (p90: nine requests in ten).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from sim.units import parse_duration

_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)
DEFAULT_PERCENTILE = 90


class LatencyObjectives(BaseModel):
    """``ttft_s`` and ``tpot_s`` at most (s, None: no objective), at the ``percentile`` of requests.

    Raises (through validation): ConfigError naming ``ttft`` or ``tpot`` for a value that is not a
    positive duration, ``percentile`` outside 1..100.
    """

    model_config = _STRICT
    ttft_s: float | None = Field(default=None, gt=0, alias="ttft")
    tpot_s: float | None = Field(default=None, gt=0, alias="tpot")
    percentile: StrictInt = Field(default=DEFAULT_PERCENTILE, gt=0, le=100)

    @field_validator("ttft_s", "tpot_s", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float | None:
        return None if value is None else parse_duration(value)
