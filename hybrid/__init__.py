"""hybrid: Megatron-style tensor parallelism with ZeRO data parallelism for GPT training.

``hybrid.initialize(model=..., config=...)`` is the library door (DeepSpeed's verbs on any
``nn.Module``: :mod:`hybrid.train.api`); it is imported on first use, so ``import
hybrid.config`` (the launcher's preflight) stays free of torch.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("initialize", "Engine"):
        from hybrid.train import api
        return getattr(api, name)
    if name in ("zero_init", "GatheredParameters"):
        from hybrid.train import zero_context
        return getattr(zero_context, name)
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
