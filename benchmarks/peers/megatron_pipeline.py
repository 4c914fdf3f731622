"""The Megatron recorder's pipeline (record_megatron_checkpoint.py ``--pp N``, with
``--dist-opt``): one forward and backward of a DP rank's micro-batch through megatron-core
0.16.1's own pipeline schedule on the CPU and gloo.

Megatron-LM's ``--pipeline-model-parallel-size N``: the layers split evenly (or with the
first and last stages' counts of :class:`Split`, the rest evenly), each stage's
GPTModel built with its ``pre_process`` / ``post_process``, a step run by
``forward_backward_pipelining_without_interleaving`` (one micro-batch per DP rank), its
activations and gradients sent between the stages by megatron-core's p2p code. On gloo
and the CPU it needs, beyond the recorder's other patches: the schedule under
:func:`~.megatron_cpu_optim.cuda_as_cpu` (it counts tokens in a ``device='cuda'``
tensor), its p2p's ``torch.cuda.synchronize`` the recorder worker's no-op, and -- with tied
embeddings only (``--model gpt2``) -- the GPTModel built under
:func:`~.megatron_cpu_optim.cpu_tensors_as_cuda` (the last stage's copy of the word
embeddings is all-reduced with the first's as ``weight.data.cuda()``). No number changes:
megatron-core's own reload of the save continues bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.peers.megatron_cpu_optim import cuda_as_cpu
from benchmarks.peers.megatron_recipe import SHAPE


@dataclass(frozen=True)
class Split:
    """How the recorder's run splits its layers over the PP stages: ``layers`` in all
    (``--layers``), and megatron-core's uneven first and last stages (``first`` /
    ``last``: TransformerConfig's ``num_layers_in_first_pipeline_stage`` /
    ``num_layers_in_last_pipeline_stage``, Megatron-LM's ``--decoder-first-pipeline-num-
    layers`` / ``--decoder-last-pipeline-num-layers``, stored in ``args`` as
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``); None:
    the even split of what is left."""

    layers: int = SHAPE["num_layers"]
    first: int | None = None
    last: int | None = None

    @property
    def shape(self) -> dict:
        """The recorder's SHAPE with this split's layer count."""
        return dict(SHAPE, num_layers=self.layers)

    def config(self) -> dict:
        """TransformerConfig's fields of the uneven stages (none for the even split)."""
        return {k: v for k, v in (("num_layers_in_first_pipeline_stage", self.first),
                                  ("num_layers_in_last_pipeline_stage", self.last))
                if v is not None}

    def args(self) -> dict:
        """Megatron-LM's ``args`` fields of this split."""
        return dict(num_layers=self.layers, decoder_first_pipeline_num_layers=self.first,
                    decoder_last_pipeline_num_layers=self.last)


def pipeline_loss(ddp, tokens, pos, mask, seq_length: int, micro: int, pp_group):
    """Forward and backward of ``tokens`` (this DP rank's micro-batch, inputs and labels
    one apart) through megatron-core's pipeline schedule; the loss, on every stage (the
    last stage's, summed over ``pp_group``)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(out):
        loss = out.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data, model):
        batch = next(data)
        return model(batch[:, :-1], pos, mask, labels=batch[:, 1:]), loss_func
    with cuda_as_cpu():
        got = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[ddp],
            num_microbatches=1, seq_length=seq_length, micro_batch_size=micro,
            forward_only=False)
    loss = got[0]["loss"].reshape(1) if got else torch.zeros(1)
    torch.distributed.all_reduce(loss, group=pp_group)
    return loss
