"""The nvme tier (ZeRO-Infinity): one rank's swap space and what lives in it.

* :mod:`.swap`        the rank's swap directory: locked, space-checked, preallocated
* :mod:`.tiles`       the optimizer's fp32 master and moments in tiles of optimizer.swp
* :mod:`.adamw`       AdamW over those tiles, bit-identical to the host tier
* :mod:`.speculative` the host step's speculative update of the read-ahead tiles, kept only
                      if the step's clip and skip turn out as assumed
* :mod:`.grads`       the gradient shard in grads.swp, in the same tiles
* :mod:`.homes`       stage 3 parameter shards in params.swp
* :mod:`.gds`         GPUDirect Storage reads of params.swp, for the disk homes
"""
