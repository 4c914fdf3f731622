"""megatron-core 0.16.1's optimizer wrappers on the CPU and gloo, for the Megatron
recorder (record_megatron_checkpoint.py): the patches its DistributedOptimizer (and the
non-distributed wrapper) need there, each as a context manager that restores what it
replaced. None changes a number; record_megatron_checkpoint.py's docstring says where
each is needed and what was measured without it."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def cuda_as_cpu():
    """``device='cuda'`` -> the CPU in torch's factories, while megatron-core's optimizer
    wrapper is built (it allocates its loss scale there)."""
    import torch
    saved = {n: getattr(torch, n) for n in ("tensor", "zeros", "ones", "empty")}

    def wrap(f):
        def g(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return f(*a, **k)
        return g
    for n, f in saved.items():
        setattr(torch, n, wrap(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch, n, f)


@contextlib.contextmanager
def cpu_tensors_as_cuda():
    """The distributed optimizer's CPU patches, on top of :func:`cuda_as_cpu`: a CPU
    tensor's ``type()`` (no argument) names its CUDA type (its constructor accepts
    ``torch.cuda.FloatTensor`` parameters only, and its step checks the grads' type), and
    ``Tensor.cuda()`` is the tensor itself (its fully_reshardable save moves each DP rank's
    flat shard there to all-gather it). No number changes."""
    import torch
    saved_type, saved_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, *a, **k):
        out = saved_type(self, *a, **k)
        if not a and not k and out.startswith("torch.") and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out
    torch.Tensor.type = type_  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        with cuda_as_cpu():
            yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = saved_type, saved_cuda  # type: ignore[method-assign]


@contextlib.contextmanager
def keep_own_step():
    """The distributed optimizer's fully_reshardable load, with torch's AdamW: it copies
    every entry of a parameter's optimizer state from the checkpoint's, ``step`` included,
    which the checkpoint's does not hold (KeyError 'step', distrib_optimizer.py:940); the
    state's own ``step`` is handed back to it instead (the recorder's ``Run._restore_steps`` sets it
    right after). dp_reshardable's source holds one: nothing changes there."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    saved = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        own = self.optimizer.state[main]
        if "step" in own and "step" not in tensors:
            tensors = {**tensors, "step": own["step"]}
        return saved(self, model_param, tensors)
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = saved


