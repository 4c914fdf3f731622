"""Bytes before the cluster, torch-free: what a layout will hold per rank and move per step.

* :mod:`.workload`     the input: one rank's share of a run (TP, CP, DP, ZeRO, recompute)
* :mod:`.model_states` ZeRO's model-state and communication formulas
* :mod:`.memory`       a run's per-rank peak: model states, activations, buffers; choosing a stage
* :mod:`.context_parallel` what CP attention adds: its saved bytes, working set, K/V traffic
* :mod:`.pipeline`     what a pipeline schedule keeps in flight on each stage, the bytes the
                       stages send each other, the bubble
* :mod:`.tiers`        the offload tiers: device, host and disk bytes, PCIe and disk traffic;
                       the cheapest offload setting that fits
"""
