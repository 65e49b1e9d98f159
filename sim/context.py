"""Calibration context: what a profile was measured on, and what of it carries over to a scenario.

A profile's ``context`` rows (:mod:`sim.profile`) record the cluster its timings come from: the
device types and dtype the ranks computed in, the ranks per host of the calibrated group, the
cores those ranks shared, each link class's rate, one-way delay and token-bucket burst (None: no
bucket; a profile written before bursts were recorded ran on the emulated testbed, whose every
link then had a tbf bucket: :data:`LEGACY_TESTBED_BURST_BYTES`), the communication backend and
transport, the torch version and, for a training calibration, the model it trained (every field of
its :class:`models.spec.ModelSpec`, so that its whole passes are set against that model's ops,
:mod:`sim.training.step_compute`). :func:`compare` sets them against a scenario, term by term:

* ``same``: carries over unchanged (compute of the same device type and dtype, and its reduction
  cost per byte where the profile has ``reduction`` rows: :func:`sim.reduction.reduction_terms`,
  joined to these terms by :func:`sim.calibrated.calibrated_network`; a network whose
  links, group shape and backend are the calibrated ones, so its in-place and isolated collective
  timings may be replayed: *same-cluster mode*);
* ``rescaled``: priced by a model from terms fitted on the profile (network terms at other rates,
  delays or group shapes: :mod:`sim.transport`);
* ``not applicable``: nothing in the profile prices it (another device type, another backend):
  the uncalibrated model prices it.

One row per context term: ``measurement`` = ``context``, ``call`` = the calibrated cluster's
name (so a pool of several profiles keeps each one's context apart), ``op`` = the term
(:class:`ContextTerm`), ``device_class`` = its subject (a device type, a link class), ``method``
= its value as a JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import pandas as pd

from models.spec import ModelSpec
from sim.cores import CorePool
from sim.topology import Topology
from sim.vocabulary import Calibration, MeasurementKind

RELATIVE_TOLERANCE = 0.01  # rates and delays within 1% are the same link
# Other processes' share of the machine's CPU time above which a calibration's timings are flagged
# as possibly inflated (issue 18 item 3): at 10% of all cores an instant's ranks already lose a
# core's worth on a small machine now and then; a judgement threshold, not fitted to any result.
LOADED_OTHER_LOAD = 0.10


class ContextTerm(str, Enum):
    """What a context row records."""

    DEVICE = "device"  # device_class: device type; dtype; {"ranks": n}
    HOSTS = "hosts"  # {"ranks_per_host": [..]} of the calibrated group, in host order
    CORES = "cores"  # {"cores": n}: the CPU cores the ranks shared
    LINK = "link"  # device_class: link class; {"rate_bytes_per_s": r, "delay_s": d, "burst_bytes": b or null}
    BACKEND = "backend"  # {"backend": "gloo", "transport": "tcp"}
    TORCH = "torch"  # {"version": "2.13.0"}
    LOAD = "load"  # {"cpu_steal": f, "other_load": f}: shares of the machine's CPU time over the calibration
    MODEL = "model"  # device_class: the model's name; every field of its ModelSpec (a training calibration's)
    MEMORY = "memory"  # {"streams": [1, 2, ..], "stream_bytes_per_s": [..]}: the machine's aggregate bandwidth
    SPEED = "speed"  # {"ops": [..], "seconds": [..]}: the reference op set's median times around the calibration


class LinkClass(str, Enum):
    """Where a point-to-point message goes (the ``device_class`` of ``p2p`` rows too)."""

    INTRA_HOST = "intra_host"
    INTER_HOST = "inter_host"


# The tbf buckets of the emulated testbed before links declared a burst (runtime.testbed.shaping
# then applied max(32 kB, two MTUs): 32 kB between hosts, MTU 9000; 2 x 65536 bytes on lo): what a
# profile whose link rows lack "burst_bytes" was calibrated with. Every such profile is the testbed's.
LEGACY_TESTBED_BURST_BYTES = {LinkClass.INTER_HOST: 32_000, LinkClass.INTRA_HOST: 131_072}


class Verdict(str, Enum):
    """How a term of a scenario is priced from a profile (:func:`compare`)."""

    SAME = "same"
    RESCALED = "rescaled"
    NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class Link:
    """A class of point-to-point path: its bottleneck rate (bytes/s), one-way delay (s) and the
    token-bucket depth of its bottleneck (bytes, None: no bucket; :mod:`sim.token_bucket`)."""

    link_class: LinkClass
    rate_bytes_per_s: float
    delay_s: float
    burst_bytes: int | None = None

    def matches(self, other: Link) -> bool:
        return (self.link_class == other.link_class and self.same_burst(other)
                and _close(self.rate_bytes_per_s, other.rate_bytes_per_s) and _close(self.delay_s, other.delay_s))

    def same_burst(self, other: Link) -> bool:
        """Both without a bucket, or buckets within :data:`RELATIVE_TOLERANCE`."""
        if self.burst_bytes is None or other.burst_bytes is None:
            return self.burst_bytes is None and other.burst_bytes is None
        return _close(self.burst_bytes, other.burst_bytes)

    def describe(self) -> str:
        return (f"{self.link_class.value} {self.rate_bytes_per_s * 8 / 1e6:g} Mbit/s, {self.delay_s * 1e3:g} ms"
                + ("" if self.burst_bytes is None else f", burst {self.burst_bytes / 1e3:g} kB"))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RELATIVE_TOLERANCE * max(abs(a), abs(b), 1e-12)


@dataclass(frozen=True)
class CalibrationContext:
    """What a profile was measured on (or what a scenario asks for; unknowns are None).

    Attributes:
        name: the calibrated cluster (scenario) name.
        devices: (device type, dtype, ranks) of the group, sorted.
        ranks_per_host: the group's ranks on each of its hosts, in host order.
        links: the distinct link classes between the group's ranks, sorted.
        cores: CPU cores the ranks shared; None where unknown (a scenario does not say).
        backend: communication backend and transport, such as ``gloo/tcp``; None: unknown.
        torch_version: None where unknown.
        layout: a target's parallel layout where it is not what a calibration measures, even
            tensor parallelism over the whole group (:attr:`sim.parallel.ParallelPlan.uncalibrated_layout`:
            a pipeline, an uneven split); None for that, and for every profile's context.
        pipelined: a target whose layers run in pipeline stages, each stage computing on its own
            schedule (:func:`core_contention` says what it changes); False for every profile's.
        cpu_steal, other_load: the shares of the machine's CPU time the hypervisor stole and other
            processes took while the calibration ran (:func:`runtime.cpu_steal.load_during`);
            None where unknown (a scenario, a profile written before they were recorded).
        model: the model a training calibration trained, or a training scenario trains; None for
            an inference one and for a profile written before it was recorded.
        stream_bytes_per_s: the machine's aggregate memory bandwidth, (one-thread processes
            streaming at once, bytes/s) pairs (:mod:`runtime.stream_bandwidth`); empty where not
            measured (:class:`sim.cores.CorePool`).
        reference_s: the machine's speed around the calibration, (reference op, median s) pairs
            (:mod:`sim.machine_speed`, timed by :mod:`runtime.reference_timing`); empty where not
            recorded (a scenario, a profile written before it was). No simulation reads it.
    """

    name: str
    devices: tuple[tuple[str, str, int], ...]
    ranks_per_host: tuple[int, ...]
    links: tuple[Link, ...]
    cores: int | None = None
    backend: str | None = None
    torch_version: str | None = None
    layout: str | None = None
    pipelined: bool = False
    cpu_steal: float | None = None
    other_load: float | None = None
    model: ModelSpec | None = None
    stream_bytes_per_s: tuple[tuple[int, float], ...] = ()
    reference_s: tuple[tuple[str, float], ...] = ()

    def same_network(self, other: CalibrationContext) -> bool:
        """Same group shape, backend and links (each of ``other``'s matches one of these)."""
        return (self.ranks_per_host == other.ranks_per_host
                and (self.backend is None or other.backend is None or self.backend == other.backend)
                and len(self.links) == len(other.links)
                and all(any(mine.matches(theirs) for mine in self.links) for theirs in other.links))


def scenario_context(name: str, topology: Topology, ranks: tuple[int, ...], dtype: str, *,
                     cores: int | None = None, backend: str | None = None,
                     torch_version: str | None = None, layout: str | None = None,
                     pipelined: bool = False, model: ModelSpec | None = None) -> CalibrationContext:
    """The context of ``ranks`` of ``topology`` computing in ``dtype``: devices, ranks per host and
    every distinct link class between two of the ranks (rate: the path's narrowest channel;
    delay: the sum of its channels' latencies, :meth:`sim.topology.Topology.path_latency_s`;
    burst: the narrowest channel's bucket, :meth:`sim.topology.Topology.path_burst_bytes`);
    ``layout``, ``pipelined``, ``model``: see :class:`CalibrationContext`."""
    counts: dict[tuple[str, str], int] = {}
    for rank in ranks:
        key = (topology.devices[rank].spec.name, dtype)
        counts[key] = counts.get(key, 0) + 1
    links: list[Link] = []
    for a in ranks:
        for b in ranks:
            if a == b:
                continue
            same_host = topology.same_host(a, b)
            link = Link(LinkClass.INTRA_HOST if same_host else LinkClass.INTER_HOST,
                        topology.path_bandwidth_bytes_per_s(a, b), topology.path_latency_s(a, b),
                        topology.path_burst_bytes(a, b))
            if not any(link.matches(known) for known in links):
                links.append(link)
    links.sort(key=lambda l: (l.link_class.value, l.rate_bytes_per_s, l.delay_s))
    return CalibrationContext(name, tuple(sorted((d, t, n) for (d, t), n in counts.items())),
                              tuple(len(group) for group in topology.host_groups(ranks)), tuple(links),
                              cores, backend, torch_version, layout, pipelined, model=model)


def _row(name: str, term: ContextTerm, value: dict, subject: str | None = None, dtype: str | None = None) -> dict:
    """One context row of cluster ``name`` (the layout in this module's docstring)."""
    return {"measurement": MeasurementKind.CONTEXT, "call": name, "op": term.value, "device_class": subject,
            "dtype": dtype, "method": json.dumps(value, sort_keys=True)}


def context_rows(context: CalibrationContext) -> list[dict]:
    """The profile rows (dicts of :data:`sim.profile.PROFILE_COLUMNS`) recording ``context``."""
    def row(term: ContextTerm, value: dict, subject: str | None = None, dtype: str | None = None) -> dict:
        return _row(context.name, term, value, subject, dtype)

    rows = [row(ContextTerm.DEVICE, {"ranks": n}, device, dtype) for device, dtype, n in context.devices]
    rows.append(row(ContextTerm.HOSTS, {"ranks_per_host": list(context.ranks_per_host)}))
    rows += [row(ContextTerm.LINK, {"rate_bytes_per_s": l.rate_bytes_per_s, "delay_s": l.delay_s,
                                    "burst_bytes": l.burst_bytes}, l.link_class.value)
             for l in context.links]
    if context.cores is not None:
        rows.append(row(ContextTerm.CORES, {"cores": context.cores}))
    if context.backend is not None:
        backend, _, transport = context.backend.partition("/")
        rows.append(row(ContextTerm.BACKEND, {"backend": backend, "transport": transport}))
    if context.torch_version is not None:
        rows.append(row(ContextTerm.TORCH, {"version": context.torch_version}))
    if context.cpu_steal is not None and context.other_load is not None:
        rows += load_rows(context.name, context.cpu_steal, context.other_load)
    if context.model is not None:
        rows.append(row(ContextTerm.MODEL, dataclasses.asdict(context.model), context.model.name))
    if context.stream_bytes_per_s:
        rows += memory_rows(context.name, context.stream_bytes_per_s)
    if context.reference_s:
        rows += speed_rows(context.name, dict(context.reference_s))
    return rows


def speed_rows(name: str, reference_s: dict[str, float]) -> list[dict]:
    """The context row recording how fast the machine cluster ``name`` was calibrated on ran the
    reference op set (:mod:`sim.machine_speed`): each op's median time (s); none where empty."""
    if not reference_s:
        return []
    ops = sorted(reference_s)
    return [_row(name, ContextTerm.SPEED, {"ops": ops, "seconds": [float(reference_s[op]) for op in ops]})]


def memory_rows(name: str, stream_bytes_per_s) -> list[dict]:
    """The context row recording the aggregate memory bandwidth of the machine cluster ``name``
    was calibrated on: (one-thread processes streaming at once, bytes/s) pairs."""
    return [_row(name, ContextTerm.MEMORY, {"streams": [int(k) for k, _ in stream_bytes_per_s],
                                           "stream_bytes_per_s": [float(b) for _, b in stream_bytes_per_s]})]


def load_rows(name: str, cpu_steal: float, other_load: float) -> list[dict]:
    """The context row recording that the calibration of cluster ``name`` ran while the hypervisor
    stole ``cpu_steal`` and other processes took ``other_load`` of the machine's CPU time
    (fractions); none where either is unknown (NaN: ``/proc/stat`` unreadable)."""
    if math.isnan(cpu_steal) or math.isnan(other_load):
        return []
    return [_row(name, ContextTerm.LOAD, {"cpu_steal": cpu_steal, "other_load": other_load})]


def profile_contexts(rows: pd.DataFrame) -> tuple[CalibrationContext, ...]:
    """The contexts recorded in a profile's rows, one per calibrated cluster (a pooled profile
    holds several), by name; empty for a profile without context rows. A link row without
    ``burst_bytes`` (a profile written before bursts were recorded) gets the bucket the emulated
    testbed applied then (:data:`LEGACY_TESTBED_BURST_BYTES`).

    Raises:
        ValueError, KeyError, TypeError: a row that does not read (a model row's fields not a
            :class:`models.spec.ModelSpec`'s: :class:`models.errors.ConfigError` naming the field).
    """
    contexts = []
    for name, of_name in rows[rows["measurement"] == MeasurementKind.CONTEXT].groupby("call", sort=True):
        devices, links = [], []
        fields: dict = {}
        for row in of_name.itertuples(index=False):
            value = json.loads(row.method)
            term = ContextTerm(row.op)
            if term is ContextTerm.DEVICE:
                devices.append((str(row.device_class), str(row.dtype), int(value["ranks"])))
            elif term is ContextTerm.LINK:
                link_class = LinkClass(row.device_class)
                burst = value["burst_bytes"] if "burst_bytes" in value else LEGACY_TESTBED_BURST_BYTES[link_class]
                links.append(Link(link_class, float(value["rate_bytes_per_s"]), float(value["delay_s"]),
                                  None if burst is None else int(burst)))
            elif term is ContextTerm.HOSTS:
                fields["ranks_per_host"] = tuple(int(n) for n in value["ranks_per_host"])
            elif term is ContextTerm.CORES:
                fields["cores"] = int(value["cores"])
            elif term is ContextTerm.BACKEND:
                fields["backend"] = f"{value['backend']}/{value['transport']}"
            elif term is ContextTerm.LOAD:
                fields["cpu_steal"] = float(value["cpu_steal"])
                fields["other_load"] = float(value["other_load"])
            elif term is ContextTerm.MODEL:
                fields["model"] = ModelSpec(**value)
            elif term is ContextTerm.SPEED:
                fields["reference_s"] = tuple(zip((str(op) for op in value["ops"]),
                                                  (float(t) for t in value["seconds"]), strict=True))
            elif term is ContextTerm.MEMORY:
                fields["stream_bytes_per_s"] = tuple(zip((int(k) for k in value["streams"]),
                                                         (float(b) for b in value["stream_bytes_per_s"]), strict=True))
            else:
                fields["torch_version"] = str(value["version"])
        contexts.append(CalibrationContext(str(name), tuple(sorted(devices)), fields.pop("ranks_per_host", ()),
                                           tuple(sorted(links, key=lambda l: (l.link_class.value,
                                                                              l.rate_bytes_per_s, l.delay_s))),
                                           **fields))
    return tuple(contexts)


def calibrated_speed(contexts: tuple[CalibrationContext, ...]) -> dict[str, float]:
    """The reference op set's median times (s, by op) recorded with the profile's calibration
    (:attr:`CalibrationContext.reference_s`); empty where none recorded them, or where a pool's
    calibrations recorded different ones (no row says which of them priced a run)."""
    recorded = {c.reference_s for c in contexts if c.reference_s}
    return dict(recorded.pop()) if len(recorded) == 1 else {}


def load_warning(contexts: tuple[CalibrationContext, ...]) -> str:
    """One line warning that the calibrations in ``contexts`` whose other processes took more than
    :data:`LOADED_OTHER_LOAD` of the machine's CPU time may have inflated timings; '' where none
    did or none recorded it."""
    loaded = [c for c in contexts if c.other_load is not None and c.other_load > LOADED_OTHER_LOAD]
    if not loaded:
        return ""
    return ("calibrated under load: other processes took " + ", ".join(
        f"{c.other_load:.1%} of the machine's CPU time in {c.name} (steal {c.cpu_steal:.1%})" for c in loaded)
        + f", above {LOADED_OTHER_LOAD:.0%}: the profile's timings may be inflated")


@dataclass(frozen=True)
class TermComparison:
    """One term of a scenario against a profile's context: what prices it and why."""

    term: str
    verdict: Verdict
    detail: str

    def line(self) -> str:
        return f"{self.term}: {self.verdict.value} ({self.detail})"


def same_cluster(contexts: tuple[CalibrationContext, ...], target: CalibrationContext) -> bool:
    """Whether the profile's timings of whole collectives may be replayed on ``target``: one
    calibrated cluster, whose network (links, group shape, backend) is the target's, run in the
    calibrated layout (a pipeline's or an uneven split's steps call other collectives at other
    times, and leave cores idle that the calibration's ranks shared)."""
    return len(contexts) == 1 and contexts[0].same_network(target) and target.layout == contexts[0].layout


def compare(contexts: tuple[CalibrationContext, ...], target: CalibrationContext) -> tuple[TermComparison, ...]:
    """Each term of ``target`` against the profile's ``contexts``; see the module docstring."""
    if not contexts:
        return (TermComparison("context", Verdict.NOT_APPLICABLE,
                               "the profile records no context: its timings are taken to be of this cluster"),)
    names = ", ".join(c.name for c in contexts)
    out = []
    calibrated_devices = {(d, t) for c in contexts for d, t, _ in c.devices}
    for device, dtype, _ in target.devices:
        if (device, dtype) in calibrated_devices:
            out.append(TermComparison(f"compute on {device} {dtype}", Verdict.SAME, f"measured on {names}"))
        else:
            out.append(TermComparison(f"compute on {device} {dtype}", Verdict.NOT_APPLICABLE,
                                      "not calibrated: roofline"))
    if target.layout is not None:
        out.append(TermComparison(f"layout {target.layout}", Verdict.RESCALED,
                                  f"{names} measured even tensor parallelism over its group: compute per op kind "
                                  "from its rows at this layout's shapes, on cores shared as the simulation runs; "
                                  "collectives and the hops between stages by transport terms fitted on its sweep "
                                  "and ping-pongs"))
    if target.model is not None:
        out += _model_term(contexts, target.model)
    if same_cluster(contexts, target):
        out.append(TermComparison("network", Verdict.SAME,
                                  f"same-cluster mode: links, group shape and backend are {names}'s; its "
                                  "collective timings (in place, per plan op, and isolated) are replayed"))
        return tuple(out)
    calibrated_links = [l for c in contexts for l in c.links]
    for link in target.links:
        seen = any(link.matches(known) for known in calibrated_links)
        out.append(TermComparison(f"link {link.describe()}", Verdict.RESCALED,
                                  ("within the calibrated range" if seen else "outside every calibrated link")
                                  + ": transport terms fitted on the profile's collectives, priced over this link"))
        out.append(_burst_term(link, [l for l in calibrated_links if l.link_class == link.link_class], names))
    shapes = sorted({c.ranks_per_host for c in contexts})
    if target.ranks_per_host not in shapes:
        out.append(TermComparison(f"group of {list(target.ranks_per_host)} ranks per host", Verdict.RESCALED,
                                  f"calibrated on {[list(s) for s in shapes]}: collectives priced as their schedule"))
    backends = {c.backend for c in contexts} - {None}
    if target.backend is not None and backends and target.backend not in backends:
        out.append(TermComparison(f"backend {target.backend}", Verdict.NOT_APPLICABLE,
                                  f"calibrated with {', '.join(sorted(backends))}: transport defaults"))
    out.append(TermComparison("in-place collective timings", Verdict.NOT_APPLICABLE,
                              f"measured on another network ({names}): not replayed"))
    return tuple(out)


def recorded_model(contexts: tuple[CalibrationContext, ...]) -> ModelSpec | None:
    """The model the profile's training calibration trained: the one its contexts record (None
    where none records one, a profile written before they did, or where a pool's calibrations
    trained different models: no row says which of them it timed)."""
    models = [c.model for c in contexts if c.model is not None]
    return models[0] if models and all(m.same_architecture(models[0]) for m in models) else None


def _model_term(contexts: tuple[CalibrationContext, ...], model: ModelSpec) -> list[TermComparison]:
    """The verdict on a training scenario's ``model`` against the models the calibrations in
    ``contexts`` trained: ``same`` (its architecture, under any name), else ``rescaled`` (each
    whole pass's factor found on the calibration's own model's ops, applied to this model's:
    :mod:`sim.training.step_compute`); none where no context records a model."""
    recorded = sorted({c.model.name for c in contexts if c.model is not None})
    if not recorded:
        return []
    term = f"model {model.name}"
    trained = recorded_model(contexts)
    if trained is None:
        return [TermComparison(term, Verdict.RESCALED, f"calibrations of several models ({', '.join(recorded)}): "
                                                       "the passes' factors against the one whose FLOPs match")]
    if trained.same_architecture(model):
        return [TermComparison(term, Verdict.SAME, f"the model the calibration trained ({trained.name}): "
                                                   "its whole passes' factors as measured")]
    return [TermComparison(term, Verdict.RESCALED,
                           f"the calibration trained another model, {trained.name}: each whole pass's factor on its "
                           f"ops' per-call time found against {trained.name}'s ops, applied to this model's")]


def _burst_term(link: Link, calibrated: list[Link], names: str) -> TermComparison:
    """The verdict on ``link``'s token bucket against the ``calibrated`` links of its class:
    ``same`` where one of them had that bucket (or none, as it has none), else ``rescaled``: the
    bucket model prices it, as it took the calibrated links' buckets out of the fitted terms."""
    bucket = "no bucket" if link.burst_bytes is None else f"{link.burst_bytes / 1e3:g} kB"
    term = f"burst of {link.link_class.value} link ({bucket})"
    if any(link.same_burst(known) for known in calibrated):
        return TermComparison(term, Verdict.SAME, f"as calibrated on {names}")
    known = sorted({"none" if l.burst_bytes is None else f"{l.burst_bytes / 1e3:g} kB" for l in calibrated})
    return TermComparison(term, Verdict.RESCALED,
                          f"calibrated with {', '.join(known) or 'no such link'}: token buckets priced by "
                          "sim.token_bucket, taken out of the terms fitted on the profile")


def core_contention(contexts: tuple[CalibrationContext, ...], target: CalibrationContext,
                    ranks: tuple[int, ...], concurrency: dict[int, float] | None = None,
                    lag_per_block: float = 0.0) -> tuple[float, tuple[CorePool, ...], str, dict[int, float]]:
    """How ranks sharing CPU cores are priced: (factor on calibrated compute times, the target's
    core pools for the engine's processor sharing, :mod:`sim.cores`, a line saying why, the
    factor per calibrated ``new_tokens`` where it differs by phase).
    The pool shares the calibrated machine's memory bandwidth where the profile measured it
    (:attr:`CalibrationContext.stream_bytes_per_s`; the target runs on that machine's cores).

    Compute is timed in place, with every rank of the calibrated group running: where the ranks
    that computed at once outnumbered the cores, each got ``cores / computing`` of one and its
    ops took ``computing / cores`` times as long (processor sharing: :mod:`sim.cores`). The
    factor takes that out, so that a calibrated time is an op's work on a core of its own, and
    the target's ``ranks`` compete for its cores in the simulation, as many at once as compute
    at that moment. A pipeline's stages compute on their own schedule, which the simulation
    runs as it is (a stage computes while the others wait for its activations), so its ops get
    the work the calibrated rows measured given how many ranks computed at once in each
    calibrated phase (``concurrency``: per ``new_tokens`` of the calibrated generations,
    :func:`sim.concurrency.calibrated_concurrency`; a prefill's ranks desynchronised by its
    payloads). A tensor-parallel target, even or uneven, keeps every calibrated rank: the
    simulation runs its ranks through each step together, as the factor assumes, so its ops
    stretch back to the times measured (a prefill's desynchronised ranks, which the simulation
    does not reproduce, would otherwise be charged contention they did not have: the offline
    transfer figure, TTFT other, went from 9.9% to 13.5% median when they were). The first
    factor, for rows without an estimate, takes every calibrated rank. The target's
    cores are the calibrated machine's where the scenario does not say (the emulated hosts share
    one machine). Factor 1 and no pool for devices of their own (no cores recorded) and in
    same-cluster mode (the in-place times hold the contention as it was).

    Args:
        ranks: the target's ranks (topology rank ids) that run the plan.
        lag_per_block: the pool's arrival lag coefficient (:mod:`sim.arrival_skew`, fitted on
            the calibration).
    """
    known = [c for c in contexts if c.cores is not None]
    if not known or same_cluster(contexts, target):
        return 1.0, (), "core contention: as calibrated", {}
    calibrated = known[0]
    cores = target.cores or calibrated.cores
    calibrated_ranks = sum(calibrated.ranks_per_host)
    scale = 1.0 / max(1.0, calibrated_ranks / calibrated.cores)
    phases = {int(n): 1.0 / max(1.0, k / calibrated.cores) for n, k in sorted((concurrency or {}).items())}
    # the calibrated machine's bandwidth where the target runs on its cores (a machine of other cores is another)
    memory = calibrated.stream_bytes_per_s if cores == calibrated.cores else ()
    pool = CorePool(frozenset(ranks), cores, stream_bytes_per_s=memory, lag_per_block=lag_per_block)
    per_phase = "" if not phases else " (" + ", ".join(
        f"{'decode' if n == 1 else f'prefill of {n}'} x {f:.2f}" for n, f in phases.items()) + \
        ": the ranks computing at once per calibrated phase, sim.concurrency)"
    return scale, (pool,), (f"core contention: calibrated compute x {scale:.2f} ({calibrated_ranks} ranks on "
                            f"{calibrated.cores} cores in {calibrated.name}){per_phase}, then {pool.describe()} "
                            "sharing them as the simulation runs (processor sharing)"), phases


OUTSIDE = "outside: "
"""What precedes the terms outside a profile's context in :func:`profile_context`."""


def outside(context_text: str) -> bool:
    """Whether a :func:`profile_context` text names terms outside the profile's context."""
    return OUTSIDE in context_text


def calibration_mode(choice) -> Calibration:
    """How a profile priced a run (:class:`sim.vocabulary.Calibration`): ``choice``, the
    :class:`sim.calibrated.NetworkChoice` a profile gave it (None: no profile), replays this
    cluster's timings (same-cluster mode) or predicts from fitted terms."""
    if choice is None:
        return Calibration.UNCALIBRATED
    return Calibration.REPLAY if choice.same_cluster else Calibration.PREDICTION


def shared_calibration(variants: Iterable[str], choice) -> dict[str, Calibration]:
    """How each of ``variants`` (names) was priced where one network ``choice`` priced them all
    (a serving or training simulation): variant name -> :func:`calibration_mode` of ``choice``."""
    mode = calibration_mode(choice)
    return {name: mode for name in variants}


def profile_context(result) -> str:
    """How a calibration profile priced a simulated run, in a few words: its
    :func:`calibration_mode` (``replay`` or ``prediction``), then, after ``; outside: ``, the
    terms outside the profile's context (:func:`compare`'s verdicts other than ``same``) and the
    count of extrapolated predictions, where there are any; '' where the run says nothing of it.
    ``result``: any simulation's result with ``network`` (the :class:`sim.calibrated.NetworkChoice`
    a profile gave it, None uncalibrated) and ``extrapolated`` (the predictions the profile did not
    cover, :attr:`sim.simulate.SimulationResult.extrapolated`) and ``calibrated`` (whether a
    profile priced it: an uncalibrated inference run's ``network`` holds its default transport terms)."""
    if not result.calibrated or result.network is None:
        return ""
    outside = [t.term for t in result.network.terms if t.verdict.value != "same"]
    if result.extrapolated:
        outside.append(f"{len(result.extrapolated)} extrapolated predictions")
    mode = calibration_mode(result.network).value
    return mode if not outside else f"{mode}; {OUTSIDE}" + "; ".join(outside)
