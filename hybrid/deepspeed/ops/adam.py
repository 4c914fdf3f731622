"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch's Adam(W).

    opt = FusedAdam(net.parameters(), lr=1e-3, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=ds)

DeepSpeed's two Adam kernels compute one update, Adam's with bias correction: with
``adam_w_mode=True`` (``adamw_mode`` for the CPU one; the default) the weight decay is
decoupled (AdamW), else it is added to the gradient (Adam with L2). Here each is a
:class:`torch.optim.Adam` of the same settings (``decoupled_weight_decay`` the mode;
DeepSpeed's defaults, ``weight_decay=0`` among them), so it is a client optimizer like
any torch one: ``initialize`` steps each rank's shard with it (on the device, or on the
host under ``offload_optimizer``: where DeepSpeed runs its CPU kernel), its state kept
for that rank's elements, its groups driven by a client scheduler. The update is torch's
AdamW (or Adam) bit for bit. What torch's Adam cannot compute is refused by name:
``bias_correction=False`` and ``amsgrad=True`` (DeepSpeed refuses AMSGrad itself), and
``fp32_optimizer_states=False`` (hybrid keeps the states in fp32).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import torch

from hybrid.deepspeed.missing import refuse
from hybrid.errors import ConfigError

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _refused(cls: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise ConfigError(f"{cls}(bias_correction=False): hybrid's Adam always corrects the "
                          f"moments' bias (torch's Adam); drop it")
    if amsgrad:
        raise ConfigError(f"{cls}(amsgrad=True): DeepSpeed's Adam kernels have no AMSGrad; "
                          f"pass torch.optim.AdamW(..., amsgrad=True) as the optimizer")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam`` (module doc): ``adam_w_mode`` decoupled weight decay
    (AdamW, the default) or L2 (Adam); ``set_grad_none``: accepted (the engine clears the
    gradients it reduces)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        _refused(type(self).__name__, bias_correction, amsgrad)
        self.adam_w_mode = int(bool(adam_w_mode))
        self.set_grad_none = set_grad_none
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adam_w_mode))


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` (module doc): ``adamw_mode`` decoupled weight decay
    (AdamW, the default) or L2 (Adam). Under ``offload_optimizer`` the engine steps it on
    the host, as DeepSpeed runs it; without, on the device the shards are on."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        _refused(type(self).__name__, bias_correction, amsgrad)
        if not fp32_optimizer_states:
            raise ConfigError("DeepSpeedCPUAdam(fp32_optimizer_states=False): hybrid keeps "
                              "the optimizer states in fp32; drop it")
        self.adam_w_mode = int(bool(adamw_mode))
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adamw_mode))


_NOT_HERE = {
    "FusedAdamBuilder": "hybrid builds its own kernels (python -m hybrid.kernels)",
    "CPUAdamBuilder": "hybrid builds its own kernels (python -m hybrid.kernels)",
    "ZenFlowCPUAdam": "use DeepSpeedCPUAdam or FusedAdam",
    "ZenFlowSelectiveAdamW": "use DeepSpeedCPUAdam or FusedAdam",
}


def __getattr__(name: str) -> NoReturn:
    refuse("ops.adam", name, _NOT_HERE.get(name, "it holds FusedAdam and DeepSpeedCPUAdam"))
