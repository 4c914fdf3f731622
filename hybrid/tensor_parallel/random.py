"""RNG for dropout under tensor parallelism.

Inside a TP region each rank holds a different slice of the activations (its
heads, its MLP columns), so dropout there must draw *different* masks per TP
rank. Outside (the residual stream, replicated on every TP rank) the masks must
be *identical* across TP ranks, or the replicas would drift apart.

So there are two streams:

* the default generator of the device, seeded identically on every TP rank of a
  DP replica: used for replicated regions;
* a tracked "model-parallel" state, seeded per TP rank: swapped into the default
  generator only inside ``tracker.fork()`` for dropout in split regions.

The tracker's states are plain tensors, so activation recompute and checkpoints
can save and replay them (:meth:`TPRNGTracker.get_states`/``set_states``).
"""

from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # keeps the TP stream apart from the default stream's seed


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TPRNGTracker:
    """Named RNG states that ``fork`` swaps into the default generator of ``device``."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = get_device_rng_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name] = get_device_rng_state(self.device)
        set_device_rng_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the body with the tracked state ``name``; advance it, restore the default."""
        saved = get_device_rng_state(self.device)
        set_device_rng_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = get_device_rng_state(self.device)
            set_device_rng_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}


def seed_all(seed: int, tp_rank: int, dp_rank: int, device: torch.device,
             cp_rank: int = 0, tp_size: int = 1) -> TPRNGTracker:
    """Seed the default generators and return a tracker for split-region dropout.

    Default stream: ``seed + dp_rank`` -- equal on the TP and CP ranks of one
    replica, different across replicas (they see different data anyway).
    Model-parallel stream: ``seed + 2718 + cp_rank * tp_size + tp_rank`` -- different
    per TP and per CP rank (each CP rank holds other tokens: its sequence-split
    dropout draws other masks).
    """
    torch.manual_seed(seed + dp_rank)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed + dp_rank)
    tracker = TPRNGTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + cp_rank * tp_size + tp_rank)
    return tracker
