"""DeepSpeedExamples' own training scripts, run with no line changed under DeepSpeed and
under ``hybrid-deepspeed``, their losses compared (:mod:`.runs` says how each is run).

``upstream/`` holds the scripts as DeepSpeedExamples publishes them (byte for byte, the
commit and each file's sha256 in ``upstream/SOURCE.json``, its Apache-2.0 LICENSE
beside them); ``cpu_env/`` what any CPU-only run of them needs, under DeepSpeed too
(stand-ins for torchvision, with synthetic CIFAR-10, for ``datasets``, with synthetic
wikitext and Alpaca, and for ``wandb``; a no-op ``torch.cuda.set_device``) and the loss recorder;
``recorded/`` DeepSpeed 0.19.8's numbers, written by
``python -m tests.hybrid_deepspeed.examples.record_examples``.
"""
