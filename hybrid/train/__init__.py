"""The training loop and what only it uses.

* :mod:`.trainer`          the training loop, composing all the others: setup, step, log,
                           evaluate, save
* :mod:`.setup`            building what the loop trains: the model on meta, recompute, ZeRO,
                           compile
* :mod:`.step`             GPT's stages on :mod:`hybrid.pipeline.step`: one optimizer step and
                           one evaluation at any PP size
* :mod:`.batches`          global batch ramp-up and run length, as functions of samples
* :mod:`.early_exit`       --exit-interval, --exit-duration-in-mins, --exit-signal-handler
* :mod:`.orphans`          a worker ends with its launcher (Linux's parent-death signal)
* :mod:`.error_report`     a failed worker's error line, said once by the launcher
* :mod:`.monitor`          console line, --log-json, TensorBoard
* :mod:`.metrics`          the measured half of a log line, accumulated since the last one
* :mod:`.step_stats`       iteration timing and skip flags read once per log line
* :mod:`.skips`            skipped steps: counted, explained and bounded, without a host wait
                           per iteration
* :mod:`.phase_clock`      --timing-breakdown: forward, backward, pipeline-message and optimizer
                           seconds per step
* :mod:`.activation_meter` bytes saved for backward by one micro-batch
* :mod:`.compile`          --compile: torch.compile of each block's forward
* :mod:`.host_memory`      returning freed host memory on CPU runs
* :mod:`.replicas`         --check-replicas-interval: replicated parameters bit-identical
* :mod:`.nonfinite`        which micro-batch and parameters made a step non-finite
* :mod:`.stragglers`       the slowest and fastest rank of a log interval
* :mod:`.moe_stats`        the MoE layers' routing each step: the expert bias, the log line

``hybrid.initialize``'s engine, which reuses :mod:`.orphans` (and the schedule,
:mod:`hybrid.config.lr_schedule`),
is its own package one floor up: :mod:`hybrid.engine`.
"""
