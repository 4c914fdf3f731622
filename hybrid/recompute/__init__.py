"""ZeRO-R activation checkpointing, applied to transformer blocks from outside.

* :mod:`.checkpointing` apply_activation_checkpointing: full/selective recompute, RNG replay
* :mod:`.store`         where checkpoints live: partitioned over TP, on the host, contiguous
* :mod:`.phase`         the public flag that says a recompute is running (ZeRO-3 reads it)
"""
