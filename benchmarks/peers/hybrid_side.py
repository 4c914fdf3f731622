"""hybrid's GPT at TP ``ps.tp_size``, built and stepped as training builds and steps it.
hybrid is imported only inside functions: the parent never needs it."""

from __future__ import annotations

import os

from benchmarks.peers.common import CLIP, LR, SEED, WEIGHT_DECAY, mean_eval_loss


def import_hybrid():
    """hybrid's modules the bench uses."""
    import hybrid.config  # noqa: F401
    import hybrid.kernels  # noqa: F401
    import hybrid.parallel.state  # noqa: F401
    import hybrid.tensor_parallel  # noqa: F401
    import hybrid.train.setup  # noqa: F401
    import hybrid.train.step  # noqa: F401


class HybridSide:
    """hybrid's GPT at TP ``ps.tp_size``, built as training builds it."""

    name = "hybrid"

    def __init__(self, ps, shape: dict, zero_stage: int):
        from hybrid.config import Flags, build_config
        from hybrid.kernels import configure
        from hybrid.tensor_parallel import seed_all
        from hybrid.train.setup import build_engine
        from hybrid.train.step import train_step
        self.train_step = train_step
        flags = Flags(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                      num_attention_heads=shape["heads"], seq_length=shape["seq_length"],
                      micro_batch_size=shape["micro"],
                      global_batch_size=shape["micro"] * (ps.world_size // ps.tp_size),
                      tensor_model_parallel_size=ps.tp_size, hidden_dropout=0.0,
                      attention_dropout=0.0, lr=LR, weight_decay=WEIGHT_DECAY,
                      clip_grad=CLIP, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                      zero_stage=zero_stage, seed=SEED)
        cfg = build_config(flags, ps.world_size, environ=os.environ)
        configure(cfg.kernels)  # as scripts/pretrain_gpt.py does
        rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device, ps.cp_rank, ps.tp_size)
        self.model, _, self.engine = build_engine(cfg, ps, shape["vocab"], rng)
        self.model.train()

    def step(self, tokens, labels):
        loss, _, _ = self.train_step(self.model, self.engine, [(tokens, labels)], LR)
        return loss.detach()

    def evaluate(self, batches):
        return mean_eval_loss(self.model, self.model, batches)

    def close(self):
        self.engine.wait_optimizer()
