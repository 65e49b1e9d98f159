"""An inference plan's layouts of a cluster: how a candidate runs the model on the devices it rents.

For a cluster of H hosts of G devices each (N = H G devices; a mixed cluster is two hosts of one
type each), a batch plan (:mod:`sim.planning.search`) tries, each using every device (a device
left idle would be paid for and unused):

* ``TP=N``: tensor parallelism over every device (Megatron-LM, Shoeybi et al. 2019, arXiv
  1909.08053);
* ``TP=N uneven``: on a mixed cluster, the same with each device's share of the heads and MLP
  columns in proportion to its compute or its memory, the basis a scenario without
  ``parallel.shares`` would take for the plan's workload (:func:`sim.parallel.workload_share_basis`:
  compute for prefill-heavy work, else memory), written out in the picked scenario;
* ``TP=G x PP=H``: tensor parallelism inside each host, a pipeline of H stages across the hosts
  (GPipe, Huang et al. 2019, arXiv 1811.06965; tensor parallelism within a node and pipeline
  parallelism across nodes is Megatron-LM's placement, Narayanan et al. 2021, arXiv 2104.04473,
  section 3.2): one point-to-point hop per stage instead of every layer's collectives on the network;
* ``PP=N``: a pipeline over every device;
* ``TP=G x H replicas``: one copy of the model per host, the batch's sequences split among them
  (:mod:`sim.replicas`): no collective crosses the network;
* ``TP=G x PP=P x R replicas``: for each divisor P of H with P, R = H / P > 1, R copies of a
  pipeline of P hosts (TP G inside each host), the batch's sequences split among them: a model
  too large for one host runs as several pipelines, each hop and each replica's requests on
  fewer devices. On single-device hosts (G = 1) the same formula gives ``PP=P x R replicas``,
  which belongs for the same reason (``PP=N`` and ``H replicas`` are its two ends).

A layout is a candidate only where the simulator accepts it: :class:`sim.parallel.ParallelPlan`
checks the degrees against the model (heads, layers) and :func:`sim.replicas.split_batch` the
batch against the replicas, :func:`sim.serving.simulate.check_serving_layout` a request load
against the layout; the rules live there only. A serving plan tries the same layouts as a batch
plan (a pipeline serves with an iteration in flight per stage, :mod:`sim.serving.scheduler`).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.spec import ModelSpec
from sim.parallel import ParallelPlan, ShareBasis, ShareOrigin, layout_label, share_weights
from sim.topology import Device


@dataclass(frozen=True)
class InferenceLayout:
    """``tensor`` ranks per stage, ``pipeline`` stages, ``replicas`` copies; ``shares``: the basis
    of an uneven split (None: even)."""

    tensor: int
    pipeline: int = 1
    replicas: int = 1
    shares: ShareBasis | None = None

    @property
    def uneven(self) -> bool:
        """Whether the split is uneven."""
        return self.shares is not None

    def label(self) -> str:
        """The layout in a few words, as the simulator's outputs spell it (:func:`sim.parallel.layout_label`)."""
        return layout_label(self.tensor, self.pipeline, replicas=self.replicas, uneven=self.uneven)

    def parallel(self) -> dict:
        """The scenario's ``parallel`` section (:class:`sim.scenario.Parallel`)."""
        section: dict = {"tensor": self.tensor}
        if self.pipeline > 1:
            section["pipeline"] = self.pipeline
        if self.replicas > 1:
            section["replicas"] = self.replicas
        if self.uneven:
            section["shares"] = self.shares.value
        return section

    def plan(self, spec: ModelSpec, devices: tuple[Device, ...]) -> ParallelPlan:
        """The simulator's plan of this layout of ``spec`` on ``devices`` (rank order).

        Raises:
            ConfigError: where the simulator would refuse it (:class:`sim.parallel.ParallelPlan`).
        """
        shares = share_weights(self.shares, devices, spec.dtype) if self.uneven else None
        return ParallelPlan(spec, tuple(d.name for d in devices), self.tensor, pipeline=self.pipeline,
                            shares=shares, replicas=self.replicas,
                            share_origin=ShareOrigin(self.shares) if self.uneven else None)


def inference_layouts(hosts: int, per_host: int, *, uneven: ShareBasis | None) -> list[InferenceLayout]:
    """The layouts a plan tries on ``hosts`` hosts of ``per_host`` devices (see the module
    docstring); ``uneven``: also the uneven split over every device by that basis (the devices
    are of more than one type), None: not."""
    n = hosts * per_host
    layouts = [InferenceLayout(n)]
    if n == 1:
        return layouts
    if uneven:
        layouts.append(InferenceLayout(n, shares=uneven))
    if hosts > 1 and per_host > 1:
        layouts.append(InferenceLayout(per_host, pipeline=hosts))
    layouts.append(InferenceLayout(1, pipeline=n))
    if hosts > 1:
        layouts.append(InferenceLayout(per_host, replicas=hosts))
    # the divisors of H only: a handful of candidates per cluster
    layouts += [InferenceLayout(per_host, pipeline=stages, replicas=hosts // stages)
                for stages in range(2, hosts) if hosts % stages == 0]
    return layouts
