"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch's Adam(W).

    opt = FusedAdam(net.parameters(), lr=1e-3, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=ds)

DeepSpeed's two Adam kernels compute one update, Adam's with bias correction: with
``adam_w_mode=True`` (``adamw_mode`` for the CPU one; the default) the weight decay is
decoupled (AdamW), else it is added to the gradient (Adam with L2). Each is a
:class:`torch.optim.Adam` of the same settings (``decoupled_weight_decay`` the mode;
DeepSpeed's defaults, ``weight_decay=0`` among them), and ``initialize`` runs it one of
two ways:

* hybrid's own fused AdamW on the flat shard (on the device, or on the host under
  ``offload_optimizer``, where DeepSpeed runs its CPU kernel) when that computes it: the
  AdamW mode, one group of the parameters, no ``lr_scheduler`` given and no
  ``"optimizer"`` block in the ds_config (:func:`as_config_block` makes the block of its
  settings). The run is then bit for bit the one the block would give. The
  optimizer's ``param_groups`` become the engine's, so a rate written there applies,
  and its own ``step()`` is refused: the engine steps.
* otherwise (L2 mode, several groups, a scheduler over it) torch's Adam as a client
  optimizer of each rank's shard, like any torch optimizer: bit for bit torch's AdamW
  (or Adam) there.

What neither computes is refused by name: ``bias_correction=False`` and
``amsgrad=True`` (DeepSpeed refuses AMSGrad itself), and ``fp32_optimizer_states=False``
(hybrid keeps the states in fp32).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import torch

from hybrid.deepspeed.missing import refuse
from hybrid.errors import ConfigError

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "as_config_block"]


def _refused(cls: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise ConfigError(f"{cls}(bias_correction=False): hybrid's Adam always corrects the "
                          f"moments' bias (torch's Adam); drop it")
    if amsgrad:
        raise ConfigError(f"{cls}(amsgrad=True): DeepSpeed's Adam kernels have no AMSGrad; "
                          f"pass torch.optim.AdamW(..., amsgrad=True) as the optimizer")


class _Adam(torch.optim.Adam):
    """What the two share: the mode, and the engine that steps it once ``initialize``
    ran it as hybrid's own AdamW (None until then)."""

    adam_w_mode: int
    stepped_by: object = None

    def step(self, closure: Any = None) -> Any:
        if self.stepped_by is not None:
            raise ConfigError(f"{type(self).__name__}.step(): initialize runs it as hybrid's "
                              f"own AdamW on the engine's shards; call engine.step()")
        return super().step(closure)


def as_config_block(optimizer: object, lr_scheduler: object, ds: dict) -> dict | None:
    """The ds_config ``"optimizer"`` block whose AdamW is ``optimizer`` (a FusedAdam or
    DeepSpeedCPUAdam in AdamW mode, one group, no scheduler over it, no block in ``ds``),
    or None: it stays a client optimizer."""
    if (not isinstance(optimizer, _Adam) or not optimizer.adam_w_mode
            or lr_scheduler is not None or "optimizer" in ds
            or len(optimizer.param_groups) != 1):
        return None
    g = optimizer.param_groups[0]
    # (the betas as held: DeepSpeed's progress line shows a list as one, a tuple as one)
    return {"type": "AdamW", "params": {"lr": float(g["lr"]), "betas": g["betas"],
                                        "eps": float(g["eps"]),
                                        "weight_decay": float(g["weight_decay"])}}


class FusedAdam(_Adam):
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


class DeepSpeedCPUAdam(_Adam):
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
