"""The training loop and what only it uses.

* :mod:`.loop`             pretrain: setup, step, log, evaluate, save
* :mod:`.batches`          global batch ramp-up and run length, as functions of samples
* :mod:`.lr_schedule`      the learning rate at an iteration or sample count
* :mod:`.early_exit`       --exit-interval, --exit-duration-in-mins, --exit-signal-handler
* :mod:`.orphans`          a worker ends with its launcher (Linux's parent-death signal)
* :mod:`.error_report`     a failed worker's error line, said once by the launcher
* :mod:`.monitor`          console line, --log-json, TensorBoard
* :mod:`.step_stats`       iteration timing and skip flags read once per log line
* :mod:`.activation_meter` bytes saved for backward by one micro-batch
* :mod:`.compile`          --compile: torch.compile of each block's forward
* :mod:`.host_memory`      returning freed host memory on CPU runs
* :mod:`.replicas`         --check-replicas-interval: replicated parameters bit-identical
* :mod:`.nonfinite`        which micro-batch and parameters made a step non-finite
* :mod:`.stragglers`       the slowest and fastest rank of a log interval
"""
