"""The op vocabulary: one enumeration of operation kinds used everywhere.

The plan, the simulator's trace, the runtime's timers and the calibration profile all name
operations with these values; a string spelled in three places is a bug waiting.
"""

from enum import StrEnum


class OpKind(StrEnum):
    """Kinds of operation in a rank's program.

    Compute kinds are priced by a compute model, communication kinds by a network model,
    ``weight_load`` by the loader's link.
    """

    EMBEDDING = "embedding"
    LAYERNORM = "layernorm"  # LayerNorm or RMSNorm, with the residual add that precedes it
    QKV_PROJ = "qkv_proj"
    ATTENTION = "attention"
    OUT_PROJ = "out_proj"
    MLP_UP = "mlp_up"  # up (and gate) projection with the activation
    MLP_DOWN = "mlp_down"
    LM_HEAD = "lm_head"
    ALLREDUCE = "allreduce"
    REDUCE = "reduce"
    BROADCAST = "broadcast"
    SEND = "send"  # point to point between pipeline stages: the residual stream on, sampled tokens back
    WEIGHT_LOAD = "weight_load"
    # Training, as the runtime times it: a micro-batch's whole forward or backward pass, the
    # optimizer step over the rank's parameters.
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer_step"
    GRADIENT_CAST = "gradient_cast"  # training: a gradient bucket cast for a compressed allreduce
    COMM_THREAD = "comm_thread"  # training: a bucket's messages on a comm thread sharing the cores (sim.training.comm_thread)
    STEP_LAG = "step_lag"  # training: a rank asleep until the previous step's last ring releases it (sim.training.lag)

    @property
    def is_communication(self) -> bool:
        """True for collective operations (priced by the network model)."""
        return self in _COMMUNICATION


_COMMUNICATION = frozenset({OpKind.ALLREDUCE, OpKind.REDUCE, OpKind.BROADCAST, OpKind.SEND})
