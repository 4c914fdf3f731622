"""When something goes wrong on many ranks, say where (docs/diagnostics.md).

* :mod:`.recorder`    the collective flight recorder, heartbeat and failure protocol
* :mod:`.watch`       on NCCL, the heartbeat's watch for collectives queued past the timeout
* :mod:`.entry`       one recorded collective and its caller
* :mod:`.report`      the words of a failure report, from the ranks' records
* :mod:`.fingerprint` ``--check-collectives``: a group agrees on each collective first
* :mod:`.replicas`    ``--check-replicas-interval``: replicated parameters bit-identical
* :mod:`.nonfinite`   which micro-batch and parameters made a step non-finite
* :mod:`.stragglers`  the slowest and fastest rank of a log interval
"""
