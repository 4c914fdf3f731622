"""Pipeline parallelism: the model cut into stages over the PP group.

* :mod:`.actions` the vocabulary of schedules: per rank, an ordered list of forward,
  backward (or its input and weight halves), send, receive and END actions; the
  contract the executor honours; torch-free
* :mod:`.schedules` the generators (gpipe, 1f1b, interleaved_1f1b, zb_h1) and the registry
  ``--pipeline-schedule`` picks from; torch-free
* :mod:`.simulator` plays the lists: refuses what cannot run (deadlocks included), times
  the rest, counts the activations each stage holds; torch-free
* :mod:`.report` the simulation's step x rank grid, summary and JSON; torch-free
* :mod:`.executor` one rank's action list of a schedule, run action by action
* :mod:`.wire` what crosses between stages when the model does not say: shapes learnt at run time
* :mod:`.step` one training step, written once: a schedule's forwards and backwards over a
  rank's micro-batches, the loss path, the optimizer step (every door runs it)

Which layers each (virtual) stage holds is configuration arithmetic, checked before any
worker starts: :mod:`hybrid.config.stage_split`. Import from the modules: this package's
``__init__`` stays empty so that the torch-free estimator can play :mod:`.schedules` without
importing torch.
"""
