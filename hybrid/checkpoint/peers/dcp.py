"""torch DCP checkpoints as torchtitan writes them: read one in, write one back.

A torchtitan run saves ``<dump>/checkpoint/step-N/`` with ``torch.distributed.checkpoint``
(DCP): ``.metadata`` (every entry's global shape and where its chunks lie) and one
``__<rank>_<i>.distcp`` file per writer. The state is the one torchtitan's
CheckpointManager hands ``dcp.save``:

* the model's state dict at the top level: ``tok_embeddings.weight``,
  ``layers.N.attention.wq|wk|wv|wo.weight`` (``attention.qkv_linear.wq|wk|wv`` in newer
  torchtitan, whose fused projection splits itself on save), ``layers.N.feed_forward.
  w1|w2|w3.weight``, ``layers.N.attention_norm.weight``, ``layers.N.ffn_norm.weight``,
  ``norm.weight``, ``output.weight`` (``lm_head.weight`` in newer torchtitan; absent when
  the embedding is tied);
* ``optimizer``: the optimizer's flat, FQN-keyed state dict, saved as
  ``optimizer.state.<fqn>.exp_avg|exp_avg_sq|step`` and
  ``optimizer.param_groups.<fqn>.lr|betas|eps|weight_decay|...``;
* ``lr_scheduler``, ``dataloader`` (one entry per DP rank), ``train_state``
  (``step``, ``ntokens_seen``).

Every DTensor (FSDP2's ``Shard(0)``, TP's) is saved as chunks of its global tensor, so
the reader sees full shapes whatever the layout the run had.

Mapping (one table, :data:`LAYER` and :data:`TOP`, torchtitan's Llama3 names to
hybrid's Llama-shaped GPT): ``wq``, ``wk``, ``wv`` go into hybrid's fused per-group
``attn.qkv`` with :func:`hybrid.hf.llama._qkv_from_hf`; ``w1`` (gate) and ``w3`` (up)
are ``mlp.fc`` ``(2, F, C)``; ``w2`` is ``mlp.proj``. torchtitan rotates adjacent
channel pairs of a head (complex numbers), hybrid rotates halves (as Hugging Face
does), so the Q and K rows of each head are permuted as Hugging Face's conversion of
Meta's Llama permutes them (:func:`interleaved_to_halves`). Adam's moments are
elementwise, so they take the same permutation as the weights.

What a DCP checkpoint does not record: the number of heads and query groups (needed
for that permutation), the norm's epsilon, RoPE's base. They come from the run's flags
(:meth:`DCPCheckpoint.configure`, which the import calls); a head count that does not
fit the saved shapes is an error naming ``.metadata``.

Reading holds one parameter's tensors at a time: each is ``dcp.load``-ed alone, in one
process (no process group), into a full fp32 tensor; byte entries (the step, the
hyperparameters) are unpickled with ``weights_only`` loading.
"""

from __future__ import annotations

import glob
import io
import os
import re
import warnings
from collections.abc import Callable, Iterable

import torch

from hybrid.errors import CheckpointError
from hybrid.hf.llama import _qkv_from_hf

FORMAT = "torch DCP (torchtitan)"
METADATA = ".metadata"
OPTIM = "optimizer."
MOMENTS = ("exp_avg", "exp_avg_sq")

# hybrid name -> the torchtitan names it is made of (per layer: "{}" is "layers.N.")
LAYER = {
    "ln_1.weight": ("attention_norm.weight",),
    "attn.qkv.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "attn.proj.weight": ("attention.wo.weight",),
    "ln_2.weight": ("ffn_norm.weight",),
    "mlp.fc.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
    "mlp.proj.weight": ("feed_forward.w2.weight",),
}
TOP = {"wte.weight": ("tok_embeddings.weight",), "ln_f.weight": ("norm.weight",),
       "output_layer.weight": ("output.weight",)}
# newer torchtitan's names for the same tensors (its fused QKV module saves q, k, v
# under qkv_linear; its output layer is lm_head)
ALIASES = {"attention.wq.weight": "attention.qkv_linear.wq.weight",
           "attention.wk.weight": "attention.qkv_linear.wk.weight",
           "attention.wv.weight": "attention.qkv_linear.wv.weight",
           "output.weight": "lm_head.weight"}


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``heads`` heads, each ``[x0, y0, x1, y1, ...]`` (torchtitan's complex pairs)
    -> ``[x0, x1, ..., y0, y1, ...]`` (rotate-half): Hugging Face's Llama permutation."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_halves`."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# --- finding a checkpoint -------------------------------------------------------------

def _steps(path: str) -> list[tuple[int, str]]:
    """(step, directory) of the ``step-N`` checkpoints under ``path`` (torchtitan's
    checkpoint folder, or the dump folder holding ``checkpoint/``), those with a
    ``.metadata`` (torchtitan's rule for a complete one)."""
    found = []
    for pattern in ("step-*", os.path.join("checkpoint", "step-*")):
        for d in glob.glob(os.path.join(glob.escape(path), pattern, METADATA)):
            m = re.fullmatch(r"step-(\d+)", os.path.basename(os.path.dirname(d)))
            if m:
                found.append((int(m.group(1)), os.path.dirname(d)))
    return sorted(found)


def detect(path: str) -> bool:
    """Whether ``path`` is a DCP checkpoint (``.metadata``) or a folder of torchtitan's
    ``step-N`` ones: a few stat calls and globs, no file read. A Megatron-LM
    ``torch_dist`` iteration (DCP too, with ``common.pt`` beside) is Megatron's."""
    if os.path.isfile(os.path.join(path, "common.pt")):
        return False
    return os.path.isfile(os.path.join(path, METADATA)) or bool(_steps(path))


def open(path: str, step: int | None = None) -> DCPCheckpoint:  # noqa: A001 (the contract's name)
    """The DCP checkpoint ``path`` (a directory with ``.metadata``), or the newest
    ``step-N`` (or ``step-<step>``) under it, opened for reading."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return DCPCheckpoint(path)
    steps = _steps(path)
    if not steps:
        raise CheckpointError(f"{path}: no DCP checkpoint (no {METADATA}, no step-N/{METADATA})")
    if step is None:
        return DCPCheckpoint(steps[-1][1])
    for s, d in steps:
        if s == step:
            return DCPCheckpoint(d)
    raise CheckpointError(f"{path}: no step-{step} with a {METADATA} (it has "
                          f"{', '.join(f'step-{s}' for s, _ in steps)})")


# --- reading -------------------------------------------------------------------------

def _reader(path: str, metadata):
    """A FileSystemReader of ``path`` that hands out ``metadata`` instead of re-reading
    ``.metadata`` for every entry loaded."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata

    return Reader(path)


def _planner():
    """DCP's default load planner, with byte entries unpickled by ``weights_only``
    loading (plain Python values: the step, the hyperparameters), never arbitrary code."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            value.seek(0)
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


class DCPCheckpoint:
    """One torchtitan DCP checkpoint (see the module docstring), in hybrid's names and
    full layout: :class:`hybrid.checkpoint.peers.base.PeerCheckpoint`."""

    format = FORMAT
    frozen_shapes: dict[str, list[int]] = {}  # (a GPT: every parameter trains)
    excludes_frozen = False

    def __init__(self, path: str):
        self.path = path
        self.meta_path = os.path.join(path, METADATA)
        try:
            from torch.distributed.checkpoint import FileSystemReader
            self.metadata = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001 (an unreadable file is one message whatever broke)
            raise CheckpointError(f"{self.meta_path}: not a readable DCP metadata file "
                                  f"({type(e).__name__}: {e})") from None
        self.entries = self.metadata.state_dict_metadata
        self._check_files()
        self.heads: int | None = None
        self.groups: int | None = None
        self.notes: list[str] = []
        self._map_model()
        self._map_state()

    # -- structure --

    def _check_files(self) -> None:
        """Every data file the metadata names is there, at least as long as the bytes it
        places in it (a truncated or missing ``.distcp`` is named before any read)."""
        need: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0),
                                           info.offset + info.length)
        for rel, end in sorted(need.items()):
            f = os.path.join(self.path, rel)
            try:
                size = os.path.getsize(f)
            except OSError:
                raise CheckpointError(f"{f}: missing; {self.meta_path} places {end} bytes "
                                      f"in it (a checkpoint copied in part, or written by "
                                      f"another world)") from None
            if size < end:
                raise CheckpointError(f"{f}: truncated ({size} bytes; {self.meta_path} "
                                      f"places data up to byte {end})")

    def _name(self, name: str) -> str:
        """The name ``name`` (torchtitan's original) has in this checkpoint."""
        if name in self.entries:
            return name
        for old, new in ALIASES.items():
            if name.endswith(old):
                alias = name[: -len(old)] + new
                if alias in self.entries:
                    return alias
        return name

    def _shape(self, name: str) -> list[int]:
        entry = self.entries.get(self._name(name))
        if entry is None or not hasattr(entry, "size"):
            raise CheckpointError(f"{self.meta_path}: no tensor {name!r}: not a torchtitan "
                                  f"Llama checkpoint hybrid maps (its model entries: "
                                  f"{', '.join(sorted(self._model_keys())[:6])}, ...)")
        return list(entry.size)

    def _model_keys(self) -> list[str]:
        return [k for k in self.entries if "." in k and k.split(".", 1)[0] not in
                ("optimizer", "lr_scheduler", "dataloader", "train_state")]

    def _map_model(self) -> None:
        layers = {int(m.group(1)) for k in self._model_keys()
                  if (m := re.match(r"layers\.(\d+)\.", k))}
        if not layers:
            raise CheckpointError(f"{self.meta_path}: no layers.N entries: not a torchtitan "
                                  f"Llama checkpoint")
        n = max(layers) + 1
        if sorted(layers) != list(range(n)):
            raise CheckpointError(f"{self.meta_path}: layers {sorted(layers)} are not "
                                  f"0..{n - 1} (a pipeline stage's part?)")
        self.sources: dict[str, tuple[str, ...]] = {}
        top = dict(TOP)
        # tied (torchtitan's enable_weight_tying): no output entry, or one without
        # optimizer state of its own while the embedding has some (the optimizer is built
        # from named_parameters, which lists a shared parameter once)
        out_name = self._name("output.weight")
        self.tied = out_name not in self.entries or (
            self._moment_key(out_name, "exp_avg") is None
            and self._moment_key("tok_embeddings.weight", "exp_avg") is not None)
        if self.tied:
            del top["output_layer.weight"]
        self.sources.update(top)
        for i in range(n):
            for h, t in LAYER.items():
                self.sources[f"blocks.{i}.{h}"] = tuple(f"layers.{i}.{x}" for x in t)
        vocab, hidden = self._shape("tok_embeddings.weight")
        ffn = self._shape("layers.0.feed_forward.w1.weight")[0]
        shapes: dict[str, list[int]] = {}
        for h, src in self.sources.items():
            parts = [self._shape(s) for s in src]
            if h.endswith("attn.qkv.weight"):
                shapes[h] = [sum(p[0] for p in parts), hidden]
            elif h.endswith("mlp.fc.weight"):
                if parts[0] != parts[1]:
                    raise CheckpointError(f"{self.meta_path}: {src[0]} {parts[0]} and {src[1]} "
                                          f"{parts[1]} differ")
                shapes[h] = [2, *parts[0]]
            else:
                shapes[h] = parts[0]
        self.shapes = shapes
        self.q_rows = shapes["blocks.0.attn.proj.weight"][1]
        self.k_rows = self._shape("layers.0.attention.wk.weight")[0]
        self.vocab_size = vocab
        self.flags = {"num_layers": n, "hidden_size": hidden, "ffn_hidden_size": ffn,
                      "swiglu": True, "normalization": "RMSNorm",
                      "position_embedding_type": "rope", "disable_bias_linear": True,
                      "untie_embeddings_and_output_weights": not self.tied}

    def _moment_key(self, name: str, col: str) -> str | None:
        """The entry of moment ``col`` of torchtitan parameter ``name``: its own, or for
        ``wq``/``wk``/``wv`` newer torchtitan's fused ``qkv_linear.wqkv`` (whose optimizer
        state is the fused parameter's); None when there is none."""
        own = f"{OPTIM}state.{self._name(name)}.{col}"
        if own in self.entries:
            return own
        m = re.fullmatch(r"(layers\.\d+\.attention\.)w[qkv]\.weight", name)
        fused = m and f"{OPTIM}state.{m.group(1)}qkv_linear.wqkv.weight.{col}"
        return fused if fused and fused in self.entries else None

    def _map_state(self) -> None:
        def have(n: str, what: str) -> bool:
            return self._moment_key(n, what) is not None
        every = [s for src in self.sources.values() for s in src]
        if all(have(s, m) for s in every for m in MOMENTS):
            self.columns: tuple[str, ...] = ("master", *MOMENTS)
            first = (self._moment_key(every[0], "exp_avg") or "").removesuffix("exp_avg")
            self.step = int(float(self._value(first + "step"))) \
                if first + "step" in self.entries else 0
        elif any(have(s, m) for s in every for m in MOMENTS):
            missing = next(f"{OPTIM}state.{self._name(s)}.{m}" for s in every
                           for m in MOMENTS if not have(s, m))
            raise CheckpointError(f"{self.meta_path}: Adam's state for some parameters but "
                                  f"not {missing!r} (not AdamW, or a partial checkpoint)")
        else:
            self.columns, self.step = ("master",), 0
            other = sorted({k.rsplit(".", 1)[1] for k in self.entries
                            if k.startswith(f"{OPTIM}state.")})
            self.notes.append(f"optimizer state of another optimizer ({', '.join(other)}), "
                              f"not Adam's: Adam's moments start at zero" if other else
                              "no optimizer state (a model-only save): Adam's moments start "
                              "at zero")
        self.iteration = int(self._value("train_state.step")) \
            if "train_state.step" in self.entries else 0
        if "train_state.step" not in self.entries:
            self.notes.append("no train_state: iteration 0")
        # hybrid's data position is its own pipeline's; torchtitan's loader state is not it
        self.consumed_samples = 0
        self.notes.append("data position: torchtitan's dataloader state belongs to its own "
                          "data pipeline; hybrid's data starts from its first sample")
        self.notes.append("learning-rate schedule: torchtitan's lr_scheduler (a LambdaLR) is "
                          "not carried; hybrid's follows its own flags at this iteration")
        self.notes.append("RNG: torchtitan saves none; hybrid's streams come from --seed")

    def _value(self, key: str):
        """A byte entry's Python value (or a 0-d tensor's)."""
        entry = self.entries[key]
        sd: dict = {key: torch.empty(list(entry.size), dtype=torch.float32)
                    if hasattr(entry, "size") else io.BytesIO()}
        self._load(sd, [key])
        v = sd[key]
        return v.item() if isinstance(v, torch.Tensor) else v

    def _load(self, sd: dict, keys: Iterable[str]) -> None:
        import torch.distributed.checkpoint as dcp
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, storage_reader=_reader(self.path, self.metadata),
                         planner=_planner(), no_dist=True)
        except Exception as e:  # noqa: BLE001 (whatever broke, one message naming the file)
            files = sorted({info.relative_path for idx, info in
                            self.metadata.storage_data.items() if idx.fqn in set(keys)})
            where = ", ".join(os.path.join(self.path, f) for f in files) or self.path
            raise CheckpointError(f"{where}: cannot read {', '.join(keys)} "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                                  ) from None

    def _shape_of(self, key: str) -> list[int]:
        size = getattr(self.entries[key], "size", None)
        if size is None:
            raise CheckpointError(f"{self.meta_path}: {key!r} is not a tensor")
        return list(size)

    def _tensor(self, key: str) -> torch.Tensor:
        """The full fp32 tensor ``key`` (one DCP entry, its chunks assembled)."""
        t = torch.empty(self._shape_of(key), dtype=torch.float32)
        self._load({key: t}, [key])
        return t

    # -- the contract --

    def untrained(self) -> dict[str, torch.Tensor]:
        return {}  # (a GPT: no frozen parameter, no persistent buffer)

    def configure(self, config: dict) -> None:
        """Take what the checkpoint does not record from the run's flat flags ``config``:
        the heads and query groups (RoPE's permutation needs the head size).
        CheckpointError naming ``.metadata`` when they do not fit its shapes."""
        heads = config.get("num_attention_heads")
        if not heads:
            return
        groups = (config.get("num_query_groups") if config.get("group_query_attention")
                  else None) or heads
        hd = config.get("kv_channels") or config.get("hidden_size", 0) // heads
        if heads * hd != self.q_rows or groups * hd != self.k_rows or hd % 2:
            raise CheckpointError(
                f"{self.meta_path}: wq has {self.q_rows} rows and wk {self.k_rows}, which "
                f"{heads} heads and {groups} query groups of size {hd} do not make: the "
                f"run's --num-attention-heads / --num-query-groups are not the checkpoint's")
        self.heads, self.groups = heads, groups
        self._compare_hyperparameters(config)

    def _compare_hyperparameters(self, config: dict) -> None:
        """One note per AdamW hyperparameter of the checkpoint's param groups that the
        run's flags do not repeat (they are the run's to give: hybrid's optimizer
        follows its flags), and for weight decay on vectors (hybrid decays matrices
        only)."""
        def group(fqn: str, key: str):
            k = f"{OPTIM}param_groups.{self._name(fqn)}.{key}"
            return self._value(k) if k in self.entries else None
        matrix, vector = "tok_embeddings.weight", "norm.weight"
        betas = group(matrix, "betas")
        pairs = [("adam_beta1", betas[0] if betas else None),
                 ("adam_beta2", betas[1] if betas else None),
                 ("adam_eps", group(matrix, "eps")),
                 ("weight_decay", group(matrix, "weight_decay"))]
        for flag, saved in pairs:
            if saved is not None and flag in config and float(saved) != float(config[flag]):
                self.notes.append(f"--{flag.replace('_', '-')}: the checkpoint's optimizer "
                                  f"has {float(saved):g}, this run {float(config[flag]):g}")
        decay = group(vector, "weight_decay")
        if decay:
            self.notes.append(f"weight decay: the checkpoint's optimizer decays {vector} by "
                              f"{float(decay):g} (torchtitan's default decays every "
                              f"parameter); hybrid decays matrices only")
        lr = group(matrix, "lr")
        if lr is not None and config.get("lr") is not None:
            ours = _next_lr(config, self.iteration, self.consumed_samples)
            if abs(float(lr) - ours) > 1e-9 * max(abs(ours), 1e-12):
                self.notes.append(f"learning rate: the checkpoint's optimizer holds "
                                  f"{float(lr):g} for step {self.iteration + 1}; hybrid's "
                                  f"schedule gives {ours:g} for it")

    def read(self, name: str) -> dict[str, torch.Tensor]:
        """``{column: full fp32 tensor}`` of hybrid parameter ``name``."""
        if name not in self.sources:
            raise CheckpointError(f"{self.meta_path}: no source for hybrid's {name!r}")
        src = self.sources[name]
        out = {}
        for col in self.columns:
            def get(n: str, col: str = col) -> torch.Tensor:
                if col == "master":
                    return self._tensor(self._name(n))
                key = self._moment_key(n, col)
                assert key is not None  # (every parameter's moments, checked at open)
                return self._tensor(key)
            out[col] = self._combine(name, src, get)
        return out

    def _qkv(self, src: tuple[str, ...], get: Callable[[str], torch.Tensor]):
        """(q, k, v) rows of one layer, torchtitan's order: three entries, or (a moment
        of newer torchtitan's fused projection, which ``get`` of ``wq`` returns) one
        ``(groups, heads / groups + 2, head size, C)`` tensor, cut as that projection
        cuts itself on save."""
        first = get(src[0])
        if first.shape[0] == self.q_rows:
            return first, get(src[1]), get(src[2])
        assert self.groups is not None  # (checked by the caller)
        r, rest = self.q_rows // self.k_rows, first.shape[1:]
        x = first.reshape(self.groups, r + 2, -1, *rest)
        return (x[:, :r].reshape(-1, *rest), x[:, r].reshape(-1, *rest),
                x[:, r + 1].reshape(-1, *rest))

    def _combine(self, name: str, src: tuple[str, ...],
                 get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        if name.endswith("attn.qkv.weight"):
            if self.heads is None or self.groups is None:
                raise CheckpointError(
                    f"{self.meta_path}: a DCP checkpoint does not record the number of "
                    f"attention heads, which RoPE's row order needs: give "
                    f"--num-attention-heads (and --num-query-groups)")
            q, k, v = self._qkv(src, get)
            q = interleaved_to_halves(q, self.heads)
            k = interleaved_to_halves(k, self.groups)
            return _qkv_from_hf(q, k, v, self.groups)
        if name.endswith("mlp.fc.weight"):
            return torch.stack([get(src[0]), get(src[1])])
        return get(src[0])

    def close(self) -> None:
        pass


# --- writing -------------------------------------------------------------------------


def _next_lr(c: dict, iteration: int, consumed_samples: int) -> float:
    """hybrid's learning rate for the step after ``iteration`` (what a torch optimizer's
    param groups hold between the two: its scheduler stepped after the optimizer) under
    the checked flat flags ``c`` (a run's, or a checkpoint's saved config)."""
    from types import SimpleNamespace

    from hybrid.config.build import _section
    from hybrid.config.lr_schedule import scheduled_lr
    from hybrid.config.sections import LRScheduleConfig
    try:
        f = SimpleNamespace(**c)
        sched = _section(f, "lr_schedule", **LRScheduleConfig.derived(f))  # type: ignore[arg-type]
        return float(scheduled_lr(sched, iteration + 1, consumed_samples))
    except (AttributeError, AssertionError, TypeError):  # a config from before a flag
        return float(c.get("lr") or 0.0)
