"""What a DeepSpeedExamples script needs to run on a CPU-only machine, the same under
DeepSpeed and under hybrid (this folder is on PYTHONPATH for both runs), and the
recorder of its losses. Nothing here changes a line of the script.

* ``torch.cuda.set_device`` and ``torch.cuda.reset_peak_memory_stats`` do nothing where
  torch has no CUDA (the pipeline and bf16 examples call them unconditionally; a CPU
  build of torch has no ``_cuda_setDevice``).
* torch's generator starts from seed 0, as a fresh process's did before torch drew
  its first seed at random: a script that never seeds starts from the same weights in
  every run.
* The stand-ins a run needs are in folders beside this file, each on PYTHONPATH only for
  the runs that need it (:mod:`..runs`): ``vision/torchvision`` (a CUDA-linked
  torchvision wheel does not load on a CPU torch, and CIFAR-10 would be downloaded),
  ``text/datasets`` (wikitext and Alpaca would be downloaded), ``tracking/wandb`` (imported
  by SuperOffload's script whether or not it logs there).
* Each process writes its output a line at a time (two ranks share the launcher's
  stdout).
* The losses: when the script imports ``deepspeed`` (DeepSpeed's, or hybrid's through
  the launcher's alias), its ``initialize`` is wrapped so the engine it returns records
  each ``backward(loss)``'s loss and each ``train_batch()``'s, at full precision; at exit
  each rank writes them to ``$EXAMPLE_RECORD/rank<RANK>.json``. Without
  ``EXAMPLE_RECORD`` nothing is wrapped.
"""

import atexit
import builtins
import json
import os
import sys

_RECORD = os.environ.get("EXAMPLE_RECORD")
_seen = {"torch": False, "deepspeed": False}
_losses = {"backward": [], "train_batch": []}
_real_import = builtins.__import__


def _patch_torch(torch):
    if not torch.cuda.is_available():
        torch.cuda.set_device = lambda device: None
        torch.cuda.reset_peak_memory_stats = lambda device=None: None
    # torch draws its generator's first seed at random when a process starts: a script
    # that never seeds (the CIFAR example) would start from other weights every run
    torch.manual_seed(0)


def _wrap_engine(engine):
    backward, train_batch = engine.backward, getattr(engine, "train_batch", None)

    def recorded_backward(loss, *args, **kwargs):
        _losses["backward"].append(float(loss.detach().float().item()))
        return backward(loss, *args, **kwargs)

    engine.backward = recorded_backward
    if train_batch is not None:
        def recorded_train_batch(*args, **kwargs):
            loss = train_batch(*args, **kwargs)
            _losses["train_batch"].append(float(loss.detach().float().item()))
            return loss

        engine.train_batch = recorded_train_batch


def _patch_deepspeed(module):
    initialize = module.initialize

    def recorded_initialize(*args, **kwargs):
        out = initialize(*args, **kwargs)
        _wrap_engine(out[0])
        return out

    module.initialize = recorded_initialize


def _dump():
    with open(os.path.join(_RECORD, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(_losses, f)


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _real_import(name, globals, locals, fromlist, level)
    # (a module still being initialized lacks names: patched at a later import of it)
    if (level == 0 and name in _seen and not _seen[name]
            and not getattr(getattr(module, "__spec__", None), "_initializing", False)):
        if name == "torch":
            _seen[name] = True
            _patch_torch(module)
        elif hasattr(module, "initialize"):
            _seen[name] = True
            if _RECORD:
                _patch_deepspeed(module)
                atexit.register(_dump)
    return module


builtins.__import__ = _import
# one write per line, so two ranks' lines on one pipe never cut into each other
sys.stdout.reconfigure(line_buffering=True, write_through=False)
