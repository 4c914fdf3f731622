"""Loss scaling for fp16: static, or dynamic with a growth window and hysteresis.

Dynamic scaling multiplies the loss by ``scale`` so small fp16 gradients do
not flush to zero. An inf/nan in any gradient on any rank means the scale was
too high: the step is skipped on every rank (the caller all-reduces the
overflow flag) and, once ``hysteresis`` overflows have accumulated, the scale
halves -- and halves again on every further overflow, as in Megatron and
DeepSpeed. After ``window`` clean steps in a row it doubles and the hysteresis
is restored.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from hybrid.config.sections import PrecisionConfig


@dataclass
class LossScaler:
    scale: float = 1.0
    _: KW_ONLY
    dynamic: bool = False
    window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    _clean_steps: int = 0
    _hysteresis_left: int = 2

    def __post_init__(self) -> None:
        self._hysteresis_left = self.hysteresis

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> LossScaler:
        """fp16 is dynamic unless ``cfg.loss_scale`` is given; bf16/fp32 are not scaled."""
        if cfg.params_dtype != "fp16":
            return cls(1.0, dynamic=False)
        if cfg.loss_scale is not None:
            return cls(cfg.loss_scale, dynamic=False)
        return cls(cfg.initial_loss_scale, dynamic=True, window=cfg.loss_scale_window,
                   min_scale=cfg.min_loss_scale, hysteresis=cfg.hysteresis)

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step (skipped when ``overflow``)."""
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:  # used up: halve on every overflow from now on,
                # until a clean window grows the scale again and restores the hysteresis
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps > 0 and self._clean_steps % self.window == 0:  # (an imported
            # count of -1 starts one step later: DeepSpeed's first step after an overflow)
            self.scale *= 2.0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        """A saved dynamic scale and its counters; a static or unscaled run (another
        dtype, ``--loss-scale``) keeps the scale its config gives."""
        if not self.dynamic:
            return
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._hysteresis_left = state["hysteresis_left"]


def scaled_loss(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``loss`` times the fp16 loss ``scale``, multiplied in fp32: a half-precision loss
    (a model whose head computes in fp16) times 2**16 would overflow in its own dtype
    whenever it exceeds 1 -- a skipped step for no gradient's sake -- while its gradient
    goes back through the cast in the model's dtype, where a real overflow still shows.
    ``loss`` itself when ``scale`` is 1; an fp32 loss is scaled as before, bit for bit."""
    return loss.float() * scale if scale != 1.0 else loss
