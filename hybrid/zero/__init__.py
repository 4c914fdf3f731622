"""ZeRO-DP over the data-parallel group: stages 0-3, applied to a model from outside.

* :mod:`.apply`            :func:`apply_zero`: ZeRO-DP applied to a model from outside
* :mod:`.engine`           :class:`ZeroEngine`: a model's ZeRO state and its step verbs
* :mod:`.plan`             the ZeRO stage, decided once as a plan of what is sharded over DP
* :mod:`.units`            how ZeRO lays a model out: which parameters form each unit, and
                           making them real
* :mod:`.flat_unit`        :class:`FlatUnit`: a group of parameters as views of one flat buffer,
                           sharded over DP
* :mod:`.buffers`          the flat buffers of fp32 master weights and of gradients, one rank's
* :mod:`.grad_sync`        gradient reduction over DP, launched from autograd hooks as units fill
* :mod:`.param_sync`       stage 3: gather a module's parameters just before it runs, free them
                           right after
* :mod:`.gather_pipeline`  parameter all-gathers over DP, asynchronous, in bounded memory
* :mod:`.optimizer`        AdamW over this rank's flat shard, with fp32 master weights
* :mod:`.client_optimizer` a user's ``torch.optim`` optimizer stepping this rank's shard
* :mod:`.loss_scaler`      loss scaling for fp16: static, or dynamic with a growth window and
                           hysteresis
* :mod:`.parts`            parts of a model that separate backwards reach: an interleaved
                           pipeline rank's chunks
* :mod:`.state`            what a ZeRO engine has to save, and how it takes it back, layout-free
* :mod:`.offload`          where model states live off the device: the host and disk tiers
"""

from hybrid.zero.apply import apply_zero
from hybrid.zero.engine import StepResult, ZeroEngine
from hybrid.zero.plan import ShardingPlan

__all__ = ["apply_zero", "ZeroEngine", "StepResult", "ShardingPlan"]
