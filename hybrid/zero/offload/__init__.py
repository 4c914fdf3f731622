"""Where ZeRO's model states live off the device: the memory tiers, by room.

This package holds what every tier shares; ``nvme/`` holds what only the disk
tier has (ZeRO-Infinity).

    tiers.py      the tiers built once from the offload config (swap space, I/O, homes)
    host_step.py  ZeRO-Offload: the optimizer step on a host worker, overlapped
    landing.py    an offloaded optimizer's gradients on their way down
    writer.py     the host step's new parameter shards straight to their homes
    nvme/         the swap space, tiles, the swapped optimizer, gradients and
                  parameter homes on disk, and GPUDirect Storage reads

The core of :mod:`hybrid.zero` never imports this package; only the engine
composes it.
"""
