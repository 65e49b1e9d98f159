"""DDP's gradient buckets: which parameters' gradients are fused into one allreduce.

PyTorch's reducer (``compute_bucket_assignment_by_size`` in
``torch/csrc/distributed/c10d/reducer.cpp``) walks the parameters in order, appends each to the
open bucket and closes the bucket once its size reaches the current limit (``>=``: the parameter
that crosses the limit stays in it); the limits are a list whose last entry repeats. After the
first iteration ``Reducer::rebuild_buckets`` reassigns the buckets over the parameters in the
order their gradients became ready during backward, with limits ``[first_bucket_bytes_cap,
bucket_bytes_cap]`` (``torch/nn/parallel/distributed.py``, ``BucketCapacityConfig``), and
every later iteration launches bucket i's allreduce once all its gradients are ready and all
buckets before it are launched. The simulator models that steady state: buckets over the
gradient-ready order (the reverse of the forward's use of the parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

from models.errors import ConfigError


def bucket_assignment(sizes_bytes: Sequence[int], limits_bytes: Sequence[int]) -> list[list[int]]:
    """Indices into ``sizes_bytes`` of each bucket, in order.

    Args:
        sizes_bytes: gradient bytes of each parameter, in the order they are assigned (DDP's
            rebuilt buckets: gradient-ready order).
        limits_bytes: bucket size limits in bytes; bucket i closes at ``limits[min(i, len - 1)]``
            (DDP: ``[first_bucket_bytes, bucket_cap_bytes]``).

    Returns:
        Lists of parameter indices, every parameter in exactly one, each bucket's parameters in
        order; all but the last bucket hold at least their limit.

    Raises:
        ConfigError: on ``training.bucket_cap_mb`` if a limit is not positive or no limit is given.
    """
    if not limits_bytes or any(limit <= 0 for limit in limits_bytes):
        raise ConfigError("training.bucket_cap_mb", f"bucket limits must be positive bytes (got {list(limits_bytes)})")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes_bytes):
        current.append(index)
        filled += size
        if filled >= limits_bytes[min(len(buckets), len(limits_bytes) - 1)]:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
