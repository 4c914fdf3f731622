"""The torch side of the DCP proofs: a Llama shaped and named as torchtitan's Llama3, trained
with FSDP2 and torch's AdamW, saved and loaded with torch DCP as torchtitan's
CheckpointManager structures the state.

torchtitan itself is not imported: its current code needs packages this machine does not
have (``spmd_types``, ``grain``, ``torch_checkpointing``, ...). What matters for the
checkpoint is reproduced from its code (read at github.com/pytorch/torchtitan, not copied):

* the module names (``tok_embeddings``, ``layers.N.attention.wq/wk/wv/wo``,
  ``layers.N.feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``,
  ``output``) and the arithmetic: RoPE on complex pairs (adjacent channels of a head
  rotate together), grouped-query attention, SwiGLU ``w2(silu(w1 x) * w3 x)``, RMSNorm;
* the saved state: the model's state dict flattened to the top level, ``optimizer`` the
  optimizer's FQN-keyed flat state dict (``state.<fqn>.exp_avg``, ``state.<fqn>.step``,
  ``param_groups.<fqn>.lr``), ``lr_scheduler`` the LambdaLR's state dict, ``dataloader``
  one entry per DP rank (``dp_rank_<r>``) and ``world_size``, ``train_state``
  ``{"step", "ntokens_seen"}``; written to ``<folder>/step-<N>/`` by ``dcp.save``.

One function per job, each collective over a gloo world already initialized:
:func:`build` (the model, sharded with ``fully_shard``), :func:`make_optimizer`,
:func:`train_step`, :func:`save`, :func:`load`. :func:`batch` is the token batch of a
step, the same on both sides of every proof.
"""

from __future__ import annotations

import pickle
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# The tiny shape of the recorded fixture (dim 32 rather than 64 keeps the committed
# checkpoint, weights and both moments, under half a megabyte).
SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=96,
             norm_eps=1e-5, rope_theta=10000.0, seq_len=32)
# torch AdamW as the run uses it; hybrid's flags for the same are in the fixture's JSON
OPTIM: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 1.0
MICRO = 2  # sequences per rank and step (2 ranks: a global batch of 4)


@dataclass
class Shape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    seq_len: int


def rope_table(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """(seq, head_dim / 2) complex rotations, channel pair j at frequency theta^(-2j/d)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (b, s, h, d): adjacent channel pairs as complex numbers times the table."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * table[None, :, None, :]).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = s.n_heads, s.n_kv_heads, s.dim // s.n_heads
        self.wq = nn.Linear(s.dim, s.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(s.n_heads * self.hd, s.dim, bias=False)

    def forward(self, x, table):
        b, n, _ = x.shape
        # heads counted from the projections: under TP a rank holds its share of them
        q = self.wq(x).view(b, n, -1, self.hd)
        k = self.wk(x).view(b, n, -1, self.hd)
        v = self.wv(x).view(b, n, -1, self.hd)
        q, k = rotate(q, table), rotate(k, table)
        rep = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.ffn_dim, bias=False)
        self.w2 = nn.Linear(s.ffn_dim, s.dim, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.attention = Attention(s)
        self.feed_forward = FeedForward(s)
        self.attention_norm = RMSNorm(s.dim, s.norm_eps)
        self.ffn_norm = RMSNorm(s.dim, s.norm_eps)

    def forward(self, x, table):
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """torchtitan's Llama3 names: ``layers`` a ModuleDict keyed "0", "1", ..."""

    def __init__(self, s: Shape):
        super().__init__()
        self.tok_embeddings = nn.Embedding(s.vocab_size, s.dim)
        self.layers = nn.ModuleDict({str(i): Block(s) for i in range(s.n_layers)})
        self.norm = RMSNorm(s.dim, s.norm_eps)
        self.output = nn.Linear(s.dim, s.vocab_size, bias=False)
        self.register_buffer("table", rope_table(s.dim // s.n_heads, s.seq_len, s.rope_theta),
                             persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.table)
        return self.output(self.norm(h)).float()


def shape(**over) -> Shape:
    return Shape(**{**SHAPE, **over})


def build(s: Shape, seed: int, tp: int = 1) -> Llama:
    """The model, drawn from ``seed`` whole on every rank, then each block and the root
    sharded with FSDP2 over the world (gloo, CPU). ``tp`` > 1: a 2-D mesh (dp, tp), rank
    ``dp_rank * tp + tp_rank``; the model is first split over ``tp`` as torchtitan's
    Llama3 plan splits it (:func:`tensor_parallel`), then FSDP2 shards over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = Llama(s)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02 if "output" not in name else s.dim ** -0.5)
    world = dist.get_world_size()
    if tp == 1:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh2 = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh2["tp"])
        mesh = mesh2["dp"]
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tensor_parallel(model: Llama, mesh) -> None:
    """torchtitan's TP plan for Llama3 without sequence parallelism or loss parallelism:
    the embedding split over the vocabulary (rows), q/k/v, w1 and w3 over their outputs
    (column-parallel), wo and w2 over their inputs (row-parallel), the output layer over
    the vocabulary with its logits gathered; the norms stay whole on every TP rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Replicate()),
        "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    })
    for layer in model.layers.values():
        parallelize_module(layer, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})


def make_optimizer(model: nn.Module):
    """torch AdamW (fp32, foreach=False) built from named parameters, as torchtitan builds
    it; weight decay on the matrices only (Megatron's rule, which hybrid follows); a
    constant LambdaLR."""
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if p.ndim >= 2]
    rest = [(n, p) for n, p in named if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups,
                            lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                            weight_decay=OPTIM["weight_decay"], foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return opt, sched


def batch(seed: int, step: int, s: Shape, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of training step ``step`` (1-based): ``global_batch`` sequences drawn
    from ``seed`` and the step; a DP rank takes its ``global_batch / dp`` consecutive rows."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randint(0, s.vocab_size, (global_batch, s.seq_len + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def train_step(model, opt, sched, tokens, labels) -> float:
    """One step on this rank's rows; the global mean loss (mean over ranks of equal rows)."""
    from torch.distributed.tensor import DTensor
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if len(meshes) > 1:
        # FSDP2 x TP: the norms' gradients live on the 1-D dp mesh and the rest on the 2-D
        # one, which torch's clip functions cannot mix; the same arithmetic per mesh
        norm = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.full_tensor()) for g in grads]))
        coef = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    else:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):  # FSDP2: the shards' norms combined over the mesh
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), CLIP, norm)
    opt.step()
    sched.step()
    opt.zero_grad()
    out = loss.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.AVG)
    return float(out)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=True)


def state(model, opt, sched, step: int, seed: int, ntokens: int) -> dict:
    """What torchtitan's CheckpointManager hands ``dcp.save``: the model's FQNs at the top
    level, then ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    sd: dict[str, Any] = dict(get_model_state_dict(model))
    sd["optimizer"] = get_optimizer_state_dict(model, opt, options=_options())
    sd["lr_scheduler"] = sched.state_dict()
    loader = {"seed": seed, "next_step": step + 1, "rank": rank}
    sd["dataloader"] = {f"dp_rank_{rank}": pickle.dumps(loader), "world_size": world}
    sd["train_state"] = {"step": step, "ntokens_seen": ntokens}
    return sd


def save(folder: str, model, opt, sched, step: int, seed: int, ntokens: int) -> str:
    """``dcp.save`` into ``folder/step-<step>``; the directory."""
    import os

    import torch.distributed.checkpoint as dcp
    path = os.path.join(folder, f"step-{step}")
    dcp.save(state(model, opt, sched, step, seed, ntokens), checkpoint_id=path)
    return path


def load(path: str, model, opt, sched) -> int:
    """A DCP checkpoint of :func:`state`'s structure into ``model``, ``opt`` and ``sched``
    as torchtitan loads one (``dcp.load``, then the model's and the optimizer's set_*
    functions); the training step it was saved at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    sd: dict[str, Any] = dict(get_model_state_dict(model))
    # the optimizer's state must exist to be loaded into (torchtitan's init_optim_state)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()  # lr 0: AdamW's decoupled decay is lr * weight_decay, the weights stay
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    opt.zero_grad()
    sd["optimizer"] = get_optimizer_state_dict(model, opt, options=_options())
    sd["lr_scheduler"] = sched.state_dict()
    sd["train_state"] = {"step": 0, "ntokens_seen": 0}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, {k: v for k, v in sd.items()
                                 if k not in ("optimizer", "lr_scheduler", "train_state")})
    set_optimizer_state_dict(model, opt, sd["optimizer"], options=_options())
    sched.load_state_dict(sd["lr_scheduler"])
    return int(sd["train_state"]["step"])


def describe(s: Shape) -> dict:
    return asdict(s)


def hybrid_flags(s: Shape) -> dict:
    """hybrid's flags (Flags fields) for the same model and optimizer."""
    return dict(num_layers=s.n_layers, hidden_size=s.dim, num_attention_heads=s.n_heads,
                group_query_attention=True, num_query_groups=s.n_kv_heads,
                ffn_hidden_size=s.ffn_dim, seq_length=s.seq_len,
                max_position_embeddings=s.seq_len, normalization="RMSNorm",
                norm_epsilon=s.norm_eps, swiglu=True, position_embedding_type="rope",
                rotary_base=s.rope_theta, untie_embeddings_and_output_weights=True,
                disable_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0,
                lr=OPTIM["lr"], lr_decay_style="constant", lr_warmup_iters=0,
                adam_beta1=OPTIM["betas"][0], adam_beta2=OPTIM["betas"][1],
                adam_eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"], clip_grad=CLIP)

