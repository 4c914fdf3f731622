"""A ds_config ``scheduler`` block as hybrid's learning-rate flags.

hybrid's schedule is Megatron's: warmup over ``--lr-warmup-iters`` from
``--lr-warmup-init`` to ``--lr`` (linear, or DeepSpeed's log shape with
``--lr-warmup-style log``), then ``--lr-decay-style`` to ``--min-lr`` at
``--lr-decay-iters``. DeepSpeed's three warmup schedulers are points of it::

    WarmupLR        warmup_min_lr -> warmup_max_lr over warmup_num_steps, then constant
    WarmupDecayLR   the same, then linear down to warmup_min_lr at total_num_steps
    WarmupCosineLR  warmup_min_ratio x lr -> lr (the optimizer's), then cosine down
                    to cos_min_ratio x lr at total_num_steps

Steps count as hybrid's iterations do (1-based: a linear warmup's first step
runs at 1 / warmup_num_steps of the way; a log warmup's at its start value).
"""

from __future__ import annotations

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


def schedule_flags(block: dict, lr: float, where: str) -> list[tuple[str, str, object]]:
    """[(flag field, ds key, value)] for ``block``; ``lr``: the run's peak learning rate
    (WarmupCosineLR's ratios are of it). ``where`` names the block in errors."""
    kind = str(block.get("type", "")).lower()
    if kind not in _DEFAULTS:
        raise ConfigError(f"{where}.type is {block.get('type')!r}: hybrid runs WarmupLR, "
                          f"WarmupDecayLR or WarmupCosineLR (or the --lr* flags)")
    for name in block:
        if name not in ("type", "params"):
            raise ConfigError(f"{where}.{name} is not a scheduler key hybrid knows")
    given = dict(block.get("params", {}))
    for name in given:
        if name not in _DEFAULTS[kind] and name != "last_batch_iteration":
            raise ConfigError(f"{where}.params.{name} is not a parameter of "
                              f"{_NAMES[kind]}")
    if given.pop("last_batch_iteration", -1) != -1:
        raise ConfigError(f"{where}.params.last_batch_iteration: resume from a checkpoint "
                          f"instead (hybrid's schedule is a function of the iteration)")
    p = {**_DEFAULTS[kind], **{k: v for k, v in given.items() if v != "auto"}}
    if p["warmup_type"] not in ("log", "linear"):
        raise ConfigError(f"{where}.params.warmup_type must be log or linear, "
                          f"got {p['warmup_type']!r}")
    key = f"scheduler.params ({_NAMES[kind]})"
    out = [("lr_warmup_iters", key, int(p["warmup_num_steps"])),
           ("lr_warmup_style", key, p["warmup_type"])]
    if kind == "warmupcosinelr":
        out += [("lr_warmup_init", key, float(p["warmup_min_ratio"]) * lr),
                ("min_lr", key, float(p["cos_min_ratio"]) * lr),
                ("lr_decay_style", key, "cosine")]
    else:
        if "warmup_max_lr" in given:
            out.append(("lr", key, float(p["warmup_max_lr"])))
        out += [("lr_warmup_init", key, float(p["warmup_min_lr"])),
                ("lr_decay_style", key, "constant" if kind == "warmuplr" else "linear")]
        if kind == "warmupdecaylr":
            out.append(("min_lr", key, float(p["warmup_min_lr"])))
    if kind != "warmuplr":
        if p["total_num_steps"] is None:
            raise ConfigError(f"{where}.params.total_num_steps is required by {_NAMES[kind]}")
        out.append(("lr_decay_iters", key, int(p["total_num_steps"])))
    return out
