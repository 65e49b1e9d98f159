"""Data-parallel training with real ``DistributedDataParallel``: the model (:mod:`.model`), the comm
hooks over hetsim schedules (:mod:`.hooks`), one rank's training loop (:mod:`.trainer`), the
measurement behind ``hetsim measure`` (:mod:`.measure`), single-process references
(:mod:`.reference`) and the calibration of backward and optimizer terms (:mod:`.calibrate`)."""
