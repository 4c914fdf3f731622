"""DeepSpeed's checkpoint files read where DeepSpeed is not installed, for the tests that
compare hybrid's reading (or writing) of them with what the files hold."""

from __future__ import annotations

import pickle
import types

import torch


class Anything:
    """Whatever DeepSpeed class a pickle names, kept as its saved attributes."""

    def __init__(self, *args, **kw):
        self.args = args

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("deepspeed"):
            return Anything
        return super().find_class(module, name)


# torch.load's pickle_module: DeepSpeed's classes come back as Anything
PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="p")


def load(path: str):
    """A DeepSpeed checkpoint file, its DeepSpeed objects as :class:`Anything`."""
    return torch.load(path, weights_only=False, pickle_module=PICKLE)
