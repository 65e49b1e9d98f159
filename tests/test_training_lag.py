"""Ranks a training step's last ring releases apart, on cores they share (sim.training.lag)."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.ops import OpKind
from sim.program import Stream
from sim.training import simulate as training_simulate
from sim.training.lag import bucket_segment, with_lags
from sim.vocabulary import TrainingPhase
from validation.training_validation import load_report_clusters, load_training_matrix

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "validation" / "training-overlap.yaml"  # v2x2_bandwidth: 5 MiB buckets, overlap on and off
REPORT = ROOT / "validation" / "training-report" / "overlap-s24"


@pytest.fixture(scope="module")
def calibrated():
    _, scenarios = load_training_matrix(MATRIX)
    runs = load_report_clusters(scenarios, REPORT)
    return scenarios[0], runs[scenarios[0].name].profile


def _steps(scenario, profile) -> dict[str, object]:
    simulated = training_simulate.simulate_training(scenario, profile)
    return {v.variant.name: v for v in simulated.variants}


def test_the_ranks_receiving_across_hosts_last_start_the_bucket_segment_asleep(calibrated):
    scenario, profile = calibrated
    for name, result in _steps(scenario, profile).items():
        ops = result.trace.ops
        lags = ops[ops["kind"] == OpKind.STEP_LAG.value]
        # ring 0 -> 1 -> 2 -> 3 -> 0 over n0 = {0, 1}, n1 = {2, 3}: 0 and 2 receive over 100 Mbit/s
        assert set(lags["rank"]) == {0, 2}, name
        chunk_s = 5 * 2**20 / 4 / 12.5e6  # a quarter of the last bucket over the slow link
        assert (lags["end_s"] - lags["start_s"]).between(0.7 * chunk_s, 1.1 * chunk_s).all(), name
        assert set(lags["phase"]) == {TrainingPhase.LAG.value}


def test_without_overlap_the_lag_overlaps_the_early_ranks_compute_and_with_it_does_not(calibrated, monkeypatch):
    """Measured on that cluster (sim.training.lag): from the late rank's start the last gradient
    came 0.37-0.44 s in without overlap, where every rank starting together needs 0.52 s; with
    overlap the chain of buckets waits for the late ranks, and the step is no shorter."""
    scenario, profile = calibrated
    lagged = _steps(scenario, profile)
    monkeypatch.setattr(training_simulate, "finish_lags", lambda simulated: {})
    together = _steps(scenario, profile)
    lag_s = 5 * 2**20 / 4 / 12.5e6
    no_overlap = together["no_overlap"].metrics["step_time_s"] - lagged["no_overlap"].metrics["step_time_s"]
    overlap = together["bucket5_acc1_ckptoff"].metrics["step_time_s"] - lagged["bucket5_acc1_ckptoff"].metrics[
        "step_time_s"]
    assert 0.5 * lag_s < no_overlap < 1.2 * lag_s
    assert abs(overlap) < 0.3 * lag_s
    gain = lambda steps: steps["no_overlap"].metrics["step_time_s"] / steps["bucket5_acc1_ckptoff"].metrics[
        "step_time_s"]
    assert gain(lagged) < gain(together) - 0.02


def test_lags_start_the_bucket_segment_and_keep_every_ops_dependencies(calibrated):
    scenario, profile = calibrated
    from sim.training.lower import lower_step

    result = training_simulate.simulate_training(scenario, profile).variants[0]
    step = result.steps[0].step
    index = bucket_segment(step)
    assert index is not None
    lagged = with_lags(step, {0: 0.1, 1: 0.0})
    before, after = step.segments[index].segment.programs, lagged.segments[index].segment.programs
    assert after[1] == before[1]  # no lag, no change
    assert after[0][0].kind is OpKind.STEP_LAG and after[0][0].stream is Stream.COMPUTE
    for old, new in zip(before[0], after[0][1:]):
        assert new.after == (None if old.after is None else tuple(i + 1 for i in old.after))
    assert lagged.segments[index].phases[0][0] is TrainingPhase.LAG
    assert [s.segment for i, s in enumerate(lagged.segments) if i != index] == [
        s.segment for i, s in enumerate(step.segments) if i != index]
    # a step whose ranks the parameter average releases last: no bucket segment, nothing lagged
    averaging = lower_step(_shape(result, scenario), sync_gradients=False, average_parameters=True)
    assert bucket_segment(averaging) is None and with_lags(averaging, {0: 0.1}) is averaging


def _shape(result, scenario):
    from sim.parallel import ParallelPlan
    from sim.topology import build_topology
    from sim.training.lower import StepShape

    plan = ParallelPlan.of(scenario, build_topology(scenario.config.cluster))
    return StepShape(scenario.model, result.settings, result.micro_batch_size, scenario.config.workload.sequence_length,
                     result.accumulation, plan.replica_ranks)
