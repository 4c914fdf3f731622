"""A ds_config ``scheduler`` block as hybrid's learning-rate flags.

hybrid's schedule is Megatron's: warmup over ``--lr-warmup-iters`` from
``--lr-warmup-init`` to ``--lr`` (linear, or DeepSpeed's log shape with
``--lr-warmup-style log``), then ``--lr-decay-style`` to ``--min-lr`` at
``--lr-decay-iters``. DeepSpeed's three warmup schedulers are points of it::

    WarmupLR        warmup_min_lr -> warmup_max_lr over warmup_num_steps, then constant
    WarmupDecayLR   the same, then linear down to warmup_min_lr at total_num_steps
    WarmupCosineLR  warmup_min_ratio x lr -> lr (the optimizer's), then cosine down
                    to cos_min_ratio x lr at total_num_steps

Steps count as DeepSpeed's schedulers count them (``--lr-schedule-steps deepspeed``,
:func:`hybrid.config.lr_schedule.deepspeed_lr`): the first two optimizer steps run at
the warmup's start (WarmupCosineLR's first at 0), so the rates equal DeepSpeed's
step for step.
Every length comes from the scheduler's own keys: WarmupLR's schedule is its
warmup (hybrid's decay length is then warmup_num_steps, with a constant
"decay"), so no ``--train-iters`` default caps it.
"""

from __future__ import annotations

from collections.abc import Callable

from hybrid.errors import ConfigError

_DEFAULTS = {
    "warmuplr": dict(warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                     warmup_type="log"),
    "warmupdecaylr": dict(warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                          warmup_type="log", total_num_steps=None),
    "warmupcosinelr": dict(warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                           warmup_type="log", total_num_steps=None),
}
_NAMES = {"warmuplr": "WarmupLR", "warmupdecaylr": "WarmupDecayLR",
          "warmupcosinelr": "WarmupCosineLR"}


def schedule_flags(block: dict, lr: float,
                   where: Callable[[str], str]) -> list[tuple[str, str, object]]:
    """[(flag field, the ds key it comes from, value)] for ``block`` (its values already
    checked against their types by :mod:`hybrid.config.deepspeed`); ``lr``: the run's
    peak learning rate (WarmupCosineLR's ratios are of it). ``where(key)`` names a key
    in errors. A value the block leaves to the scheduler's default names the key with
    "(WarmupLR's default)", so a message about it says where the number came from."""
    kind = str(block.get("type", "")).lower()
    if kind not in _DEFAULTS:
        raise ConfigError(f"{where('scheduler.type')} is {block.get('type')!r}: hybrid runs "
                          f"WarmupLR, WarmupDecayLR or WarmupCosineLR (or the --lr* flags)")
    for name in block:
        if name not in ("type", "params"):
            raise ConfigError(f"{where('scheduler.' + name)} is not a scheduler key hybrid "
                              f"knows")
    given = dict(block.get("params", {}))
    for name in given:
        if name not in _DEFAULTS[kind] and name != "last_batch_iteration":
            raise ConfigError(f"{where('scheduler.params.' + name)} is not a parameter of "
                              f"{_NAMES[kind]}")
    if given.pop("last_batch_iteration", -1) != -1:
        raise ConfigError(f"{where('scheduler.params.last_batch_iteration')}: resume from a "
                          f"checkpoint instead (hybrid's schedule is a function of the "
                          f"iteration)")
    given = {k: v for k, v in given.items() if v != "auto"}
    p = {**_DEFAULTS[kind], **given}

    def key(name: str) -> str:
        return (f"scheduler.params.{name}" if name in given
                else f"scheduler.params.{name} ({_NAMES[kind]}'s default)")

    out = [("lr_schedule_steps", "scheduler.type", "deepspeed"),
           ("lr_warmup_iters", key("warmup_num_steps"), p["warmup_num_steps"]),
           ("lr_warmup_style", key("warmup_type"), p["warmup_type"])]
    if kind == "warmupcosinelr":
        out += [("lr_warmup_init", key("warmup_min_ratio"), p["warmup_min_ratio"] * lr),
                ("min_lr", key("cos_min_ratio"), p["cos_min_ratio"] * lr),
                ("lr_decay_style", "scheduler.type", "cosine")]
    else:
        if "warmup_max_lr" in given:
            out.append(("lr", key("warmup_max_lr"), p["warmup_max_lr"]))
        out += [("lr_warmup_init", key("warmup_min_lr"), float(p["warmup_min_lr"])),
                ("lr_decay_style", "scheduler.type",
                 "constant" if kind == "warmuplr" else "linear")]
        if kind == "warmupdecaylr":
            out.append(("min_lr", key("warmup_min_lr"), float(p["warmup_min_lr"])))
    if kind == "warmuplr":  # constant after the warmup: the schedule ends with it
        out.append(("lr_decay_iters", key("warmup_num_steps"), p["warmup_num_steps"]))
    else:
        if p["total_num_steps"] is None:
            raise ConfigError(f"{where('scheduler.params.total_num_steps')} is required by "
                              f"{_NAMES[kind]}")
        out.append(("lr_decay_iters", key("total_num_steps"), p["total_num_steps"]))
    return out
