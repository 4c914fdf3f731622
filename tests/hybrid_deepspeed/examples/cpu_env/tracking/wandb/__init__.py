"""A stand-in for ``wandb``, which SuperOffload's fine-tuning script imports whether or not
it logs there (it calls ``wandb.init`` only under ``--use_wandb``, which the runs never
pass). Importable, nothing more: a call says so. The same under DeepSpeed and hybrid."""


def _refuse(*args, **kwargs):
    raise RuntimeError("the examples' wandb stand-in logs nothing: run without --use_wandb")


init = log = finish = _refuse
