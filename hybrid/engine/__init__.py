"""``hybrid.initialize``'s engine: DeepSpeed's verbs on any ``nn.Module``, and what only it uses.

The engine is the DeepSpeed surface's one home: :mod:`hybrid.deepspeed` (DeepSpeed's module
layout, its pipeline engine, Hugging Face's Trainer) sits on it, and the training loop
(:mod:`hybrid.train`) sits below it, sharing only the LR schedule and the orphan guard.

* :mod:`.api`           ``Engine``: ZeRO for any ``nn.Module``, with DeepSpeed's verbs
                        (``backward``, ``step``, ``save_checkpoint``, ...)
* :mod:`.build`         ``hybrid.initialize``: the ds_config checked, the optimizer and the
                        schedule resolved, the engine built over the model
* :mod:`.optimizer`     what steps the shard (DeepSpeed's ``optimizer=``, ``model_parameters=``),
                        and what sets its rates (``lr_scheduler=``, the ``scheduler`` block)
* :mod:`.surface`       what DeepSpeed's scripts read from the engine beside its verbs
                        (``engine.optimizer``, the training loader)
* :mod:`.ds_schedulers` DeepSpeed's OneCycle and LRRangeTest schedulers
* :mod:`.zero_context`  DeepSpeed's two ZeRO-3 context managers for a user's own model
* :mod:`.zero_build`    building a model under :func:`hybrid.zero_init`: real parameters while
                        a constructor runs, only this rank's part once it has returned
* :mod:`.progress`      the lines DeepSpeed's engines print every ``steps_per_print`` steps,
                        and ``deepspeed.utils.logger``
* :mod:`.full_values`   a parameter's full fp32 master, optimizer state or gradient, gathered
                        from the shards (``deepspeed.utils.safe_get_full_*``)
"""
