"""Record megatron-core 0.16.1's distributed optimizer under virtual pipeline stages: the
fixture tests/fixtures/peers/megatron_distopt_dp_reshardable_pp2_vpp2/ (GPT-2's family,
tied, 4 layers, TP 1 x PP 2 x DP 1 with 2 model chunks per PP rank: 2 ranks).

    OMP_NUM_THREADS=1 /work/venv-peers/bin/python benchmarks/peers/record_megatron_vpp.py
    ... --resume DIR/iter_N --tokens BATCHES.json --losses OUT.json [--resave DIR2]
                        (megatron-core's load of an export for this run, [saved again,]
                         stepping the batches: their losses into OUT.json)

Megatron-LM's ``--num-layers-per-virtual-pipeline-stage 1`` on 4 layers at PP 2
(``virtual_pipeline_model_parallel_size`` 2): each PP rank builds one GPTModel per model
chunk (``vp_stage`` v: chunk 0 of rank 0 layer 0 and the embeddings, chunk 0 of rank 1
layer 1, chunk 1 of rank 0 layer 2, chunk 1 of rank 1 layer 3, the final norm and the
output layer -- the tied copy of the word embeddings), each wrapped in its own
``DistributedDataParallel`` (buckets of ``BUCKET`` on the first chunk only:
Megatron-LM's ``disable_bucketing`` for the chunks after it, and megatron-core's none after
the first PP rank), one ``get_megatron_optimizer`` DistributedOptimizer over both, a step
run by megatron-core's interleaved schedule (``forward_backward_pipelining_with_
interleaving``; the global batch's 2 rows as 2 micro-batches of 1) and
``finalize_model_grads``, the LR from megatron-core's ``OptimizerParamScheduler``. It is
saved after ``SAVE_AT`` steps as Megatron-LM's ``save_checkpoint`` saves a virtual
pipeline -- the chunks' sharded state dicts under ``model0`` / ``model1``, the
optimizer's dp_reshardable state (one grad buffer per chunk: ``dp_group_idx_G.gbuf_idx_V``
and ``per_bucket_numel_unpadded`` a list of one entry per chunk) --, then continues
``CONTINUE`` steps and writes losses.json as benchmarks/peers/record_megatron_checkpoint.py
does (the losses of the steps after the save, their batches). The CPU patches are the
main recorder's (its ``--pp`` run's); megatron-core's own reload of the save continues
bit for bit (checked here). ``--resume`` loads as the main recorder's does (with its three steps for
megatron-core 0.16.1's DistributedOptimizer around torch's AdamW: the dummy state
first, ``torch.no_grad()`` and ``keep_own_step`` around the load, each parameter's
``step`` from the param groups after it), every chunk's sharded state dict under its
``model<v>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.peers.megatron_recipe import (  # noqa: E402
    BETA2,
    BUCKET,
    CLIP,
    CONTINUE,
    DECAY,
    EPS,
    LR,
    MIN_LR,
    SAVE_AT,
    SEED,
    SHAPE,
    WARMUP,
    WD,
    batches,
    megatron_args,
    sharded_metadata,
)

OUT = os.path.join(ROOT, "tests", "fixtures", "peers",
                   "megatron_distopt_dp_reshardable_pp2_vpp2")
PP, VPP, LAYERS = 2, 2, 4


class VirtualRun:
    """The chunks, their DDPs, the DistributedOptimizer and its scheduler on this rank."""

    def __init__(self):
        import torch
        import torch.nn.functional as F
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.transformer_config import TransformerConfig

        from benchmarks.peers.megatron_cpu_optim import cpu_tensors_as_cuda
        s = SHAPE
        torch.manual_seed(SEED)
        cfg = TransformerConfig(
            num_layers=LAYERS, hidden_size=s["hidden_size"], num_attention_heads=s["heads"],
            ffn_hidden_size=s["ffn"], tensor_model_parallel_size=1, normalization="LayerNorm",
            layernorm_epsilon=1e-5, activation_func=F.gelu, add_bias_linear=True,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
            params_dtype=torch.float32, use_cpu_initialization=True,
            bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, gradient_accumulation_fusion=False,
            persist_layer_norm=False, pipeline_model_parallel_size=PP,
            virtual_pipeline_model_parallel_size=VPP, pipeline_dtype=torch.float32)
        spec = get_gpt_layer_local_spec(normalization="LayerNorm")
        with cpu_tensors_as_cuda():  # (the tied copies' all-reduce of weight.data.cuda())
            self.chunks = [GPTModel(
                config=cfg, transformer_layer_spec=spec, vocab_size=s["vocab"],
                max_sequence_length=s["seq_length"], share_embeddings_and_output_weights=True,
                position_embedding_type="learned_absolute",
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                vp_stage=v) for v in range(VPP)]
        self.ddps = [DistributedDataParallel(
            cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_grad_reduce=True, bucket_size=BUCKET),
            m, disable_bucketing=v > 0) for v, m in enumerate(self.chunks)]
        with cpu_tensors_as_cuda():
            self.opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9,
                adam_beta2=BETA2, adam_eps=EPS, clip_grad=CLIP, use_distributed_optimizer=True,
                params_dtype=torch.float32), self.ddps)
        self.gbs = s["micro"]
        self.sched = OptimizerParamScheduler(
            self.opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP * self.gbs,
            lr_decay_steps=DECAY * self.gbs, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
            wd_incr_steps=DECAY * self.gbs, wd_incr_style="constant")
        sq = s["seq_length"]
        self.mask = torch.triu(torch.ones(sq, sq), 1).bool()[None, None]
        self.pos = torch.arange(sq).unsqueeze(0)
        self.torch, self.ps = torch, ps

    def step(self, batch) -> float:
        """One iteration on the global batch (its rows the micro-batches); its mean loss."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from benchmarks.peers.megatron_cpu_optim import cpu_tensors_as_cuda, cuda_as_cpu
        torch = self.torch
        for d in self.ddps:
            d.zero_grad_buffer()
        self.opt.zero_grad()

        def loss_func(out):
            loss = out.float().mean()
            return loss, {"loss": loss.detach().clone()}  # (the schedule scales loss in place)

        def forward_step(data, model):
            b = next(data)
            return model(b[:, :-1], self.pos, self.mask, labels=b[:, 1:]), loss_func
        rows = len(batch)
        with cuda_as_cpu():
            got = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter([batch[i:i + 1] for i in range(rows)]) for _ in range(VPP)],
                model=self.ddps, num_microbatches=rows, seq_length=SHAPE["seq_length"],
                micro_batch_size=1, forward_only=False)
        finalize_model_grads(self.ddps)
        with cpu_tensors_as_cuda():
            ok, _, _ = self.opt.step()
        assert ok
        self.sched.step(increment=self.gbs)
        loss = (torch.stack([g["loss"] for g in got]).mean().reshape(1) if got
                else torch.zeros(1))
        torch.distributed.all_reduce(loss, group=self.ps.get_pipeline_model_parallel_group())
        return float(loss.item())

    def load(self, iter_dir: str) -> int:
        """megatron-core's ``dist_checkpointing.load`` of ``iter_dir`` into the chunks, the
        optimizer and the scheduler (the module docstring); the iteration."""
        from megatron.core import dist_checkpointing

        from benchmarks.peers.megatron_cpu_optim import cpu_tensors_as_cuda, keep_own_step
        meta = sharded_metadata("dp_reshardable")
        model_sd = {f"model{v}": m.sharded_state_dict(metadata=meta)
                    for v, m in enumerate(self.chunks)}
        for opt in self.opt.chained_optimizers:
            opt._init_optimizer_states_with_dummy_values()
        with cpu_tensors_as_cuda():
            opt_sd = self.opt.sharded_state_dict(model_sd, is_loading=True, metadata=meta)
            got = dist_checkpointing.load({**model_sd, "optimizer": opt_sd}, iter_dir)
            for v, m in enumerate(self.chunks):
                m.load_state_dict(got[f"model{v}"])
            with self.torch.no_grad(), keep_own_step():
                self.opt.load_state_dict(got["optimizer"])
        for opt in self.opt.chained_optimizers:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    opt.optimizer.state[p]["step"] = self.torch.tensor(float(group["step"]))
        self.sched.load_state_dict(got["opt_param_scheduler"])
        return int(got["iteration"])

    def save(self, out: str, iteration: int) -> None:
        """Megatron-LM's torch_dist save of a virtual pipeline (``model0``, ``model1``)."""
        import random

        import numpy as np
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        from benchmarks.peers.megatron_cpu_optim import cpu_tensors_as_cuda
        dist = self.torch.distributed
        meta = sharded_metadata("dp_reshardable")
        model_sd = {f"model{v}": m.sharded_state_dict(metadata=meta)
                    for v, m in enumerate(self.chunks)}
        with cpu_tensors_as_cuda():
            optimizer = self.opt.sharded_state_dict(model_sd, metadata=meta)
        args = megatron_args(1, 1, iteration, "gpt2", "dp_reshardable", BUCKET, gbs=self.gbs,
                             pp=PP, split={"num_layers": LAYERS,
                                           "virtual_pipeline_model_parallel_size": VPP,
                                           "num_layers_per_virtual_pipeline_stage": 1,
                                           "micro_batch_size": 1})
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": self.torch.get_rng_state(), "rng_tracker_states": {}}
        iter_dir = os.path.join(out, f"iter_{iteration:07d}")
        if dist.get_rank() == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(
            {**model_sd, "args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "optimizer": optimizer, "opt_param_scheduler": self.sched.state_dict(),
             "rng_state": ShardedObject("rng_state", [rng], (PP, 1),
                                        (self.ps.get_pipeline_model_parallel_rank(), 0),
                                        replica_id=0),
             "num_floating_point_operations_so_far": 0},
            iter_dir, sharded_strategy=("torch_dist", 1))
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
        dist.barrier()


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.peers.megatron_side import patch_megatron_for_cpu
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    torch.cuda.synchronize = lambda device=None: None  # (nothing in flight on the CPU)
    from megatron.core import parallel_state
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP,
                                             virtual_pipeline_model_parallel_size=VPP)
    run = VirtualRun()
    if a.resume:
        resume(run, a)
    else:
        record(run, a.out)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def resume(run: VirtualRun, a: argparse.Namespace) -> None:
    """``a.resume`` loaded (and saved again into ``a.resave``), then the batches of
    ``a.tokens`` stepped: {"iteration", "losses"} into ``a.losses``."""
    import torch
    with open(a.tokens) as f:
        tokens = json.load(f)
    iteration = run.load(a.resume)
    if a.resave:
        run.save(a.resave, iteration)
    out = {"iteration": iteration, "losses": [run.step(torch.tensor(b)) for b in tokens]}
    if torch.distributed.get_rank() == 0:
        with open(a.losses, "w") as f:
            json.dump(out, f)


def record(run: VirtualRun, out: str) -> None:
    import torch.distributed as dist
    data = batches(SAVE_AT + CONTINUE, SHAPE["micro"], seed=7)
    first = [run.step(b) for b in data[:SAVE_AT]]
    run.save(out, SAVE_AT)
    losses = [run.step(b) for b in data[SAVE_AT:]]
    again = VirtualRun()  # megatron-core's own load of the files continues the same
    assert again.load(os.path.join(out, f"iter_{SAVE_AT:07d}")) == SAVE_AT
    worst = max(abs(x - again.step(b)) for x, b in zip(losses, data[SAVE_AT:]))
    assert worst == 0.0, f"megatron-core's reload continues differently ({worst})"
    if dist.get_rank() == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"megatron_core": __import__("megatron.core").core.__version__,
                       "format": "torch_dist", "model": "gpt2", "tp": 1, "dp": 1, "pp": PP,
                       "vpp": VPP, "ep": 1, "moe": None, "distributed_optimizer":
                       "dp_reshardable", "bf16": False, "ddp_bucket_size": BUCKET,
                       "iteration": SAVE_AT, "shape": dict(SHAPE, num_layers=LAYERS),
                       "query_groups": SHAPE["heads"], "lr": LR, "min_lr": MIN_LR,
                       "warmup_iters": WARMUP, "decay_iters": DECAY, "weight_decay": WD,
                       "clip_grad": CLIP, "adam_beta2": BETA2, "adam_eps": EPS,
                       "first_losses": first, "losses": losses,
                       "tokens": [b.tolist() for b in data[SAVE_AT:]]}, f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=OUT)
    p.add_argument("--resume", help="instead: an iter_* directory to load and continue")
    p.add_argument("--tokens", help="with --resume: the batches (a JSON list)")
    p.add_argument("--losses", help="with --resume: where the losses JSON goes")
    p.add_argument("--resave", help="with --resume: save what was loaded there first")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    if not a.resume:
        shutil.rmtree(a.out, ignore_errors=True)
        os.makedirs(a.out)
    more = ["--resume", a.resume, "--tokens", a.tokens, "--losses", a.losses,
            *(["--resave", a.resave] if a.resave else [])] if a.resume else []
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", str(PP), os.path.abspath(__file__),
                            "--worker", "--out", a.out, *more],
                           env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
