"""Record the Megatron-LM ``torch_dist`` fixture of tests/fixtures/peers/megatron_dist/ with
megatron-core 0.16.1 on the CPU (gloo, 2 ranks, TP 2), and megatron_distopt_* (4, TP2 x DP2;
_pp2: TP 1 x PP 2 x DP 2).

    OMP_NUM_THREADS=1 /work/venv-peers/bin/python benchmarks/peers/record_megatron_checkpoint.py
    ... --format torch              (Megatron-LM's legacy format, into .../megatron_legacy/)
    ... --model gpt2 --out DIR      (GPT-2's family: the peer test records it on the fly)
    ... --resume DIR/iter_N --tokens BATCHES.json --losses OUT.json [--resave DIR2]
        [--also DIR3/iter_M]        (load, [save what was loaded again,] and continue;
                                     the global batch is the batches' rows, at any DP;
                                     --also: another export, the same way, one launch)
    ... --dist-opt dp_reshardable --tp 2 --world 4
                                    (the distributed optimizer, TP 2 x DP 2, into
                                     tests/fixtures/peers/megatron_distopt_dp_reshardable/)
    ... --dist-opt fully_reshardable --ddp-bucket-size 0 --tp 2 --world 4
                                    (into .../megatron_distopt_fully_reshardable/)
    ... --dist-opt dp_reshardable --tp 2 --world 4 --bf16
                                    (Megatron-LM's --bf16, into
                                     .../megatron_distopt_dp_reshardable_bf16/)
    ... --dist-opt dp_reshardable --tp 1 --pp 2 --world 4
                                    (TP 1 x PP 2 x DP 2, megatron-core's pipeline
                                     schedule, into .../megatron_distopt_dp_reshardable_pp2/)
    ... --model mixtral --ep 2 --tp 1 --world 2 --ddp-bucket-size 0 [--dist-opt dp_reshardable]
                                    (into .../megatron_moe_ep2[_distopt_dp_reshardable]/)

A tiny Llama-shaped GPT (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied output) of
megatron-core's ``GPTModel`` (local layer spec, ../shared/BENCHMARKS.md's CPU patches) is
trained for ``SAVE_AT`` steps on seeded token batches, then saved as Megatron-LM's
``save_checkpoint`` saves in its default format: ``iter_0000003/`` written by
``megatron.core.dist_checkpointing.save`` (torch_dist) from the state dict Megatron-LM
builds -- the model's sharded state dict under ``model``, the optimizer's under
``optimizer``, ``iteration``, ``args`` (a Namespace of Megatron-LM's fields),
``opt_param_scheduler`` (megatron-core's ``OptimizerParamScheduler``), ``rng_state`` (one
ShardedObject per TP rank) -- and ``latest_checkpointed_iteration.txt``. Then it
continues ``CONTINUE`` steps and records their losses, and checks megatron-core's own
``dist_checkpointing.load`` of the files continues with the same losses (bit for bit).
``losses.json`` holds the losses, the batches' tokens and the shape. ``--format torch``
saves Megatron-LM's legacy format instead: ``iter_0000003/mp_rank_XX/model_optim_rng.pt``
per TP rank, the same dict with the model's and the optimizer's plain state dicts.

The optimizer, by default: megatron-core's ``FP32Optimizer`` around torch's AdamW, stepped
directly after the gradient clipping megatron-core's ``clip_grads`` does, in torch on the
CPU (its buffers are hard-wired to 'cuda'), gradients all-reduced over DP by hand: state
``optimizer.state.exp_avg.<param>``.

``--dist-opt``: megatron-core's own ``--use-distributed-optimizer`` path, all of its code
running: ``DistributedDataParallel`` (its param and grad buffers; with ``--ddp-bucket-size
N`` > 0, ``overlap_grad_reduce`` and buckets of N, reduce-scattered as backward goes),
``get_megatron_optimizer``'s ``DistributedOptimizer`` (torch's AdamW inside: no Apex or
Transformer Engine here), ``finalize_model_grads`` and its ``step`` (clipping, the shard's
AdamW, the params' all-gather), saved with the ``distrib_optim_sharding_type`` Megatron-LM
passes: ``dp_reshardable`` (its default; keys ``optimizer.distributed.dp_group_idx_T.
gbuf_idx_0.dtype_*.bucket_idx_B.{param,exp_avg,exp_avg_sq}``) or ``fully_reshardable``
(``--dist-ckpt-optim-fully-reshardable``: ``optimizer.state.{param,exp_avg,exp_avg_sq}.
<param>``). On gloo and the CPU it needs (:func:`cpu_tensors_as_cuda`) a CPU tensor's
``type()`` to name its CUDA type, ``Tensor.cuda()`` to be the tensor, and ``device='cuda'``
factories to make CPU tensors; no number changes. Its own reload needs three more steps
for megatron-core 0.16.1 with torch's AdamW (found here, each on any device):
``_init_optimizer_states_with_dummy_values`` before the loading state dict (a fresh
optimizer's ``state_dict()`` asserts a per-parameter ``step``, distrib_optimizer.py:642);
``torch.no_grad()`` around ``load_state_dict`` (fp32 params: the dp_reshardable load copies
into views of parameters that require grad, distrib_optimizer.py:940); and each
parameter's ``step`` set from the checkpoint's param groups afterwards
(:meth:`Run._restore_steps`: the load shares one step tensor among all parameters and
dp_reshardable's overwrites it with the dummy's 1; fully_reshardable's raises KeyError
'step' at line 940 without :func:`keep_own_step`). Without the last, the reload's losses
moved by up to 8.3e-4 from the uninterrupted run's; with them they are bit-equal.

``--bf16`` (with ``--dist-opt``): Megatron-LM's ``--bf16`` run -- the GPTModel built in
bf16 inside megatron-core's ``Float16Module`` (fp32 logits out), DDP reducing the grads
in fp32 (``grad_reduce_in_fp32``: ``--accumulate-allreduce-grads-in-fp32``, which
Megatron-LM turns on under ``--bf16``) and the DistributedOptimizer stepping fp32 masters
of the bf16 params (its ``Float16`` path); its buffer's keys are
``dtype_(torch.bfloat16, torch.float32)``, the weights bf16, the buckets' columns fp32.
It runs on the CPU and gloo with the patches above and no others, and megatron-core's own
reload continues bit for bit. ``--bf16`` without ``--dist-opt`` (with ``--resume`` only):
the same model, DDP and grads without the distributed optimizer, so that
``get_megatron_optimizer`` wraps torch's AdamW in ``Float16OptimizerWithFloat16Params``
(fp32 masters of every bf16 param, ``optimizer.state.fp32_param.*`` in its save) -- the
optimizer of Megatron-LM's ``--bf16`` without ``--use-distributed-optimizer``. No patch
beyond the above.

``--pp N`` (with ``--dist-opt``): megatron-core's pipeline schedule, its CPU patches in
benchmarks/peers/megatron_pipeline.py; the rng_state objects are Megatron-LM's (PP, TP)
grid. ``--layers L`` (the model's layers; 2 by default) and ``--first-stage-layers`` /
``--last-stage-layers`` (megatron-core's uneven first and last stages) split the layers
(its ``Split``); the flags are parsed in benchmarks/peers/megatron_cli.py.

Not recorded: ``fully_sharded_model_space`` -- megatron-core 0.16.1 cannot save it
(``ShardedTensor.validate_metadata_integrity`` raises "ShardedTensor.flattened_range is not
supported", dist_checkpointing/mapping.py:134, for the flattened ranges it builds); and
``fully_reshardable`` over several buckets -- its save slices the unpadded concatenation of
the buckets at the padded buffer's offsets (as its code reads), so megatron-core's own
reload of it continued up to 0.051 away from the uninterrupted run (bucket size 1000
here): the fixture is saved with one bucket, Megatron-LM's default without
``--overlap-grad-reduce``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.peers.megatron_cli import layer_split, parse, worker_argv  # noqa: E402
from benchmarks.peers.megatron_cpu_optim import (  # noqa: E402
    cpu_tensors_as_cuda,
    cuda_as_cpu,
    keep_own_step,
)
from benchmarks.peers.megatron_pipeline import Split, pipeline_loss  # noqa: E402
from benchmarks.peers.megatron_recipe import (  # noqa: E402
    ARCH,
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
    moe_config,
    moe_record,
    sharded_metadata,
)

OUT = os.path.join(ROOT, "tests", "fixtures", "peers", "megatron_dist")
LEGACY_OUT = os.path.join(ROOT, "tests", "fixtures", "peers", "megatron_legacy")


class Run:
    """megatron-core's GPTModel, its optimizer wrapper and scheduler on this rank, stepping
    global batches of ``gbs`` rows (by default ``SHAPE["micro"]`` per DP rank), each DP
    rank its ``gbs / dp`` rows as one micro batch."""

    def __init__(self, tp: int, dp: int, arch: str, dist_opt: str | None = None,
                 bucket: int = BUCKET, bf16: bool = False, *, gbs: int | None = None,
                 pp: int = 1, ep: int = 1, split: Split | None = None):
        import torch
        import torch.nn.functional as F
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.transformer_config import TransformerConfig
        split = split or Split()
        s, m = split.shape, ARCH[arch]
        self.split, self.torch, self.tp, self.dp, self.arch = split, torch, tp, dp, arch
        self.dist_opt, self.meta = dist_opt, sharded_metadata(dist_opt)
        self.bucket, self.bf16, self.pp, self.ep = bucket, bf16, pp, ep
        moe = moe_config(arch)
        # megatron-core's DDP and get_megatron_optimizer: the distributed optimizer, a --bf16
        # run's non-distributed one (Float16OptimizerWithFloat16Params), an MoE run's (moe_config)
        self.ddp_path = bool(dist_opt or bf16 or moe)
        dtype = torch.bfloat16 if bf16 else torch.float32
        torch.manual_seed(SEED)
        cfg = TransformerConfig(
            num_layers=s["num_layers"], hidden_size=s["hidden_size"],
            num_attention_heads=s["heads"], num_query_groups=m["query_groups"],
            ffn_hidden_size=s["ffn"], tensor_model_parallel_size=tp,
            normalization=m["normalization"], layernorm_epsilon=1e-5,
            gated_linear_unit=m["swiglu"], activation_func=F.silu if m["swiglu"] else F.gelu,
            add_bias_linear=m["bias"], hidden_dropout=0.0,
            attention_dropout=0.0, init_method_std=0.02, params_dtype=dtype, bf16=bf16,
            use_cpu_initialization=True, bias_activation_fusion=False,
            masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False,
            pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
            expert_model_parallel_size=ep, **moe, **split.config())
        # (PP > 1, tied: the first and last stages' copies of the word embeddings are made
        # equal by an all-reduce of ``weight.data.cuda()``: Tensor.cuda() the tensor here)
        with cpu_tensors_as_cuda() if pp > 1 else contextlib.nullcontext():
            self.model = GPTModel(config=cfg,
                                  transformer_layer_spec=get_gpt_layer_local_spec(
                                      num_experts=moe.get("num_moe_experts"),
                                      normalization=m["normalization"]),
                                  vocab_size=s["vocab"], max_sequence_length=s["seq_length"],
                                  share_embeddings_and_output_weights=m["tied"],
                                  position_embedding_type=m["position"], rotary_base=10000,
                                  pre_process=parallel_state.is_pipeline_first_stage(),
                                  post_process=parallel_state.is_pipeline_last_stage())
        if bf16:  # Megatron-LM's --bf16 model: bf16 params, fp32 logits out
            from megatron.core.transformer.module import Float16Module
            self.model = Float16Module(cfg, self.model)
        self.model.train()
        gbs = gbs or s["micro"] * dp
        if self.ddp_path:
            self._megatron_optimizer(cfg)
            sched_opt = self.opt
        else:
            sched_opt = self._optimizer()
        self.sched = OptimizerParamScheduler(
            sched_opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP * gbs,
            lr_decay_steps=DECAY * gbs, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
            wd_incr_steps=DECAY * gbs, wd_incr_style="constant")
        self.gbs = gbs
        self.norm_params = [p for p in self.model.parameters()
                            if param_is_not_tensor_parallel_duplicate(p)]
        self.mp_group = parallel_state.get_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        sq = s["seq_length"]
        self.mask = torch.triu(torch.ones(sq, sq), 1).bool()[None, None]
        self.pos = torch.arange(sq).unsqueeze(0).expand(gbs // dp, sq)

    def _optimizer(self):
        """megatron-core's FP32Optimizer around torch's AdamW, in megatron's param groups;
        the AdamW (the scheduler's)."""
        import torch
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import FP32Optimizer
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for n, p in self.model.named_parameters():  # megatron-core's default groups
            (no_decay if p.dim() == 1 or n.endswith(".bias") else decay).append(p)
        # megatron-core's param groups: the scheduler sets weight_decay = wd * wd_mult
        keys = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
        adam = torch.optim.AdamW([{"params": decay, "weight_decay": WD, "wd_mult": 1.0, **keys},
                                  {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0,
                                   **keys}],
                                 lr=LR, betas=(0.9, BETA2), eps=EPS)

        def init_state_fn(opt, config=None):
            for group in opt.param_groups:
                for p in group["params"]:
                    if len(opt.state[p]) == 0:
                        opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
        with cuda_as_cpu():
            self.opt = FP32Optimizer(adam, OptimizerConfig(
                optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9,
                adam_beta2=BETA2, adam_eps=EPS, clip_grad=CLIP), init_state_fn)
        return adam

    def _megatron_optimizer(self, cfg) -> None:
        """megatron-core's own: DistributedDataParallel (its param and grad buffers, in
        buckets of ``BUCKET``, reduce-scattered -- all-reduced without the distributed
        optimizer -- as backward goes) and ``get_megatron_optimizer``'s optimizer (torch's
        AdamW inside, without Apex or Transformer Engine): the DistributedOptimizer, as
        Megatron-LM's ``--use-distributed-optimizer --overlap-grad-reduce
        --ddp-bucket-size`` builds them, or, for a --bf16 run without ``dist_opt``,
        Float16OptimizerWithFloat16Params (fp32 masters of the bf16 params)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        self.ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=bool(self.dist_opt),
            overlap_grad_reduce=bool(self.bucket),
            # (Megatron-LM's --bf16 default: --accumulate-allreduce-grads-in-fp32)
            grad_reduce_in_fp32=self.bf16,
            bucket_size=self.bucket or None), self.model)
        with cpu_tensors_as_cuda():
            self.opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9,
                adam_beta2=BETA2, adam_eps=EPS, clip_grad=CLIP,
                use_distributed_optimizer=bool(self.dist_opt), bf16=self.bf16,
                params_dtype=self.ddp.config.params_dtype),
                [self.ddp])

    def _restore_steps(self) -> None:
        """AdamW's per-parameter ``step`` after the distributed optimizer's load, as saved
        (its param groups'): one tensor each (the module docstring says why)."""
        for opt in self.opt.chained_optimizers:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    opt.optimizer.state[p]["step"] = self.torch.tensor(float(group["step"]))

    def ddp_step(self, batch) -> float:
        """One iteration as Megatron-LM's train_step runs it over megatron-core's DDP: the
        DDP buffers zeroed, forward and backward (the buckets' reduce-scatters, or
        all-reduces, as their grads are ready), megatron-core's finalize_model_grads, then
        its optimizer's step (grad-norm clipping, AdamW on the fp32 masters -- this DP
        rank's shard with the distributed optimizer, then the all-gather of the updated
        params --, copied into the model's params)."""
        from megatron.core.distributed import finalize_model_grads
        dist = self.torch.distributed
        m = self.gbs // self.dp
        mine = batch[self.dp_rank * m:(self.dp_rank + 1) * m]
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        if self.pp > 1:
            loss = pipeline_loss(self.ddp, mine, self.pos, self.mask, SHAPE["seq_length"],
                                 m, self.pp_group)
        else:
            loss = self.ddp(mine[:, :-1], self.pos, self.mask, labels=mine[:, 1:]).float().mean()
            loss.backward()
        finalize_model_grads([self.ddp])
        with cpu_tensors_as_cuda():
            ok, _, _ = self.opt.step()
        assert ok
        self.sched.step(increment=self.gbs)
        out = loss.detach().reshape(1)
        dist.all_reduce(out, group=self.dp_group)
        return float(out.item()) / self.dp

    def step(self, batch) -> float:
        """One iteration on this DP rank's rows of ``batch`` (the global batch); the
        global batch's mean loss."""
        if self.ddp_path:
            return self.ddp_step(batch)
        torch, dist = self.torch, self.torch.distributed
        m = self.gbs // self.dp
        mine = batch[self.dp_rank * m:(self.dp_rank + 1) * m]
        self.opt.zero_grad()
        loss = self.model(mine[:, :-1], self.pos, self.mask, labels=mine[:, 1:]).float().mean()
        loss.backward()
        for p in self.model.parameters():  # DP: the mean gradient (megatron's DDP)
            dist.all_reduce(p.grad, group=self.dp_group)
            p.grad.div_(self.dp)
        # megatron.core.optimizer.clip_grads's sums (its buffers are hard-wired to 'cuda')
        sq = torch.stack([torch.norm(p.grad) for p in self.norm_params]).square().sum()
        sq = sq.reshape(1)
        dist.all_reduce(sq, group=self.mp_group)
        coeff = CLIP / (float(sq.item()) ** 0.5 + 1e-6)
        if coeff < 1.0:
            for p in self.model.parameters():
                p.grad.mul_(coeff)
        self.opt.optimizer.step()
        self.sched.step(increment=self.gbs)
        out = loss.detach().reshape(1)
        dist.all_reduce(out, group=self.dp_group)
        return float(out.item()) / self.dp

    def model_sd(self) -> dict:
        """The GPTModel's sharded state dict (with the distributed optimizer, under
        Megatron-LM's metadata)."""
        if self.dist_opt:
            return self.model.sharded_state_dict(metadata=self.meta)
        return self.model.sharded_state_dict()

    def state_dict(self, iteration: int) -> dict:
        """What Megatron-LM's ``generate_state_dict`` builds for ``torch_dist``."""
        import random

        import numpy as np
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        model_sd = self.model_sd()
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": self.torch.get_rng_state(), "rng_tracker_states": {}}
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        if self.dist_opt:
            with cpu_tensors_as_cuda():
                optimizer = self.opt.sharded_state_dict(model_sd, metadata=self.meta)
        else:
            optimizer = self.opt.sharded_state_dict(model_sd)
        return {"args": megatron_args(self.tp, self.dp, iteration, self.arch, self.dist_opt,
                                      self.bucket, self.bf16, gbs=self.gbs, pp=self.pp,
                                      ep=self.ep, split=self.split.args()),
                "checkpoint_version": 3.0,
                "iteration": iteration, "model": model_sd,
                "optimizer": optimizer,
                "opt_param_scheduler": self.sched.state_dict(),
                "rng_state": ShardedObject(
                    "rng_state", [rng], (self.pp, self.tp),
                    (parallel_state.get_pipeline_model_parallel_rank(), tp_rank),
                    replica_id=self.dp_rank),
                "num_floating_point_operations_so_far": 0}

    def load_legacy(self, iter_dir: str) -> int:
        """Megatron-LM's load of its legacy format: the plain state dicts back."""
        from megatron.core import parallel_state
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sd = self.torch.load(os.path.join(iter_dir, f"mp_rank_{tp_rank:02d}",
                                          "model_optim_rng.pt"), weights_only=False)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["opt_param_scheduler"])
        return int(sd["iteration"])

    def load(self, iter_dir: str) -> int:
        from megatron.core import dist_checkpointing
        model_sd = self.model_sd()
        if self.dist_opt:
            # a fresh DistributedOptimizer around torch's AdamW has no per-parameter "step"
            # for its state_dict() to read (distrib_optimizer.py:642 asserts one): megatron-
            # core's own dummy initialization first (its fsdp_dtensor load's; a zero-grad
            # step at the scheduler's initial LR 0, then overwritten by the load)
            for opt in self.opt.chained_optimizers:
                opt._init_optimizer_states_with_dummy_values()
        with cpu_tensors_as_cuda():
            opt_sd = (self.opt.sharded_state_dict(model_sd, is_loading=True, metadata=self.meta)
                      if self.dist_opt else self.opt.sharded_state_dict(model_sd, is_loading=True))
            want = {"model": model_sd, "optimizer": opt_sd}
            got = dist_checkpointing.load(want, iter_dir)
            self.model.load_state_dict(got["model"])
            # (no_grad: with fp32 params the distributed optimizer's main params are views of
            # the model's, which require grad, and its dp_reshardable load copies into them
            # without torch.no_grad -- distrib_optimizer.py:940 raises "a view of a leaf
            # Variable that requires grad is being used in an in-place operation")
            with self.torch.no_grad(), keep_own_step():
                self.opt.load_state_dict(got["optimizer"])
        if self.dist_opt:
            self._restore_steps()
        self.sched.load_state_dict(got["opt_param_scheduler"])
        return int(got["iteration"])


def save(run: Run, save_dir: str, iteration: int, fmt: str) -> str:
    """``fmt`` torch_dist: megatron-core's dist_checkpointing.save of Megatron-LM's state
    dict; torch: Megatron-LM's legacy ``mp_rank_XX/model_optim_rng.pt``, one per TP rank
    (DP rank 0's), of the model's and the optimizer's plain state dicts."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    iter_dir = os.path.join(save_dir, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(iter_dir, exist_ok=True)
    dist.barrier()
    if fmt == "torch_dist":
        dist_checkpointing.save(run.state_dict(iteration), iter_dir,
                                sharded_strategy=("torch_dist", 1))
    elif run.dp_rank == 0:
        sd = run.state_dict(iteration)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sd.update(model=run.model.state_dict_for_save_checkpoint(),
                  optimizer=run.opt.state_dict(), rng_state=[sd["rng_state"].data[0]])
        sd["args"].ckpt_format = "torch"
        os.makedirs(os.path.join(iter_dir, f"mp_rank_{tp_rank:02d}"))
        torch.save(sd, os.path.join(iter_dir, f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return iter_dir


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.peers.megatron_side import patch_megatron_for_cpu, patch_megatron_moe_for_cpu
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    if moe_config(a.model):  # (the alltoall dispatcher's CUDA streams, the router's gemm)
        patch_megatron_moe_for_cpu()
    # dist_checkpointing's writer waits for the device's copies: on the CPU none is in flight
    torch.cuda.synchronize = lambda device=None: None
    from megatron.core import parallel_state
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp,
                                             pipeline_model_parallel_size=a.pp,
                                             expert_model_parallel_size=a.ep)
    dp = world // (a.tp * a.pp)
    if a.resume:
        resume(a, dp)
    else:
        record(a, dp)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def resume(a, dp: int) -> None:
    """megatron-core's ``dist_checkpointing.load`` of ``a.resume`` (an ``iter_*`` hybrid
    exported), then the steps on ``a.tokens``' batches; their losses into ``a.losses``.
    ``a.resave``: first, the loaded state saved there by megatron-core. The global batch
    is the batches' (at another DP size than the save's, the same rows per step).
    ``a.also``: then each of these iterations the same way, in a fresh run of the same
    flags in the sharding type its ``common.pt`` records (the losses under ``also``)."""
    import torch
    import torch.distributed as dist
    with open(a.tokens) as f:
        tokens = json.load(f)
    run = Run(a.tp, dp, a.model, a.dist_opt, a.ddp_bucket_size, a.bf16, gbs=len(tokens[0]),
              pp=a.pp, ep=a.ep, split=layer_split(a))
    iteration = run.load(a.resume)
    if a.resave:  # what megatron-core loaded, saved again by megatron-core before stepping
        save(run, a.resave, iteration, "torch_dist")
    out: dict = {"iteration": iteration,
                 "losses": [run.step(torch.tensor(b)) for b in tokens]}
    for other in a.also or []:  # (one launch for several exports: a fresh run for each)
        sharding = torch.load(os.path.join(other, "common.pt"), weights_only=False)[
            "optimizer"]["param_state_sharding_type"]
        run = Run(a.tp, dp, a.model, sharding, a.ddp_bucket_size, a.bf16,
                  gbs=len(tokens[0]), pp=a.pp, ep=a.ep, split=layer_split(a))
        it = run.load(other)
        out.setdefault("also", []).append(
            {"iteration": it, "losses": [run.step(torch.tensor(b)) for b in tokens]})
    if dist.get_rank() == 0:
        with open(a.losses, "w") as f:
            json.dump(out, f)


def record(a, dp: int) -> None:
    import torch.distributed as dist
    run = Run(a.tp, dp, a.model, a.dist_opt, a.ddp_bucket_size, a.bf16, pp=a.pp, ep=a.ep,
                split=layer_split(a))
    data = batches(SAVE_AT + CONTINUE, SHAPE["micro"] * dp, seed=7)
    first = [run.step(b) for b in data[:SAVE_AT]]
    save(run, a.out, SAVE_AT, a.format)
    losses = [run.step(b) for b in data[SAVE_AT:]]
    # megatron-core's own load of the files continues the same
    again = Run(a.tp, dp, a.model, a.dist_opt, a.ddp_bucket_size, a.bf16, pp=a.pp, ep=a.ep,
                split=layer_split(a))
    load = again.load if a.format == "torch_dist" else again.load_legacy
    assert load(os.path.join(a.out, f"iter_{SAVE_AT:07d}")) == SAVE_AT
    reloaded = [again.step(b) for b in data[SAVE_AT:]]
    worst = max(abs(x - y) for x, y in zip(losses, reloaded))
    assert losses == reloaded, f"megatron-core's reload continues differently ({worst}; NaN?)"
    if dist.get_rank() == 0:
        with open(os.path.join(a.out, "losses.json"), "w") as f:
            json.dump({"megatron_core": __import__("megatron.core").core.__version__,
                       "format": a.format, "model": a.model, "tp": a.tp, "dp": dp, "pp": a.pp,
                       "ep": a.ep, "moe": moe_record(a.model),
                       "distributed_optimizer": a.dist_opt, "bf16": a.bf16,
                       "ddp_bucket_size": a.ddp_bucket_size if a.dist_opt else None,
                       "iteration": SAVE_AT,
                       "shape": run.split.shape, "query_groups": ARCH[a.model]["query_groups"],
                       "lr": LR, "min_lr": MIN_LR, "warmup_iters": WARMUP,
                       "decay_iters": DECAY, "weight_decay": WD, "clip_grad": CLIP,
                       "adam_beta2": BETA2, "adam_eps": EPS, "first_losses": first,
                       "losses": losses,
                       "tokens": [b.tolist() for b in data[SAVE_AT:]]}, f)


def main() -> int:
    a = parse(__doc__.split("\n\n")[0], OUT, LEGACY_OUT)
    if a.worker:
        worker(a)
        return 0
    if not a.resume:
        shutil.rmtree(a.out, ignore_errors=True)
        os.makedirs(a.out)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", str(a.world), os.path.abspath(__file__),
                            *worker_argv(a)], env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
