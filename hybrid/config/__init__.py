"""The run's configuration, torch-free: Megatron flags -> checked, frozen sections.

* :mod:`.options`            how a field declares its flag (``opt``): name, help, checks,
                             ds_config keys, once, on the field that takes the value
* :mod:`.flag_sources`       the classes that declare flags (--help groups) and the
                             generator of :mod:`.flag_fields` (``python -m hybrid.config.generate``)
* :mod:`.flag_fields`        GENERATED: the flat :class:`Flags`, one typed field per flag
* :mod:`.generate`           ``python -m hybrid.config.generate``: rewrites flag_fields.py
* :mod:`.flags`              the command line -> Flags: the parser, grouped, and ``ROUTES``
* :mod:`.megatron_flags`     Megatron flags hybrid drops (no effect) or refuses, and what instead
* :mod:`.deepspeed`          DeepSpeed's ds_config.json -> hybrid's flags, checked against the
                             command line
* :mod:`.deepspeed_keys`     every ds_config key hybrid knows, what it does with each, and the
                             type of its value
* :mod:`.deepspeed_schedule` a ds_config ``scheduler`` block as hybrid's learning-rate flags
* :mod:`.lr_schedule`        the learning rate at an iteration or sample count, a pure function
                             of the schedule's section; DeepSpeed's schedulers' counting
* :mod:`.checks`             every check that can reject a command line, and its message
* :mod:`.kinds`              the type a ds_config value or API argument must have, and its check
* :mod:`.architecture`       the Llama-family flags (normalization, SwiGLU, RoPE, GQA, biases)
* :mod:`.moe`                the mixture-of-experts flags as ``ModelConfig.moe``, and their checks
* :mod:`.model`              the model section: the GPT's shape, padded vocabulary, parameter count
* :mod:`.kernels`            the kernel flags and their ``HYBRID_*`` defaults
* :mod:`.sections`           the frozen section each component takes, and the closed sets
                             of values options take (``CP_COMM_TYPES``, ``OFFLOAD_TIERS``)
* :mod:`.stage_split`        which layers each (virtual) pipeline stage holds, from Megatron's
                             flags (the executor and the model builder read the result)
* :mod:`.build`              :func:`build_config`: flags -> :class:`TrainConfig`, in one place;
                             sections cut by the flags' routes, derived fields by hand
"""

from hybrid.config.build import TrainConfig, build_config
from hybrid.config.flags import Flags, parse_args
from hybrid.config.kernels import kernel_config_from_env, parse_kernel_choice

__all__ = ["TrainConfig", "Flags", "build_config", "parse_args", "kernel_config_from_env",
           "parse_kernel_choice"]
