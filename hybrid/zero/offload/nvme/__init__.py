"""The nvme tier (ZeRO-Infinity): one rank's swap space and what lives in it.

    swap.py    the rank's swap directory: locked, space-checked, preallocated
    tiles.py   the optimizer's fp32 master and moments in tiles of optimizer.swp
    adamw.py   AdamW over those tiles, bit-identical to the host tier
    grads.py   the gradient shard in grads.swp, in the same tiles
    homes.py   stage 3 parameter shards in params.swp
    gds.py     GPUDirect Storage reads of params.swp, for the disk homes
"""
