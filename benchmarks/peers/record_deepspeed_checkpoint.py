"""Record DeepSpeed 0.19.8 checkpoints (and the losses DeepSpeed trains after them) for
hybrid's import tests: tests/fixtures/peers/deepspeed-0.19.8/ (a folder name no import
can take for the deepspeed package).

Runs the real DeepSpeed on the CPU (DS_ACCELERATOR=cpu, gloo, 2 ranks, fp32,
torch's AdamW through ``"torch_adam": true``): a tiny model is trained for 3 steps
without ZeRO (stage 0) and at stages 2 and 3, saved with ``engine.save_checkpoint``, then trained
10 more steps, whose losses (the mean over both ranks' micro-batches, that is the
global batch's) are written to ``losses.json`` beside the checkpoints.

The model and the batches are defined here (:class:`Net`, :func:`batch`) and imported
by the tests, so that hybrid builds the same model and feeds the same global batch of
step ``i``, whatever its layout: rank ``r`` of ``n`` takes rows ``[r*B/n, (r+1)*B/n)``.

The ZeRO 2 save is also converted by DeepSpeed's ``ds_to_universal`` into its universal
format (``global_step3_universal/``, ``latest_universal``).

A tiny transformers ``GPT2LMHeadModel`` is trained the same way at ZeRO 2 on the batches
``scripts/pretrain_gpt.py`` reads with :data:`GPT_ARGS` (its config.json saved beside
``latest``, as Hugging Face's Trainer does): the ``--load`` route; and a tiny
``LlamaForCausalLM`` (GQA, untied) the same way with :data:`LLAMA_ARGS`. The
GPT-2 is also recorded without ZeRO (``gpt2_zero0``: one model-state file, its tied
embedding saved under both names).

:class:`FrozenNet` (a frozen layer and a BatchNorm's buffers before :class:`Net`) is
recorded at stages 2 and 3 (``frozen_zero2``, ``frozen_zero3``) and without ZeRO
(``frozen0``: ``frozen_zero0``), and at stage 2 saved with
``exclude_frozen_parameters=True`` (``frozen_zero2_excluded``: what Hugging Face's Trainer
saves for a PEFT model).

A DeepSpeed ``PipelineModule`` (:func:`pipe_layers`: five layers, the first's weight tied
to the last's) is trained by DeepSpeed's ``PipelineEngine`` (``train_batch``) on 2 stages
without ZeRO (``pipe_zero0``) and at ZeRO 1 (``pipe_zero1``), and at ZeRO 1 on PP 2 x DP 2
(``pipe_dp2_zero1``, 4 ranks): per-layer files and per-stage optimizer state (about a
minute for the three); and in bf16 without ZeRO on 2 stages (``pipe_bf16``: DeepSpeed's
PipelineEngine then trains with BF16_Optimizer, as Megatron-DeepSpeed's bf16 runs do;
bf16 inputs, the loss in fp32 of the bf16 outputs).

Regenerate (two to three minutes on 2 cores; needs DeepSpeed 0.19.8 and transformers,
and this checkout's hybrid on the path for the data)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=. python \
        benchmarks/peers/record_deepspeed_checkpoint.py \
        tests/fixtures/peers/deepspeed-0.19.8 [net] [gpt2] [llama] [frozen] [gpt2_zero0] \
        [frozen_excluded] [frozen0] [pipe_zero0] [pipe_zero1] [pipe_dp2_zero1] [pipe_bf16] \
        [mds_gpt_zero1] [mds_gpt_zero0] [mds_gpt_bf16] [bf16] [fp16]

``mds_gpt_zero1`` records a PipelineModule with Megatron-DeepSpeed's GPTModelPipe layer
list and parameter names (:mod:`benchmarks.peers.gptmodelpipe`, as read from
Megatron-DeepSpeed's source) for the model of GPT_ARGS, trained by DeepSpeed's own
PipelineEngine (PP 2, ZeRO 1, fp32) on pretrain_gpt.py's batches: the fixture of
``pretrain_gpt.py --load`` for Megatron-DeepSpeed GPT checkpoints; ``mds_gpt_zero0`` the
same without ZeRO; ``mds_gpt_bf16`` in bf16 without ZeRO (BF16_Optimizer, with
GPTModelPipe's output cast). Not written by Megatron-DeepSpeed, which needs CUDA and apex.

``bf16`` records :class:`Net` in bf16 (:data:`BF16_CASES`: each fixture's stage and
DeepSpeed optimizer wrapper), the losses computed in fp32 from the bf16 logits.
``fp16`` records :class:`Net` in fp16 with dynamic loss scaling without ZeRO and at
ZeRO 2 and 3 (:mod:`benchmarks.peers.deepspeed_fp16`: DeepSpeed's CPU accelerator refuses
fp16 on a CPU without oneDNN fp16, and that module's documented patch makes its one
query answer True, changing no number DeepSpeed computes).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.peers import deepspeed_fp16  # noqa: E402
from benchmarks.peers.gptmodelpipe import mds_config, mds_layers, mds_loss  # noqa: E402

GLOBAL_BATCH = 8
WORLD = 2
SAVED_AT = 3      # steps before the save
CONTINUED = 10    # steps recorded after it
STAGES = tuple(int(s) for s in os.environ.get("RECORD_STAGES", "0,2,3").split(","))
FROZEN_STAGES = (2, 3)  # FrozenNet: a frozen layer and buffers, DeepSpeed's two layouts
# (and without ZeRO, "frozen0": the module's state dict holds the frozen layer, and the
# torch optimizer's numbered state the trained parameters only)
LR = 1e-2


class Net(nn.Module):
    """Odd sizes, so that the flat ZeRO partitions of 2 ranks carry padding."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 9)
        self.fc2 = nn.Linear(9, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class FrozenNet(nn.Module):
    """:class:`Net` behind a frozen pretrained layer (``base``, ``requires_grad`` False,
    so in no ZeRO partition: DeepSpeed saves it in ``frozen_param_fragments``) and a
    BatchNorm without affine weights (running statistics: buffers only)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(7, 7)
        self.norm = nn.BatchNorm1d(7, affine=False)
        self.head = Net()
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.head(self.norm(self.base(x)))


def step_mean(engine, loss, world: int) -> float:
    """One backward and step of ``engine``; the loss averaged over the ``world`` ranks
    (the peer test steps DeepSpeed with it too)."""
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return float(mean) / world


def end_rank() -> None:
    """End a DeepSpeed rank whose results are written: a barrier, then ``os._exit(0)``
    before interpreter teardown. DeepSpeed keeps its own references to the gloo groups,
    so ``destroy_process_group`` cannot destroy them, and a gloo worker thread still
    freeing a finished collective's tensors at teardown can abort the rank ("terminate
    called without an active exception"; hybrid/parallel/teardown.py's note). The peer
    test's ranks end here too."""
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def config(stage: int) -> dict:
    """The ds_config both sides use (hybrid's engine reads DeepSpeed's config keys)."""
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.01,
                                                      "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                         "warmup_max_lr": LR,
                                                         "warmup_num_steps": 6}},
            "zero_optimization": {"stage": stage}}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (0-based): inputs (B, 7), targets (B,)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,),
                                                                     generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _worker(rank: int, port: int, out_dir: str, stage: int, frozen: bool = False,
            exclude: bool = False) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = FrozenNet() if frozen else Net()
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=config(stage))
    per = GLOBAL_BATCH // WORLD
    losses = []
    for step in range(SAVED_AT + CONTINUED):
        if step == SAVED_AT:  # (the info ds_to_universal asks of a client: none needed)
            engine.save_checkpoint(out_dir, client_state={"universal_checkpoint_info": {}},
                                   exclude_frozen_parameters=exclude)
        x, y = batch(step)
        loss = loss_of(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        losses.append(step_mean(engine, loss, WORLD))
    if rank == 0:
        record = {"deepspeed": deepspeed.__version__, "world_size": WORLD,
                  "zero_stage": stage, "saved_at": SAVED_AT, "before": losses[:SAVED_AT],
                  "after": losses[SAVED_AT:]}
        if frozen:  # (the frozen weight never moves; the statistics are rank 0's)
            record["model"] = "FrozenNet"
            record["exclude_frozen_parameters"] = exclude
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(record, f, indent=1)
    end_rank()


# The script route: a transformers GPT2LMHeadModel trained by DeepSpeed on the batches
# scripts/pretrain_gpt.py reads with these flags (hybrid's own data pipeline builds them
# here, so both sides see the same tokens), then `pretrain_gpt.py --load DIR` continues.
# AdamW as hybrid's with these flags: no weight decay (Megatron's decays no bias or norm,
# DeepSpeed's one group all), no clipping, a constant rate.
GPT_STAGE = 2
GPT_ARGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--ffn-hidden-size", "64", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "99",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--openai-gelu", "--lr", "0.003", "--min-lr", "0.003", "--lr-decay-style",
            "constant", "--weight-decay", "0", "--clip-grad", "0", "--seed", "7",
            "--train-iters", str(SAVED_AT + CONTINUED), "--eval-iters", "0",
            "--log-interval", "1"]


def gpt2_config():
    """The GPT2LMHeadModel of GPT_ARGS (vocabulary: 99 ids and the end-of-document one)."""
    from transformers import GPT2Config
    return GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                      n_inner=64, activation_function="gelu_new", resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                      bos_token_id=99, eos_token_id=99)


# The same route for a transformers LlamaForCausalLM (GQA: 4 heads, 2 K/V heads, so TP 2
# splits whole groups; untied; no biases), with the flags that make hybrid's GPT that Llama.
LLAMA_ARGS = [{"--openai-gelu": "--swiglu"}.get(a, a) for a in GPT_ARGS] + [
    "--num-attention-heads", "4", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
    "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def llama_config():
    """The LlamaForCausalLM of LLAMA_ARGS."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=16, rms_norm_eps=1e-5,  # (RoPE base 10000)
                       tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                       bos_token_id=99, eos_token_id=99)


def gpt_batches(world: int, rank: int, args: list[str] = GPT_ARGS):
    """Iteration i's (tokens, labels) of DP rank ``rank`` of ``world``: what
    pretrain_gpt.py with GPT_ARGS feeds that rank (its micro-batches, concatenated)."""
    from hybrid.config import build_config, parse_args
    from hybrid.data.dataset import build_datasets, dp_micro_batches
    from hybrid.data.tokenizer import build_tokenizer
    cfg = build_config(parse_args(args), world)
    data = build_datasets(cfg.data, build_tokenizer(cfg.tokenizer))["train"]
    gbs, mbs = cfg.loop.global_batch_size, cfg.loop.micro_batch_size

    def at(i: int):
        micro = dp_micro_batches(data, i * gbs, gbs, mbs, rank, world, torch.device("cpu"))
        return torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    return at


def _hf_worker(rank: int, port: int, out_dir: str, family: str, stage: int = 2) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = gpt2_config() if family == "gpt2" else llama_config()
    config._attn_implementation = "eager"  # (plain matmuls and softmax, as hybrid on the CPU)
    model = (GPT2LMHeadModel if family == "gpt2" else LlamaForCausalLM)(config)
    args = GPT_ARGS if family == "gpt2" else LLAMA_ARGS
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
          "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.999],
                                                    "eps": 1e-8, "weight_decay": 0.0,
                                                    "torch_adam": True}},
          "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds)
    batch = gpt_batches(WORLD, rank, args)
    losses = []
    for step in range(SAVED_AT + CONTINUED):
        if step == SAVED_AT:
            engine.save_checkpoint(out_dir)
            if rank == 0:  # beside latest, as Hugging Face's Trainer writes it
                model.config.save_pretrained(out_dir)
        tokens, labels = batch(step)
        logits = engine(tokens).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1))
        losses.append(step_mean(engine, loss, WORLD))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "world_size": WORLD,
                       "zero_stage": stage, "saved_at": SAVED_AT,
                       "pretrain_gpt_args": args, "before": losses[:SAVED_AT],
                       "after": losses[SAVED_AT:]}, f, indent=1)
    end_rank()


# A DeepSpeed PipelineModule (runtime/pipe): five layers cut uniformly into 2 stages
# ([0, 3), [3, 5)), the first layer's weight tied to the last's (TiedLayerSpec, the last
# using it transposed through forward_fn, as Megatron-DeepSpeed's GPT ties its embedding
# and head), a parameterless layer between, trained by DeepSpeed's PipelineEngine
# (train_batch: PIPE_MICRO rows a micro-batch, gradient accumulation to GLOBAL_BATCH) on
# PIPE_STAGES x DP ranks; its layer and per-stage files are hybrid's pipeline import's
# fixtures (pipe_zero0, pipe_zero1; pipe_dp2_zero1 at PP 2 x DP 2).
PIPE_STAGES = 2
PIPE_MICRO = 2


def pipe_head(module, x):
    """The tied weight's second use: the output layer, ``x @ W`` (W: 9 x 7)."""
    return x @ module.weight


def pipe_layers(layer_spec, tied_layer_spec) -> list:
    """The layers, given DeepSpeed's LayerSpec and TiedLayerSpec classes (or hybrid's)."""
    return [tied_layer_spec("embed", nn.Linear, 7, 9, bias=False),
            layer_spec(nn.Linear, 9, 9), layer_spec(nn.Tanh), layer_spec(nn.Linear, 9, 9),
            tied_layer_spec("embed", nn.Linear, 7, 9, bias=False, forward_fn=pipe_head)]


def pipe_config(stage: int) -> dict:
    """:func:`config` with PIPE_MICRO-row micro-batches (the accumulation: the rest)."""
    out = config(stage)
    del out["gradient_accumulation_steps"]
    return {**out, "train_micro_batch_size_per_gpu": PIPE_MICRO}


def pipe_micro_batches(step: int, dp_rank: int, dp_size: int) -> list:
    """DP rank ``dp_rank``'s micro-batches of step ``step``: its rows of :func:`batch`
    (``[r*B/n, (r+1)*B/n)``), PIPE_MICRO at a time, as (inputs, labels)."""
    x, y = batch(step)
    per = GLOBAL_BATCH // dp_size
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return [(x[i:i + PIPE_MICRO], y[i:i + PIPE_MICRO]) for i in range(0, per, PIPE_MICRO)]


def pipe_bf16_config() -> dict:
    """``pipe_bf16``'s ds_config: :func:`pipe_config` without ZeRO, in bf16 (DeepSpeed's
    PipelineEngine wraps its optimizer in BF16_Optimizer: Megatron-DeepSpeed's, BLOOM's)."""
    return {**pipe_config(0), "bf16": {"enabled": True}}


def pipe_bf16_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The bf16 pipeline's loss: cross entropy in fp32 of its bf16 outputs."""
    return loss_of(out.float(), y)


def pipe_bf16_micro_batches(step: int, dp_rank: int, dp_size: int) -> list:
    """:func:`pipe_micro_batches` with bf16 inputs."""
    return [(x.to(torch.bfloat16), y) for x, y in pipe_micro_batches(step, dp_rank, dp_size)]


def _pipe_worker(rank: int, port: int, out_dir: str, stage: int, world: int,
                 bf16: bool = False) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = PipelineModule(pipe_layers(LayerSpec, TiedLayerSpec), num_stages=PIPE_STAGES,
                         loss_fn=pipe_bf16_loss if bf16 else loss_of,
                         partition_method="uniform")
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=pipe_bf16_config() if bf16 else pipe_config(stage))
    dp_rank, dp_size = engine.grid.get_data_parallel_id(), engine.grid.data_parallel_size
    batches = pipe_bf16_micro_batches if bf16 else pipe_micro_batches
    losses = []
    for step in range(SAVED_AT + CONTINUED):
        if step == SAVED_AT:
            engine.save_checkpoint(out_dir)
        loss = engine.train_batch(iter(batches(step, dp_rank, dp_size)))
        losses.append(float(loss))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "world_size": world,
                       "pipeline_stages": PIPE_STAGES, "zero_stage": stage,
                       **({"bf16": True, "optimizer": type(engine.optimizer).__name__}
                          if bf16 else {}),
                       "partition": net.parts, "saved_at": SAVED_AT,
                       "before": losses[:SAVED_AT], "after": losses[SAVED_AT:]}, f, indent=1)
    end_rank()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _universal(out: str) -> None:
    """DeepSpeed's ``ds_to_universal`` of the save in ``out`` (beside it, ``_universal``)."""
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", os.path.join(out, f"global_step{SAVED_AT}"),
                    "--output_folder", os.path.join(out, f"global_step{SAVED_AT}_universal"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, stdout=subprocess.DEVNULL)


def _clean(out: str) -> None:
    for helper in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's own scripts,
        if os.path.exists(os.path.join(out, helper)):       # copied by every save
            os.remove(os.path.join(out, helper))


def main(argv: list[str]) -> int:
    root = argv[0] if argv else "tests/fixtures/peers/deepspeed-0.19.8"
    which = argv[1:] or ["net", "gpt2", "llama", "frozen", "frozen0", "gpt2_zero0",
                         "frozen_excluded",
                         "pipe_zero0", "pipe_zero1", "pipe_dp2_zero1", "pipe_bf16",
                         "mds_gpt_zero1", "mds_gpt_zero0", "mds_gpt_bf16", "bf16", "fp16"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for case, stage in (("gpt2", GPT_STAGE), ("llama", GPT_STAGE), ("gpt2_zero0", 0)):
        if case not in which:
            continue
        family = case.split("_")[0]
        out = os.path.join(root, f"{family}_zero{stage}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        torch.multiprocessing.spawn(_hf_worker, args=(_port(), out, family, stage),
                                    nprocs=WORLD)
        _clean(out)
        print(f"wrote {out}")
    for stage in STAGES if "net" in which else ():
        out = os.path.join(root, f"net_zero{stage}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        torch.multiprocessing.spawn(_worker, args=(_port(), out, stage), nprocs=WORLD)
        _clean(out)
        if stage == 2:  # DeepSpeed's universal format of the same tag, by its own converter
            _universal(out)
        print(f"wrote {out}")
    frozen = [(s, False) for s in FROZEN_STAGES] if "frozen" in which else []
    frozen += [(0, False)] if "frozen0" in which else []
    for stage, exclude in frozen + ([(2, True)] if "frozen_excluded" in which else []):
        out = os.path.join(root, f"frozen_zero{stage}" + ("_excluded" if exclude else ""))
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        torch.multiprocessing.spawn(_worker, args=(_port(), out, stage, True, exclude),
                                    nprocs=WORLD)
        _clean(out)
        print(f"wrote {out}")
    for case, stage, world in (("pipe_zero0", 0, 2), ("pipe_zero1", 1, 2),
                               ("pipe_dp2_zero1", 1, 4), ("pipe_bf16", 0, 2)):
        if case not in which:
            continue
        out = os.path.join(root, case)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        torch.multiprocessing.spawn(_pipe_worker, args=(_port(), out, stage, world,
                                                        case == "pipe_bf16"),
                                    nprocs=world)
        _clean(out)
        print(f"wrote {out}")
    for case, stage in (("mds_gpt_zero1", 1), ("mds_gpt_zero0", 0), ("mds_gpt_bf16", 0)):
        if case not in which:
            continue
        out = os.path.join(root, case)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        torch.multiprocessing.spawn(_mds_worker, args=(_port(), out, stage, "bf16" in case),
                                    nprocs=WORLD)
        _clean(out)
        print(f"wrote {out}")
    fp16 = [n for n in deepspeed_fp16.FP16_CASES if "fp16" in which or n in which]
    for name in [*(BF16_CASES if "bf16" in which else ()), *fp16]:
        out = os.path.join(root, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        torch.multiprocessing.spawn(_bf16_worker, args=(_port(), out, name), nprocs=WORLD)
        _clean(out)
        if name in deepspeed_fp16.UNIVERSAL:  # (and its universal format)
            _universal(out)
        print(f"wrote {out}")
    return 0


# bf16: DeepSpeed 0.19.8 picks its optimizer wrapper by stage and gradient-accumulation
# dtype (engine._do_optimizer_sanity_check): without ZeRO, FP16_UnfusedOptimizer in bf16
# (torch's AdamW is not a fused one; fp32 masters per parameter, in the model-state file's
# "optimizer"); ZeRO 1 with fp32 gradient accumulation, BF16_Optimizer (Megatron-
# DeepSpeed's, BLOOM's: bf16_zero_pp_rank_* files of flat fp32 partitions and no
# zero_stage); ZeRO 2 and 3, the ZeRO optimizers in bf16 (bf16_zero_pp_rank_* files).
# name -> (stage, ds_config keys beyond config(stage) and the bf16 block)
BF16_CASES = {"net_bf16_zero0": (0, {}),
              "net_bf16_zero1": (1, {"data_types": {"grad_accum_dtype": "fp32"}}),
              "net_bf16_zero2": (2, {}),
              "net_bf16_zero3": (3, {})}


def bf16_config(name: str) -> dict:
    """The ds_config of bf16 fixture ``name`` (both sides use it)."""
    stage, extra = BF16_CASES[name]
    return {**config(stage), "bf16": {"enabled": True}, **extra}


def bf16_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The bf16 model's loss: bf16 inputs, cross entropy in fp32 of its bf16 logits (an
    fp32 loss resolves far finer differences than a bf16 one)."""
    return loss_of(model(x.to(torch.bfloat16)).float(), y)


def _bf16_worker(rank: int, port: int, out_dir: str, name: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if name in deepspeed_fp16.FP16_CASES:  # (fp16: its module, under the CPU patch; the
        deepspeed_fp16.record(sys.modules[__name__], rank, out_dir, name)  # rank ends there)
        return
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=bf16_config(name))
    per, losses = GLOBAL_BATCH // WORLD, []
    for step in range(SAVED_AT + CONTINUED):
        if step == SAVED_AT:
            engine.save_checkpoint(out_dir)
        x, y = batch(step)
        rows = slice(rank * per, (rank + 1) * per)
        losses.append(step_mean(engine, bf16_loss(engine, x[rows], y[rows]), WORLD))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "world_size": WORLD,
                       "zero_stage": BF16_CASES[name][0], "bf16": True,
                       "optimizer": type(engine.optimizer).__name__,
                       "saved_at": SAVED_AT, "before": losses[:SAVED_AT],
                       "after": losses[SAVED_AT:]}, f, indent=1)
    end_rank()


# Megatron-DeepSpeed's GPT: benchmarks/peers/gptmodelpipe.py (GPTModelPipe's layer list and
# parameter names as read from Megatron-DeepSpeed's source), trained by DeepSpeed's own
# PipelineEngine at PP 2 on pretrain_gpt.py's batches (mds_gpt_zero1).


def _mds_worker(rank: int, port: int, out_dir: str, stage: int, bf16: bool = False) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = PipelineModule(mds_layers(LayerSpec, TiedLayerSpec, bf16=bf16),
                         num_stages=PIPE_STAGES, loss_fn=mds_loss,
                         partition_method="type:transformer")
    config = {**mds_config(stage), **({"bf16": {"enabled": True}} if bf16 else {})}
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=config)
    batch = gpt_batches(1, 0)  # (PP 2 x DP 1: the whole global batch, 2 micro-batches)
    losses = []
    for step in range(SAVED_AT + CONTINUED):
        if step == SAVED_AT:
            engine.save_checkpoint(out_dir)
        tokens, labels = batch(step)
        micro = [(tokens[i:i + 2], labels[i:i + 2]) for i in range(0, 4, 2)]
        losses.append(float(engine.train_batch(iter(micro))))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "world_size": WORLD,
                       "pipeline_stages": PIPE_STAGES, "zero_stage": stage,
                       **({"bf16": True, "optimizer": type(engine.optimizer).__name__}
                          if bf16 else {}),
                       "model": "GPTModelPipe's layer list (from Megatron-DeepSpeed's "
                                "source), recorded by DeepSpeed's PipelineEngine",
                       "partition": [int(p) for p in net.parts], "pretrain_gpt_args": GPT_ARGS,
                       "saved_at": SAVED_AT, "before": losses[:SAVED_AT],
                       "after": losses[SAVED_AT:]}, f, indent=1)
    end_rank()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
