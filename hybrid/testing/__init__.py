"""What tests and benchmarks use; nothing in the library imports it.

* :mod:`.pool`       run a function on N local gloo ranks, on pooled processes
* :mod:`.worker`     a pooled rank's loop
* :mod:`.host_syncs` counting host reads and CUDA syncs
"""
