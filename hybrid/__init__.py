"""hybrid: Megatron-style tensor parallelism with ZeRO data parallelism for GPT training."""

__version__ = "0.1.0"
