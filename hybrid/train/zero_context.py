"""DeepSpeed's two ZeRO-3 context managers for a user's own model.

    with hybrid.zero_init():                       # deepspeed.zero.Init
        model = AutoModelForCausalLM.from_config(cfg)   # nothing allocated: meta tensors
    engine, *_ = hybrid.initialize(model=model, config=ds)  # each rank draws its shard only

    with hybrid.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        model.lm_head.weight.zero_()               # full values inside; rank 0's kept

[Note: drawing a shard of a model built on meta]
:class:`ModuleInitValues` gives the engine the values of any element range of
any parameter: it materializes the *module that owns the parameter* (its own
parameters only, on the CPU), runs that module's initializer -- the model's
``_init_weights`` (``transformers``) or the module's ``reset_parameters`` --
under a generator seeded from the run seed and the parameter's name, and
hands out slices. So every rank draws the same values without communicating,
and a rank holds at most its shard plus one module's parameters at a time
(a leaf: one Linear's weight and bias). What a parent module's initializer
would add (GPT-2 rescales its residual projections from the attention
module) is not applied: each parameter gets its own module's initializer.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib

import torch
from torch import nn


@contextlib.contextmanager
def zero_init():
    """Modules built inside get their parameters on the meta device: no parameter
    memory until :func:`hybrid.initialize` draws this rank's shard (DeepSpeed's
    ``zero.Init``). Buffers stay real (small, and often computed in ``__init__``,
    like rotary frequencies, which a meta buffer would lose)."""
    original = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    # torch's own method, replaced for the context (as DeepSpeed's zero.Init does): what
    # mypy refuses for a declared method
    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


class ModuleInitValues:
    """``values(name, param, lo, hi)`` for the engine (see the module note)."""

    def __init__(self, model: nn.Module, seed: int):
        self.model, self.seed = model, seed
        self.owner: dict[int, tuple[nn.Module, str]] = {}  # id(param) -> (module, name)
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                self.owner.setdefault(id(p), (module, pname))
        self._cached: tuple[str, torch.Tensor] | None = None
        self.largest = 0  # elements of the largest module materialized (for tests)

    def __call__(self, name: str, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != name:
            self._cached = (name, self._draw(name, param))
        return self._cached[1].reshape(-1)[lo:hi]

    @torch.no_grad()
    def _draw(self, name: str, param: torch.Tensor) -> torch.Tensor:
        module, pname = self.owner[id(param)]
        local = copy.deepcopy(module)  # (meta: no memory) its own parameters only
        for child in list(local._modules):
            local._modules[child] = None
        local = local.to_empty(device="cpu")
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(digest[:8], "little") % (2 ** 63))
            init = getattr(self.model, "_init_weights", None)
            reset = getattr(local, "reset_parameters", None)
            if init is not None:
                init(local)
            elif reset is not None:
                reset()
            else:
                raise ValueError(f"hybrid.initialize: cannot draw {name} of a model built "
                                 f"under zero_init(): {type(module).__name__} has no "
                                 f"reset_parameters() and the model no _init_weights()")
        self.largest = max(self.largest, sum(p.numel() for p in local.parameters()))
        return getattr(local, pname).detach().float()


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, enabled: bool = True):
    """Full parameter values inside the block (stage 3 gathers them; other stages hold
    them anyway). With ``modifier_rank``, that DP rank's values of ``params`` afterwards
    become every rank's, and the fp32 master (so training goes on from them)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    engine = getattr(params[0], "hybrid_engine", None) if params else None
    if not enabled or engine is None:  # not under a hybrid engine: nothing is sharded
        yield
        return
    from hybrid.zero.state import write_master_from_params
    with engine.zero.gathered():
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for p in params:
                    engine.ps.dp_group.broadcast(p.data, src=modifier_rank)
            write_master_from_params(engine.zero, params)
