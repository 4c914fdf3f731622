"""hybrid beside megatron-core (TP 2) and nanoGPT: the pieces of ``benchmarks/bench_peers.py``.

Bottom up (a module imports only the ones above it in this list, and
``benchmarks.timing``, every bench's medians, ratios, ABBA order, a pair of sides'
record and stopwatch):

- ``common``: paths, the TP shape and optimizer settings, the progress line
- ``launch``: running a command with its lines time-stamped as they arrive
- ``blocked``: time blocked in torch.distributed collectives, per step and phase
- ``megatron_side``, ``hybrid_side``: the two TP models, built and stepped
- ``worker``: what one torchrun rank of a TP section does (``--worker``)
- ``console``: the measures of a run, from its time-stamped console lines
- ``megatron_sections``: the ``megatron_separate`` and ``megatron_inprocess`` sections
- ``nanogpt``: the ``nanogpt`` section (nanoGPT's train.py and hybrid's pretrain_gpt.py)

docs/peers.md says what each section measures.
"""
