"""megatron-core on the CPU (../shared/BENCHMARKS.md's patches): whether it is there, the
patches, its process groups, and its GPTModel at TP ``tp`` with torch AdamW and megatron's
clipping. megatron-core is imported only inside functions: the parent never needs it."""

from __future__ import annotations

import contextlib

from benchmarks.peers.common import CLIP, LR, SEED, WEIGHT_DECAY, mean_eval_loss

MEGATRON_INSTALL = "pip install --no-deps megatron-core==0.16.1 packaging"


def megatron_missing() -> str | None:
    """Why megatron-core cannot run here, or None."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            import megatron.core  # noqa: F401
            from megatron.core.models.gpt import GPTModel  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- ImportError, or a broken dependency of it
        return f"megatron-core is not importable ({type(e).__name__}: {e}); {MEGATRON_INSTALL}"
    return None


def patch_megatron_for_cpu():
    """The CPU patches, before megatron-core's models are imported."""
    import torch
    # it allocates an attention buffer there: a device name where torch declares an index
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    import warnings
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    from megatron.core.tensor_parallel import random as mrandom

    # CUDA-only RNG tracker: with dropout 0 nothing is drawn under it, so a no-op is exact
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


class _HostStream:
    """What megatron-core's alltoall dispatcher asks of a CUDA stream, on the host: it
    copies its split sizes to the host on a side stream and waits for an event there; on
    the CPU the copies are done when made, so waiting is nothing."""

    def wait_stream(self, other) -> None:
        return None  # (the host's work is in order already)

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        return None  # (nothing is in flight on the host)


def patch_megatron_moe_for_cpu() -> None:
    """Three more CUDA (and Transformer Engine) assumptions of megatron-core's MoE layer
    beyond ../shared/BENCHMARKS.md's three: the alltoall dispatcher's CUDA streams (a host
    stand-in that is also the current stream, so nothing is waited for), its split sizes
    as host arrays at EP > 1, and the router's unbound ``te_general_gemm``; no number
    changes."""
    import torch
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    # without Transformer Engine, 0.16.1's router gating reads a name its failed import
    # never bound: None is its own "not installed" (torch.mm then)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    stream = _HostStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    # its split sizes, at EP > 1: on a GPU the copy to the host makes them NumPy arrays,
    # which all_to_all_single takes as lists of ints; a CPU tensor stays a tensor, which it
    # refuses -- the same arrays here
    from megatron.core.transformer.moe import token_dispatcher
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def host_splits(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)
    token_dispatcher.maybe_move_tensor_to_cpu = host_splits
    torch.cuda.current_stream = lambda device=None: stream  # type: ignore[assignment, return-value]
    torch.cuda.stream = lambda s: contextlib.nullcontext()  # type: ignore[assignment, return-value]


def import_megatron():
    """megatron-core's modules the bench uses (after :func:`patch_megatron_for_cpu`)."""
    from megatron.core import parallel_state  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: F401


def init_megatron_groups(tp: int):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return parallel_state


class MegatronSide:
    """megatron-core's GPTModel at TP ``tp`` with torch AdamW and megatron's clipping."""

    name = "megatron"

    def __init__(self, tp: int, shape: dict):
        import torch
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
        self.torch = torch
        torch.manual_seed(SEED)  # CPU init draws the full weights, then splits: same seed
        cfg = TransformerConfig(
            num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
            num_attention_heads=shape["heads"], tensor_model_parallel_size=tp,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
            layernorm_epsilon=1e-5, params_dtype=torch.float32,
            use_cpu_initialization=True, bias_activation_fusion=False,
            masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False)
        self.model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                              vocab_size=shape["vocab"],
                              max_sequence_length=shape["seq_length"],
                              share_embeddings_and_output_weights=True,
                              position_embedding_type="learned_absolute")
        self.model.train()
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for n, p in self.model.named_parameters():
            (no_decay if p.dim() == 1 or n.endswith(".bias") else decay).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=LR, betas=(0.9, 0.999), eps=1e-8)
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        # the parameters the grad norm counts once: megatron's get_grad_norm_fp32 inputs
        self.norm_params = [p for p in self.model.parameters()
                            if param_is_not_tensor_parallel_duplicate(p)
                            and not getattr(p, "shared", False)]
        self.mp_group = parallel_state.get_model_parallel_group()
        s = shape["seq_length"]
        self.mask = torch.triu(torch.ones(s, s), 1).bool()[None, None]
        self.pos = torch.arange(s).unsqueeze(0).expand(shape["micro"], s)

    def loss(self, tokens, labels):
        out = self.model(tokens, self.pos, self.mask, labels=labels)  # [b, s] per token
        return out.float().mean()

    def step(self, tokens, labels):
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(tokens, labels)
        loss.backward()
        # megatron.core.optimizer.clip_grads (get_grad_norm_fp32 + clip_grad_by_total_norm_fp32),
        # whose buffers are hard-wired to 'cuda': the same sums, in torch on the CPU
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        sq = torch.stack([torch.norm(g) for g in grads]).square().sum().reshape(1)
        torch.distributed.all_reduce(sq, group=self.mp_group)
        norm = float(sq.item()) ** 0.5
        coeff = CLIP / (norm + 1e-6)
        if coeff < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coeff)
        self.opt.step()
        return loss.detach()

    def evaluate(self, batches):
        return mean_eval_loss(self.model, self.loss, batches)
