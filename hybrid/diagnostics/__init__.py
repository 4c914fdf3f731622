"""When something goes wrong on many ranks, say where (docs/diagnostics.md).

* :mod:`.recorder`    the collective flight recorder, heartbeat and failure protocol
* :mod:`.watch`       on NCCL, the heartbeat's watch for collectives queued past the timeout
* :mod:`.entry`       one recorded collective and its caller
* :mod:`.report`      the words of a failure report, from the ranks' records
* :mod:`.fingerprint` ``--check-collectives``: a group agrees on each collective first

The checks the training loop runs (replicas, non-finite steps, stragglers) live in
:mod:`hybrid.train`; this package sits below the comm door, which records into it.
"""
