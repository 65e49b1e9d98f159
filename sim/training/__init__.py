"""Data-parallel training in the simulator: DDP's buckets (:mod:`.buckets`), a training step
lowered into per-rank ops on a compute and a communication stream (:mod:`.lower`), and its
simulation on the shared engine and network (:mod:`.simulate`)."""
