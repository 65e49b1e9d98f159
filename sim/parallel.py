"""The parallel plan: how many ways a model is split, and which device runs which rank.

A :class:`ParallelPlan` is validated data: the degrees (tensor, pipeline, data for training,
replicas for inference), the decoder layers of each pipeline stage, the placement of every rank on
the topology's devices and, for an uneven tensor-parallel split, each rank's share of the heads
and MLP columns (:mod:`models.shards`). Data parallelism (training) and inference replicas both
copy the layout: copy d runs on the next ``tensor x pipeline`` devices (TP inside a host, DP
across hosts when a host holds ``tensor`` devices); a replica of a pipeline is a whole pipeline,
its stages on its own block of devices. An uneven split's weights come from ``parallel.shares``
or, where the degree cannot split the model evenly, from a default basis the workload picks
(:func:`scenario_shares`, :func:`default_share_basis`). The simulator and the runtime both take their
ranks from it, so the runtime never asks the orchestrator (:mod:`sim.simulate`) where its ranks
are.

Pipeline parallelism (GPipe, Huang et al. 2019, arXiv 1811.06965): the decoder layers are split
into ``pipeline`` consecutive stages, each run by a tensor-parallel group of ``tensor`` ranks; the
first stage also embeds the tokens, the last one also holds the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from models.accounting import (forward_flops, kv_cache_bytes_per_token, layer_block_weight_bytes,
                               rank_weight_bytes, stage_weight_bytes)
from models.errors import ConfigError
from models.shards import TensorShard, fits_evenly, tensor_shards
from models.spec import ModelSpec
from sim.serving.requests import workload_requests
from sim.units import duration_text
from sim.vocabulary import WorkloadKind


class ShareBasis(StrEnum):
    """What a device's share of an uneven tensor-parallel split follows (``parallel.shares``, or
    :func:`default_share_basis`): its dense peak FLOP/s in the scenario's dtype (prefill-heavy
    work), or its memory capacity (decode-heavy work; a model that barely fits)."""

    COMPUTE = "compute"
    MEMORY = "memory"


UNEVEN_SHARES = "uneven shares"
"""How every output's words on an uneven split begin (:meth:`ShareOrigin.text`), so that a table
can tell an uneven point from its note (:func:`validation.present.tables.sweep_tables`)."""


@dataclass(frozen=True)
class ShareOrigin:
    """Where an uneven split's weights came from: ``basis`` (None: the weights written in
    ``parallel.shares``) and ``default``: why that basis was taken when the scenario wrote none
    (:func:`default_share_basis`'s reason; None where ``parallel.shares`` names it)."""

    basis: ShareBasis | None = None
    default: str | None = None

    def text(self) -> str:
        """``uneven shares by compute (default: prefill-heavy workload, ...)``: what every output
        that shows an uneven split says of it."""
        if self.basis is None:
            return f"{UNEVEN_SHARES} as written (parallel.shares)"
        if self.default is None:
            return f"{UNEVEN_SHARES} by {self.basis} (parallel.shares)"
        return f"{UNEVEN_SHARES} by {self.basis} (default: {self.default}; parallel.shares sets them)"


def default_share_basis(spec: ModelSpec, devices, *, batch: int, prompt_tokens: float,
                        output_tokens: float) -> tuple[ShareBasis, str]:
    """The basis of an uneven split no ``parallel.shares`` names, and why: ``compute`` for
    prefill-heavy work, else ``memory`` (issue 20's default).

    Prefill-heavy: the workload's prefill takes at least as long as its decode on ``devices``
    (:class:`sim.topology.Device`, one tensor-parallel group) at their summed peak rates, each
    forward pass priced by the roofline (Williams et al., CACM 2009): the larger of its FLOPs
    over the group's dense peak FLOP/s in ``spec``'s dtype and its weights read once over the
    group's memory bandwidth. Prefill is one pass over ``batch`` sequences of ``prompt_tokens``
    (:func:`models.accounting.forward_flops`); decode ``output_tokens - 1`` passes of one token
    per sequence (the first output token comes from prefill). A comparison of times, not of token
    counts, because a decode token costs a whole read of the weights where a prompt token costs
    its FLOPs: Qwen2.5-7B in bf16 on one RTX 4090, one sequence of 512 prompt and 128 output
    tokens, prefills in 47.5 ms and decodes in 1.92 s. The KV cache's reads and the collectives
    are left out (both add to decode, so a workload called prefill-heavy is so by at least this
    margin). A prefill-heavy
    workload is bound by compute, so splitting by compute evens the ranks' prefill; decode is
    bound by memory, and a split by memory (capacity) also keeps a small device from being
    handed more weights than it holds.

    Returns:
        The basis, and the reason in words (``prefill-heavy workload, prefill 3.1 s >= decode
        1.2 s at peak rates``).

    Raises:
        ConfigError: on ``dtype`` for a device without ``spec``'s dtype.
    """
    flops = sum(d.spec.peak_flops(spec.dtype) for d in devices)
    bandwidth = sum(d.spec.memory_bandwidth_bytes_per_s for d in devices)
    weights_s = rank_weight_bytes(spec, 1, is_master=True) / bandwidth
    prefill_s = max(batch * forward_flops(spec, max(1, round(prompt_tokens))) / flops, weights_s)
    decode_s = max(0.0, output_tokens - 1) * max(batch * forward_flops(spec, 1) / flops, weights_s)
    times = f"prefill {duration_text(prefill_s)} {{}} decode {duration_text(decode_s)} at peak rates"
    if prefill_s >= decode_s:
        return ShareBasis.COMPUTE, "prefill-heavy workload, " + times.format(">=")
    return ShareBasis.MEMORY, "decode-heavy workload, " + times.format("<")


def workload_share_basis(workload, spec: ModelSpec, devices, *, replicas: int = 1,
                         base_dir=None) -> tuple[ShareBasis, str]:
    """:func:`default_share_basis` of an inference or serving ``workload`` (the scenario's or a
    plan's) on one group's ``devices``: a batch's sequences split among ``replicas`` (the largest
    share); a serving workload's mean request alone (batch 1: under load, decode batches many
    requests and prefill's part grows, so a heavily loaded server may want ``shares: compute``
    written), its lengths the inline ones or the trace's (read from ``base_dir``).

    Raises:
        ConfigError: as :func:`default_share_basis`; a trace that cannot be read
            (:func:`sim.serving.requests.read_trace`).
    """
    if workload.kind == WorkloadKind.SERVING:
        requests = workload_requests(workload, spec, *(() if base_dir is None else (base_dir,)))
        return default_share_basis(spec, devices, batch=1,
                                   prompt_tokens=sum(r.prompt_tokens for r in requests) / len(requests),
                                   output_tokens=sum(r.output_tokens for r in requests) / len(requests))
    return default_share_basis(spec, devices, batch=-(-workload.batch_size // replicas),
                               prompt_tokens=workload.prompt_tokens, output_tokens=workload.output_tokens)


def layout_label(tensor: int, pipeline: int = 1, *, data: int = 1, replicas: int = 1, uneven: bool = False) -> str:
    """A layout in a few words, the one spelling every output uses (tables, plans, reports):
    ``TP=4``, ``TP=6 uneven``, ``TP=2 x PP=3``, ``PP=6``, ``TP=2 x 3 replicas``,
    ``TP=2 x PP=2 x 2 replicas``, ``PP=2 x 2 replicas``, ``TP=2 x DP=2``."""
    parts = [f"TP={tensor}" + (" uneven" if uneven else "")]
    if pipeline > 1:
        parts = [f"PP={pipeline}"] if tensor == 1 else [*parts, f"PP={pipeline}"]
    if data > 1:
        parts.append(f"DP={data}")
    return " x ".join(parts + ([f"{replicas} replicas"] if replicas > 1 else []))


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees and placement of one run of ``model`` on a cluster whose devices are ``devices``
    (their names, in topology rank order).

    Attributes:
        tensor: tensor-parallel degree (Megatron-LM, arXiv 1909.08053): ranks sharing each layer.
        data: data-parallel degree (training): copies of the layout, copy d on devices
            ``d * tensor .. (d + 1) * tensor - 1``.
        pipeline: pipeline-parallel degree (GPipe, arXiv 1811.06965): stages of consecutive layers.
        placement: the topology rank (index into ``devices``) of each rank of one copy, stage by
            stage: stage s's tensor-parallel group is ``placement[s * tensor:(s + 1) * tensor]``,
            its first rank the stage's master; default: the first ``tensor x pipeline`` devices.
        shares: one positive weight per tensor-parallel rank, in group order (the same for every
            replica), or one per placed device, replica after replica: the split of heads and MLP
            columns follows them (:func:`models.shards.tensor_shards`); None: even.
        replicas: copies of the layout (a tensor-parallel group, or a whole pipeline), each serving
            its part of the requests; replica i runs on the placement shifted by ``i * tensor x
            pipeline`` devices.
        stages: the number of decoder layers of each stage, in order; default: as even as
            possible, the earlier stages taking one more where the count does not divide.
        variant_layouts: the scenario's variants set layouts of their own (this is the
            scenario's default one).
        share_origin: where ``shares`` came from (:class:`ShareOrigin`; None: weights given
            directly, or an even split).

    Raises:
        ConfigError: on ``parallel.*``: a degree below 1, a data degree above 1 with a placement
            of its own, a pipeline with data parallelism or uneven shares, degrees whose
            product exceeds the devices, a tensor degree that cannot shard the model
            (:func:`models.shards.tensor_shards`), more stages than decoder layers, layer counts
            that are not one positive count per stage summing to the model's layers, a placement
            of the wrong length, on a device that does not exist, or twice on one device; on
            ``parallel.shares``, weights that do not fit the degree. Messages name every degree
            and the devices involved.
    """

    model: ModelSpec
    devices: tuple[str, ...]
    tensor: int
    data: int = 1
    pipeline: int = 1
    placement: tuple[int, ...] | None = None
    shares: tuple[float, ...] | None = None
    replicas: int = 1
    stages: tuple[int, ...] | None = None
    variant_layouts: bool = False
    share_origin: ShareOrigin | None = None
    _shards: tuple[tuple[TensorShard, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        degrees = f"tensor {self.tensor} x data {self.data} x pipeline {self.pipeline}"
        if self.replicas != 1:
            degrees += f" x replicas {self.replicas}"
        for name in ("tensor", "data", "pipeline", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name}", f"must be a positive integer ({degrees}) (got {value!r})")
        if self.data > 1 and self.placement is not None:
            raise ConfigError("parallel.placement", f"data parallelism places replica d on the devices "
                                                    f"d * tensor .. (d + 1) * tensor - 1 ({degrees}) "
                                                    f"(got {self.placement})")
        if self.pipeline > 1 and (self.data > 1 or self.shares is not None):
            raise ConfigError("parallel.pipeline", f"a pipeline with data parallelism or uneven shares is "
                                                   f"not supported yet ({degrees}) (got {self.pipeline})")
        layers = self.model.num_layers
        if self.pipeline > layers:
            raise ConfigError("parallel.pipeline", f"{self.pipeline} stages, but {self.model.name} has {layers} "
                                                   f"decoder layers ({degrees}) (got {self.pipeline})")
        needed = self.tensor * self.data * self.pipeline * self.replicas
        if needed > len(self.devices):
            field_name = ("parallel.replicas" if self.replicas > 1 else
                          "parallel.tensor" if self.pipeline == 1 else "parallel.pipeline")
            raise ConfigError(field_name, f"{degrees} = {needed} ranks exceed the cluster's "
                                          f"{len(self.devices)} devices ({', '.join(self.devices)}) "
                                          f"(got {getattr(self, field_name.split('.')[1])})")
        if self.pipeline > 1:
            # the shards' own refusal would suggest parallel.shares, which a pipeline refuses (above)
            check_even_only(self.model, self.tensor, "a pipeline's stages split evenly only")
        shares = self.shares
        if shares is not None and len(shares) == self.tensor * self.replicas and self.replicas > 1:
            per_replica = [shares[i * self.tensor:(i + 1) * self.tensor] for i in range(self.replicas)]
        else:
            per_replica = [shares] * self.replicas
        object.__setattr__(self, "_shards", tuple(tensor_shards(self.model, self.tensor, w) for w in per_replica))
        stages = even_stages(layers, self.pipeline) if self.stages is None else tuple(self.stages)
        # The first stage may hold no layers: a client that only embeds (llama.cpp's RPC client, Petals').
        if len(stages) != self.pipeline or any(not isinstance(n, int) or n < (i > 0) for i, n in enumerate(stages)) \
                or sum(stages) != layers:
            raise ConfigError("parallel.stages", f"must give each of the {self.pipeline} stages a positive layer "
                                                 f"count (the first may have 0: it only embeds), summing to "
                                                 f"{self.model.name}'s {layers} layers (got {list(stages)}, "
                                                 f"sum {sum(n for n in stages if isinstance(n, int))})")
        if stages[0] == 0 and self.tensor > 1:
            raise ConfigError("parallel.stages", f"a first stage without layers only embeds, on one device; it "
                                                 f"takes parallel.tensor 1 (got {list(stages)} with tensor "
                                                 f"{self.tensor})")
        object.__setattr__(self, "stages", stages)
        per_copy = self.tensor * self.pipeline
        placement = tuple(range(per_copy)) if self.placement is None else tuple(self.placement)
        if len(placement) != per_copy:
            raise ConfigError("parallel.placement", f"must place each of the {degrees} ranks on a device "
                                                    f"(got {len(placement)} placements)")
        for rank, device in enumerate(placement):
            if not 0 <= device < len(self.devices):
                raise ConfigError("parallel.placement", f"rank {rank} on device {device}, but the "
                                                        f"cluster has devices 0..{len(self.devices) - 1} "
                                                        f"({', '.join(self.devices)}) (got {device})")
            if placement.index(device) != rank:
                raise ConfigError("parallel.placement", f"ranks {placement.index(device)} and "
                                                        f"{rank} both on device {self.devices[device]} (got {device})")
        object.__setattr__(self, "placement", placement)
        used = [rank for ranks in self.replica_ranks for rank in ranks]
        for rank in used:
            if not 0 <= rank < len(self.devices) or used.count(rank) > 1:
                raise ConfigError("parallel.replicas", f"the {self.replicas} replicas of the placement "
                                                       f"{placement} overlap or leave the cluster's "
                                                       f"{len(self.devices)} devices (got {self.replicas})")

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every topology rank of the run, copy by copy and stage by stage (the first is the first
        stage's master)."""
        return tuple(rank for ranks in self.replica_ranks for rank in ranks)

    @property
    def tensor_ranks(self) -> tuple[int, ...]:
        """The topology ranks of the (first copy's) tensor-parallel group, in group order (the
        first is the master): what the runtime's calibration and validation run.

        Raises:
            ConfigError: on ``parallel.pipeline``, for a pipeline (``hetsim measure`` measures
                one, :attr:`measured_ranks`; calibrating it is not wired yet); as
                :attr:`measured_ranks`.
        """
        if self.pipeline > 1:
            raise ConfigError("parallel.pipeline", f"calibrating or validating a pipeline on the runtime is not "
                                                   f"supported yet; hetsim simulate predicts it and hetsim measure "
                                                   f"measures it (got {self.pipeline})")
        return self.measured_ranks

    @property
    def measured_ranks(self) -> tuple[int, ...]:
        """The ranks ``hetsim measure`` launches for one copy: every rank, a pipeline's included.

        Raises:
            ConfigError: on ``variants``, where variants set layouts of their own (a measurement
                runs one layout).
        """
        if self.variant_layouts:
            raise ConfigError("variants", "measuring variants with their own parallel layouts on the runtime is not "
                                          "supported yet; hetsim simulate predicts them")
        return self.placement

    @property
    def uncalibrated_layout(self) -> str | None:
        """This layout as a calibration profile's context names it where a calibration does not
        measure it (:class:`sim.context.CalibrationContext`): ``pipeline P x tensor T`` or
        ``tensor T, uneven shares a:b:c``; None for even tensor parallelism, what one measures."""
        if self.pipeline > 1:
            return f"pipeline {self.pipeline} x tensor {self.tensor}"
        if self.shards is not None:
            return f"tensor {self.tensor}, uneven shares " + ":".join(f"{w:g}" for w in self.shares[:self.tensor])
        return None

    @property
    def shards(self) -> tuple[TensorShard, ...] | None:
        """Each tensor-parallel rank's slice of the layers (the first replica's), in group order,
        when ``shares`` makes the split uneven; None for the even split (every rank alike)."""
        return self.replica_shards[0]

    @property
    def shares_note(self) -> str | None:
        """What the outputs say of an uneven split (:meth:`ShareOrigin.text`): ``uneven shares by
        memory (default: decode-heavy workload, ...)``; None for the even split."""
        if self.shares is None:
            return None
        return (self.share_origin or ShareOrigin()).text()

    @property
    def replica_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each copy (an inference replica, or a data-parallel replica in training),
        its master first: the placement shifted by ``i * tensor x pipeline``."""
        copies, width = self.replicas * self.data, self.tensor * self.pipeline
        return tuple(tuple(p + i * width for p in self.placement) for i in range(copies))

    @property
    def replica_shards(self) -> tuple[tuple[TensorShard, ...] | None, ...]:
        """Each replica's :attr:`shards` (None for an even split)."""
        return tuple(None if self.shares is None else s for s in self._shards)

    @property
    def idle_devices(self) -> tuple[str, ...]:
        """The devices no copy uses, in topology order: what the layout leaves unused."""
        used = set(self.ranks)
        return tuple(name for rank, name in enumerate(self.devices) if rank not in used)

    @property
    def label(self) -> str:
        """The layout in a few words (:func:`layout_label`)."""
        return layout_label(self.tensor, self.pipeline, data=self.data, replicas=self.replicas,
                            uneven=self.shares is not None)

    @property
    def stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, its tensor-parallel group's topology ranks (the first is the stage's master)."""
        t = self.tensor
        return tuple(self.placement[s * t:(s + 1) * t] for s in range(self.pipeline))

    @property
    def replica_stage_ranks(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per replica, its :attr:`stage_ranks` (replica 0's are :attr:`stage_ranks`)."""
        t = self.tensor
        return tuple(tuple(ranks[s * t:(s + 1) * t] for s in range(self.pipeline)) for ranks in self.replica_ranks)

    def replica_of(self, rank: int) -> int:
        """The index of the copy whose ranks hold topology rank ``rank``.

        Raises:
            ValueError: no copy holds it (an idle device).
        """
        for index, ranks in enumerate(self.replica_ranks):
            if rank in ranks:
                return index
        raise ValueError(f"rank {rank} is in no copy of the layout {self.label}")

    @property
    def stage_first_layers(self) -> tuple[int, ...]:
        """Per stage, the index of its first decoder layer."""
        return tuple(sum(self.stages[:s]) for s in range(self.pipeline))

    @classmethod
    def of(cls, scenario, topology, variant=None) -> ParallelPlan:
        """The plan a scenario (:class:`sim.scenario.Scenario`) asks for on ``topology``
        (:class:`sim.topology.Topology`): ``parallel.tensor`` (default every device, divided by
        the stages), ``parallel.pipeline`` and ``parallel.stages``: layer counts, per-stage device
        lists (names), or ``balanced`` (:func:`balanced_stages`); a ``variant`` with its own
        ``parallel`` (:class:`sim.scenario.Variant`) takes that one. Without ``variant``: the
        scenario's layout, or the first variant's where every variant has its own (then
        ``variant_layouts`` is set). ``parallel.replicas`` (default 1) copies it, ``tensor``
        defaulting to the devices divided among the replicas; ``parallel.shares`` is resolved to
        weights (a :class:`ShareBasis` read from each placed device, or the weights written), and
        where it is absent and the degree cannot split the model evenly, a default basis from the
        workload (:func:`scenario_shares`). A
        training scenario takes ``parallel.tensor`` (default 1) and ``parallel.data``.

        Raises:
            ConfigError: see the class; a device name that is not the cluster's, or per-stage
                device lists of unequal sizes (a variant's fields named ``variants[i].parallel...``);
                on ``dtype`` for ``shares: compute`` on a device without it.
        """
        if scenario.config.is_training:
            return cls._of_training(scenario, tuple(d.name for d in topology.devices))
        if variant is not None and variant.parallel is not None:
            try:
                return cls._of(scenario, topology, variant.parallel)
            except ConfigError as error:
                index = scenario.config.variants.index(variant)
                raise ConfigError(f"variants[{index}].{error.field}", error.message) from None
        variants = scenario.config.variants
        if all(v.parallel is not None for v in variants):  # no variant takes the scenario's layout
            return replace(cls.of(scenario, topology, variants[0]), variant_layouts=True)
        plan = cls._of(scenario, topology, scenario.config.parallel)
        if any(v.parallel is not None for v in variants):
            plan = replace(plan, variant_layouts=True)
        return plan

    @classmethod
    def _of(cls, scenario, topology, parallel) -> ParallelPlan:
        devices = tuple(d.name for d in topology.devices)
        written = parallel.tensor
        pipeline = parallel.pipeline
        stages, placement = parallel.stages, None
        if isinstance(stages, list) and stages and isinstance(stages[0], list):
            placement = _device_lists(stages, devices, written, parallel.pipeline)
            pipeline, written, stages = len(stages), len(stages[0]), None
        replicas = parallel.replicas
        tensor = written or max(1, len(devices) // (pipeline * replicas))
        shares, origin = scenario_shares(scenario, topology.devices, parallel.shares, tensor, pipeline, replicas)
        try:
            if stages == BALANCED:
                plan = cls(scenario.model, devices, tensor, pipeline=pipeline, placement=placement)
                # balanced over the first copy's devices: every replica takes its split (one
                # layer split per layout), which fits other replicas only where their devices match
                stages = balanced_stages(scenario.model, topology, plan.stage_ranks)
            return cls(scenario.model, devices, tensor, pipeline=pipeline, placement=placement,
                       stages=None if stages is None else tuple(stages), shares=shares, replicas=replicas,
                       share_origin=origin)
        except ConfigError as error:
            if written is not None or error.field != "parallel.tensor" or pipeline > 1:
                raise
            # The degree came from the device count: name what the user wrote.
            raise ConfigError("cluster", f"the cluster's {len(devices)} devices are the default tensor-parallel "
                                         f"degree: {error.message}; set parallel.tensor") from None

    @classmethod
    def _of_training(cls, scenario, devices: tuple[str, ...]) -> ParallelPlan:
        """A training scenario's plan: ``parallel.tensor`` (default 1) and ``parallel.data``
        (default: the devices // tensor)."""
        tensor = scenario.config.parallel.tensor or 1
        data = scenario.config.parallel.data
        if data is None:
            data = len(devices) // tensor
            if data < 1:
                raise ConfigError("parallel.tensor", f"exceeds the cluster's {len(devices)} devices "
                                                     f"({', '.join(devices)}) (got {tensor})")
        check_even_only(scenario.model, tensor, "training splits evenly only (no parallel.shares)")
        return cls(scenario.model, devices, tensor, data)


def check_even_only(model: ModelSpec, tensor: int, why: str) -> None:
    """Refuse, on ``parallel.tensor``, a degree that cannot split ``model`` evenly where no uneven
    split may run (``why``: a pipeline, training), instead of the shards' own refusal, whose hint
    (``parallel.shares``) such a layout refuses."""
    if not fits_evenly(model, tensor):
        raise ConfigError("parallel.tensor", f"tensor-parallel degree {tensor} cannot split {model.name} evenly "
                                             f"({model.num_attention_heads} attention heads, {model.num_kv_heads} "
                                             f"key-value heads, intermediate size {model.intermediate_size}), and "
                                             f"{why}; choose a degree that divides them (got {tensor})")


def scenario_shares(scenario, devices, written, tensor: int, pipeline: int, replicas: int
                    ) -> tuple[tuple[float, ...] | None, ShareOrigin | None]:
    """The weights of a scenario's tensor-parallel split and where they came from: ``written``
    (``parallel.shares``: a :class:`ShareBasis` read from each placed device of ``devices``
    (:class:`sim.topology.Device`, rank order), or weights); where it is None and ``tensor``
    ranks cannot split the model evenly (:func:`models.shards.fits_evenly`), the basis
    :func:`workload_share_basis` picks for the scenario's workload; else (None, None), the even
    split, kept wherever the degree allows it, mixed device types included. A pipeline's
    stages split evenly only (:class:`ParallelPlan`), so a pipeline gets no default. The one
    resolution every plan built from a scenario goes through (:meth:`ParallelPlan.of`).

    Raises:
        ConfigError: on ``dtype`` for ``compute`` on a device without it; as
            :func:`workload_share_basis`.
    """
    model = scenario.model
    placed = devices[:tensor * replicas]
    if isinstance(written, ShareBasis):
        return share_weights(written, placed, model.dtype), ShareOrigin(written)
    if written is not None:
        return tuple(written), ShareOrigin()
    if pipeline > 1 or fits_evenly(model, tensor) or tensor > len(placed):
        return None, None  # an even split, or a degree ParallelPlan refuses with its own message
    base_dir = scenario.source_path.parent if scenario.source_path else None
    basis, reason = workload_share_basis(scenario.config.workload, model, placed[:tensor], replicas=replicas,
                                         base_dir=base_dir)
    return share_weights(basis, placed, model.dtype), ShareOrigin(basis, reason)


def share_weights(basis: ShareBasis, devices, dtype: str) -> tuple[float, ...]:
    """The weight of each of ``devices`` (:class:`sim.topology.Device`, in rank order) in an
    uneven tensor-parallel split by ``basis``: its dense peak FLOP/s in ``dtype`` or its memory
    capacity (bytes).

    Raises:
        ConfigError: on ``dtype`` for ``compute`` on a device without it.
    """
    if basis == ShareBasis.COMPUTE:
        return tuple(d.spec.peak_flops(dtype) for d in devices)
    return tuple(float(d.memory_capacity_bytes) for d in devices)


BALANCED = "balanced"
"""``parallel.stages: balanced``: layers split by :func:`balanced_stages`."""


def even_stages(layers: int, pipeline: int) -> tuple[int, ...]:
    """``layers`` split into ``pipeline`` consecutive stages as evenly as possible (the earlier
    stages take the remainder, one layer each)."""
    base, extra = divmod(layers, pipeline)
    return tuple(base + (s < extra) for s in range(pipeline))


def balanced_stages(model: ModelSpec, topology, stage_ranks: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Layer counts balancing compute and memory over unequal devices: each stage's share of the
    layers is its share of the cluster's peak FLOP/s in the model's dtype (the slowest rank of a
    tensor-parallel group sets its pace: the group counts ``tensor x`` its slowest device), rounded
    by largest remainder with at least one layer per stage; then a stage whose layers' weights
    (:func:`models.accounting.stage_weight_bytes`) exceed its smallest device's memory hands
    layers to the stages with the most memory to spare, as long as one has room. Balancing
    compute evens the stage times, which bound a pipeline's throughput (GPipe, arXiv 1811.06965,
    section 2); the memory pass is the constraint placement systems add (e.g. HexGen, arXiv
    2311.11514)."""
    layers, count = model.num_layers, len(stage_ranks)
    tensor = len(stage_ranks[0])
    speed = [tensor * min(topology.devices[r].spec.peak_flops(model.dtype) for r in ranks) for ranks in stage_ranks]
    ideal = [layers * s / sum(speed) for s in speed]
    stages = [max(1, int(x)) for x in ideal]
    while sum(stages) > layers:  # the minimum of one layer each overshot: take from the largest
        stages[max(range(count), key=lambda s: (stages[s] - ideal[s], stages[s]))] -= 1
    for s in sorted(range(count), key=lambda s: (stages[s] - ideal[s], s))[:layers - sum(stages)]:
        stages[s] += 1

    def room(s: int) -> int:
        """Bytes left on stage s's smallest device with its current layers."""
        capacity = min(topology.devices[r].memory_capacity_bytes for r in stage_ranks[s])
        return capacity - stage_weight_bytes(model, tensor, stages[s], embeds=s == 0, heads=s == count - 1)

    per_layer = sum(layer_block_weight_bytes(model, tensor).values())
    for _ in range(layers):
        over = [s for s in range(count) if room(s) < 0 and stages[s] > 1]
        spare = [s for s in range(count) if room(s) >= per_layer]
        if not over or not spare:
            break
        stages[over[0]] -= 1
        stages[max(spare, key=lambda s: (room(s), -s))] += 1
    return tuple(stages)


def _device_lists(lists: list[list[str]], devices: tuple[str, ...], tensor: int | None,
                  pipeline: int) -> tuple[int, ...]:
    """The placement per-stage device lists (device names) give, checked."""
    if pipeline not in (1, len(lists)):
        raise ConfigError("parallel.stages", f"{len(lists)} device lists for parallel.pipeline {pipeline} "
                                             f"(got {len(lists)} lists)")
    sizes = {len(names) for names in lists}
    if len(sizes) != 1 or (tensor is not None and sizes != {tensor}):
        raise ConfigError("parallel.stages", f"every stage's device list must hold the tensor-parallel degree's "
                                             f"{tensor or 'same number of'} devices (got sizes "
                                             f"{[len(names) for names in lists]})")
    placement = []
    for s, names in enumerate(lists):
        for name in names:
            if name not in devices:
                raise ConfigError(f"parallel.stages[{s}]", f"not a device of the cluster; devices: "
                                                           f"{', '.join(devices)} (got {name!r})")
            if devices.index(name) in placement:
                raise ConfigError(f"parallel.stages[{s}]", f"device {name} is in two stages' lists (got {name!r})")
            placement.append(devices.index(name))
    return tuple(placement)


def rank_needs_bytes(spec: ModelSpec, parallel: ParallelPlan, batches: tuple[int, ...],
                     kv_tokens_per_sequence: int) -> dict[int, tuple[int, int]]:
    """Each rank's resident weights and KV cache (bytes) when the run holds ``kv_tokens_per_sequence``
    tokens of each sequence: replica i serving ``batches[i]`` sequences; a pipeline stage's ranks
    hold only its layers' weights (the first stage's master the embeddings, the last's the final
    norm and LM head, :func:`models.accounting.stage_weight_bytes`) and KV cache, for every
    sequence of the batch. The simulator allocates the same (:class:`sim.plan.Plan`)."""
    needs = {}
    per_layer_kv = {}
    last = parallel.pipeline - 1
    for replica, (ranks, shards, batch) in enumerate(zip(parallel.replica_ranks, parallel.replica_shards, batches)):
        for s, layers in enumerate(parallel.stages):
            group = ranks[s * parallel.tensor:(s + 1) * parallel.tensor]
            for i, rank in enumerate(group):
                shard = None if shards is None else shards[i]
                master = i == 0
                weights = stage_weight_bytes(spec, parallel.tensor, layers, embeds=master and s == 0,
                                             heads=master and s == last, shard=shard)
                key = (shard, parallel.tensor)
                if key not in per_layer_kv:
                    per_layer_kv[key] = kv_cache_bytes_per_token(spec, parallel.tensor, shard=shard) // spec.num_layers
                needs[rank] = (weights, per_layer_kv[key] * layers * batch * kv_tokens_per_sequence)
    return needs
