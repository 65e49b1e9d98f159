"""The serving workload of a scenario: requests that arrive over time and share the cluster.

Example (``scenarios/serving_*.yaml`` hold complete ones)::

    workload:
      kind: serving
      rate_per_s: 2.0          # Poisson arrivals, requests per second
      requests: 200            # how many arrive
      prompt_tokens: 512       # every request's lengths, or
      output_tokens: 128
      # trace: requests.csv    # a CSV of prompt_tokens, output_tokens[, arrival_s] per request
      seed: 0
      max_batch_tokens: 2048   # token budget of one forward pass (prefill chunks + decode tokens)
      max_num_seqs: 256        # requests batched at once
      slo: {ttft: 2s, tpot: 200ms, percentile: 90}

The defaults of the scheduler are vLLM's for an online server on a GPU under 70 GiB
(``vllm/engine/arg_utils.py``, ``EngineArgs.get_batch_defaults``: ``max_num_batched_tokens`` 2048
for ``UsageContext.OPENAI_API_SERVER``, ``max_num_seqs`` 256; ``gpu_memory_utilization`` 0.9).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

from models.errors import ConfigError
from models.spec import ModelSpec
from sim.slo import LatencyObjectives

_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)
MAX_REQUESTS = 100_000
MAX_RATE_PER_S = 1e6


class ServingSLO(LatencyObjectives):
    """Latency objectives at a percentile over requests (:class:`sim.slo.LatencyObjectives`): at
    least one of ``ttft`` and ``tpot``."""

    @model_validator(mode="after")
    def _some_objective(self) -> ServingSLO:
        if self.ttft_s is None and self.tpot_s is None:
            raise ConfigError("ttft", "an SLO names ttft, tpot or both (got neither)")
        return self


class ServingWorkload(BaseModel):
    """Requests served over time (see the module docstring for every field).

    Raises (through :func:`sim.scenario.scenario_from_dict`): ConfigError naming the field: a
    count or rate that is not positive, lengths given both inline and as a trace or neither, a
    budget smaller than one token.
    """

    model_config = _STRICT
    kind: Literal["serving"]
    rate_per_s: StrictFloat | StrictInt = Field(gt=0, le=MAX_RATE_PER_S)
    requests: StrictInt = Field(default=200, gt=0, le=MAX_REQUESTS)
    prompt_tokens: StrictInt | None = Field(default=None, gt=0, le=1 << 20)
    output_tokens: StrictInt | None = Field(default=None, gt=0, le=1 << 17)
    trace: str | None = Field(default=None, min_length=1, max_length=4096)
    seed: StrictInt = Field(default=0, ge=0, le=2**63 - 1)
    max_batch_tokens: StrictInt = Field(default=2048, gt=0, le=1 << 20)
    max_num_seqs: StrictInt = Field(default=256, gt=0, le=1 << 16)
    memory_utilization: StrictFloat = Field(default=0.9, gt=0, le=1)
    slo: ServingSLO | None = None

    @model_validator(mode="after")
    def _lengths_once(self) -> ServingWorkload:
        inline = (self.prompt_tokens, self.output_tokens)
        if self.trace is not None:
            if any(v is not None for v in inline):
                raise ConfigError("trace", "request lengths come from the trace or from prompt_tokens and "
                                           f"output_tokens, not both (got {self.trace!r})")
        elif any(v is None for v in inline):
            missing = "prompt_tokens" if self.prompt_tokens is None else "output_tokens"
            raise ConfigError(missing, "Field required without a trace (got nothing)")
        return self

    def check_context(self, model: ModelSpec, field: str = "workload") -> None:
        """Raise ConfigError unless inline lengths fit ``model``'s context (a trace's rows are
        checked as it is read, :func:`sim.serving.requests.read_trace`)."""
        if self.trace is None and self.prompt_tokens + self.output_tokens > model.max_position_embeddings:
            raise ConfigError(f"{field}.prompt_tokens", f"prompt_tokens + output_tokens = "
                                                        f"{self.prompt_tokens + self.output_tokens} exceeds "
                                                        f"{model.name}'s context of {model.max_position_embeddings} "
                                                        f"tokens (got {self.prompt_tokens})")
