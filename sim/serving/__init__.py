"""Serving load: requests arriving over time, continuous batching, latency percentiles and the
highest request rate a configuration sustains under an SLO.

- :mod:`sim.serving.config`: the ``workload: {kind: serving, ...}`` schema and the SLO.
- :mod:`sim.serving.requests`: Poisson arrivals, or a trace file of request lengths.
- :mod:`sim.serving.iteration`: the time of one batched forward pass (each pipeline stage's part and
  the messages between stages), priced by the simulator's strategy lowering and engine.
- :mod:`sim.serving.scheduler`: continuous batching with chunked prefill under a token budget, an
  iteration in flight per pipeline stage.
- :mod:`sim.serving.simulate`: a serving scenario's variants, their metrics and maximum rates.
"""
