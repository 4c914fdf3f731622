"""Where ZeRO's model states live off the device: the memory tiers, by room.

This package holds what every tier shares; :mod:`.nvme` holds what only the disk
tier has (ZeRO-Infinity).

* :mod:`.contracts` the Protocols the tier families share (optimizer, store, home, publisher)
* :mod:`.tiers`     the tiers built once from the offload config (swap space, I/O, homes)
* :mod:`.host_step` ZeRO-Offload: the optimizer step on a host worker, overlapped
* :mod:`.landing`   an offloaded optimizer's gradient sinks: each shard on its way down
* :mod:`.grads`     the host gradient store the host step reads
* :mod:`.homes`     stage 3 parameter offload: a shard's home in host memory
* :mod:`.writer`    the host step's new parameter shards straight to their homes
* :mod:`.nvme`      the swap space, tiles, the swapped optimizer, gradients and
                    parameter homes on disk, and GPUDirect Storage reads

The core of :mod:`hybrid.zero` never imports this package; only the engine
composes it (tests/zero/test_contracts.py holds both).
"""
