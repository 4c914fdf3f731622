"""Megatron-DeepSpeed's GPT (``GPTModelPipe``) pipeline checkpoints, read in hybrid's GPT
names for ``pretrain_gpt.py --load``: :class:`GPTPipeCheckpoint`.

[Note: GPTModelPipe's layers]
A DeepSpeed pipeline save names each layer file's entries by the module that wrote it
(:mod:`.deepspeed_pipe`); for Megatron-DeepSpeed's ``GPTModelPipe`` (its
``megatron/model/gpt_model.py``, as read from its source: hybrid runs none of it) the
layer list is fixed, so the files say which is which:

* layer 0: the input cast (``_to_float16``), a function: no file;
* layer 1: ``EmbeddingPipe`` as ``TiedLayerSpec("embed")`` (tied attribute
  ``word_embeddings_weight``): ``word_embeddings.weight``, ``position_embeddings.weight``
  -> ``wte.weight``, ``wpe.weight``;
* layers 2 .. L+1: ``ParallelTransformerLayerPipe``, Megatron-LM's older per-layer names
  (``input_layernorm``, ``self_attention.query_key_value`` with its rows per head,
  ``self_attention.dense``, ``post_attention_layernorm``, ``mlp.dense_h_to_4h``,
  ``mlp.dense_4h_to_h``) -> ``blocks.N.*`` through :mod:`.megatron_names`' one table
  (the layouts are hybrid's: nothing permuted);
* layer L+2: the final ``LayerNorm`` (``weight``, ``bias``) -> ``ln_f.*``;
* layer L+3: the head, the tied embedding through ``forward_fn``: no file (and, in fp16
  and bf16 runs, the output cast after it: none either).

The head's stage holds a whole copy of the tied embedding module, position embeddings
included, which its forward never uses: that copy's position embeddings are left out,
stage 0's read (``first_copy``). The files are read, with their optimizer state (ZeRO 0
or 1, fp32 or bf16's BF16_Optimizer), by :class:`.deepspeed_pipe.DeepSpeedPipeline` in
the module's names, then renamed here. The model flags the shapes fix (layers, hidden
size, positions, FFN width) are checked against the run's; the head count is not
recorded (and does not change the per-head QKV rows). Megatron-DeepSpeed's client state
(its args, RNG states) is not read: hybrid's schedule, seeds and data come from the run's
flags (a line each). Refused by name: a layer file missing, a name with no place in
hybrid's GPT (untied head, RMSNorm and other GPTModelPipe options not read), SwiGLU.
"""

from __future__ import annotations

import os

import torch

from hybrid.checkpoint.peers import deepspeed_pipe as pipe, megatron_names as names
from hybrid.checkpoint.peers.deepspeed_files import FORMAT, load_file
from hybrid.errors import CheckpointError

EMBED = "tied_modules.embed"
WORD = "word_embeddings.weight"
TIED = (WORD,)
FIRST_COPY = frozenset({f"{EMBED}.position_embeddings.weight"})
LAYER_KEY = "input_layernorm.weight"  # (every ParallelTransformerLayerPipe's file has it)


def _layer_files(tag_dir: str) -> dict[int, str]:
    out = {}
    for name in sorted(os.listdir(tag_dir)):
        m = pipe.LAYER_FILE.match(name)
        if m and m.group(2) is None:
            out[int(m.group(1))] = os.path.join(tag_dir, name)
    return out


def _file_name(tag_dir: str, idx: int) -> str:
    return os.path.join(tag_dir, f"layer_{idx:02d}-model_states.pt")


def is_gpt_pipe(tag_dir: str) -> bool:
    """Whether a DeepSpeed tag directory holds GPTModelPipe's layer files: its first or
    second layer file is the embedding's or a transformer layer's (two small reads)."""
    files = _layer_files(tag_dir)
    return any(WORD in (keys := load_file(files[i])) or LAYER_KEY in keys
               for i in sorted(files)[:2])


def gpt_pipe_layers(tag_dir: str) -> tuple[list[pipe.Layer], int, int]:
    """GPTModelPipe's layer list as its files show it (the Note), and the indices of its
    first transformer layer and of its final norm; one CheckpointError naming a layer
    file that is missing."""
    files = _layer_files(tag_dir)
    keys = {i: set(load_file(p)) for i, p in files.items()}
    embed = [i for i, k in keys.items() if WORD in k]
    if not embed:
        raise CheckpointError(f"{_file_name(tag_dir, 1)}: missing: GPTModelPipe's "
                              f"embedding (layer 1, {WORD}) of the {FORMAT} pipeline "
                              f"checkpoint (an incomplete save)")
    first, last = embed[0] + 1, max(keys)
    if LAYER_KEY in keys[last]:
        raise CheckpointError(f"{_file_name(tag_dir, last + 1)}: missing: GPTModelPipe's "
                              f"final norm (layer {last + 1}, after transformer layer "
                              f"{last}) of the {FORMAT} pipeline checkpoint (an incomplete "
                              f"save)")
    layers = [pipe.Layer(None, False)] * embed[0] + [pipe.Layer(EMBED, True, TIED)]
    layers += [pipe.Layer(str(i), True) for i in range(first, last + 1)]
    layers.append(pipe.Layer(EMBED, False, TIED))  # the head, through forward_fn
    return layers, first, last


class GPTPipeCheckpoint:
    """One tag of a Megatron-DeepSpeed GPTModelPipe checkpoint (the Note) as a
    :class:`~hybrid.checkpoint.peers.base.PeerCheckpoint` in hybrid's GPT names."""

    def __init__(self, tag_dir: str):
        layers, first, final = gpt_pipe_layers(tag_dir)
        self._pipe = pipe.DeepSpeedPipeline(tag_dir, layers, FIRST_COPY)
        self.path = tag_dir
        self.format = self._pipe.format.replace("pipeline", "pipeline (GPTModelPipe)", 1)
        self.iteration = self._pipe.iteration
        self.consumed_samples = self._pipe.consumed_samples
        self.frozen_shapes: dict[str, list[int]] = {}
        self.excludes_frozen = False
        self.vocab_size: int | None = None  # (the embedding's rows: below)
        self._ds: dict[str, str] = {}  # hybrid name -> the module's
        for ds_name in self._pipe.shapes:
            self._ds[self._hybrid(ds_name, first, final)] = ds_name
        self.shapes = {h: list(self._pipe.shapes[d]) for h, d in self._ds.items()}
        self.columns: tuple[str, ...] = self._pipe.columns  # (stage 0's optimizer file read)
        self.step: int = self._pipe.step
        self.notes = [*self._pipe.notes,
                      f"learning-rate schedule: hybrid's, from the run's flags at iteration "
                      f"{self.iteration}; DeepSpeed's lr_scheduler state and "
                      f"Megatron-DeepSpeed's client state (its args, RNG) are not read"]
        # Megatron-DeepSpeed records its vocabulary only in its args (unread): the
        # embedding's rows are taken for it (a save padded past it loads where hybrid
        # pads to as many rows)
        self.vocab_size = self.shapes["wte.weight"][0]
        fc = self.shapes.get("blocks.0.mlp.fc.weight")
        self.flags = {"num_layers": final - first, "hidden_size": self.shapes["wte.weight"][1]}
        if "wpe.weight" in self.shapes:
            self.flags["max_position_embeddings"] = self.shapes["wpe.weight"][0]
        if fc is not None:
            self.flags["ffn_hidden_size"] = fc[0]

    def _hybrid(self, ds_name: str, first: int, final: int) -> str:
        idx, _, rest = ds_name.partition(".")
        if idx == "tied_modules":
            part = names.global_part("embedding." + rest.removeprefix("embed."))
        elif idx.isdigit() and int(idx) == final:
            part = names.global_part("decoder.final_layernorm." + rest)
        elif idx.isdigit() and first <= int(idx) < final:
            part = names.layer_part(rest)
            part = part and f"blocks.{int(idx) - first}.{part}"
        else:
            part = None
        if part is None:
            where = (_file_name(self.path, int(idx)) if idx.isdigit()
                     else _file_name(self.path, first - 1))
            raise CheckpointError(f"{where}: {ds_name} has no place in hybrid's GPT (a "
                                  f"GPTModelPipe option hybrid does not read: an untied "
                                  f"head, RMSNorm, ...)")
        return part

    def configure(self, config: dict) -> None:
        if config.get("swiglu"):
            raise CheckpointError(f"{self.path}: a GPTModelPipe checkpoint loaded with "
                                  f"--swiglu: hybrid reads Megatron-DeepSpeed's GELU GPT "
                                  f"(its SwiGLU layout is not checked)")

    def read(self, name: str) -> dict[str, torch.Tensor]:
        return self._pipe.read(self._ds[name])

    def untrained(self) -> dict[str, torch.Tensor]:
        return {}

    def close(self) -> None:
        self._pipe.close()


def open_if_gpt_pipe(path: str, step: int | None = None) -> GPTPipeCheckpoint | None:
    """The GPTModelPipe checkpoint under the DeepSpeed save directory (or tag) ``path``;
    None when it holds no GPTModelPipe layer files (other DeepSpeed saves)."""
    tag_dir = pipe.tag_dir_of(path, step)
    if tag_dir is None or not pipe.is_pipeline(tag_dir) or not is_gpt_pipe(tag_dir):
        return None
    return GPTPipeCheckpoint(tag_dir)


__all__ = ["GPTPipeCheckpoint", "gpt_pipe_layers", "is_gpt_pipe", "open_if_gpt_pipe"]
