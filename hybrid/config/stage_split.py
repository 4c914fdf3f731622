"""Which transformer layers each pipeline stage holds, as Megatron's flags say; torch-free.

A model of L layers on PP pipeline ranks, each holding V model chunks (virtual stages,
V = 1 without interleaving), is cut into PP x V consecutive pieces. Piece ``i`` of the
model, in layer order, is chunk ``v = i // PP`` of pipeline rank ``p = i % PP``: chunk 0
of every rank first, then chunk 1 of every rank, and so on (Megatron's order, which the
interleaved schedule walks)::

    8 layers, PP 2, V 2:   rank 0: [0, 1] [4, 5]      rank 1: [2, 3] [6, 7]

The embedding is always on piece 0 (chunk 0 of rank 0), the loss (final norm, output
layer, cross-entropy) on the last piece (chunk V-1 of rank PP-1): those two ranks form the
embedding group of a tied word embedding (:class:`hybrid.parallel.state.ParallelState`).

How many layers each piece gets, one of four ways (:func:`split_layers`):

* **even** (the default): L / PP layers per rank, L / (PP V) per chunk.
  ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
  count the embedding / the loss as one more layer: L + 1 (or + 2) is split evenly, and the
  first / last piece gets one transformer layer fewer (it may be left with none).
* **uneven first/last**: ``--decoder-first-pipeline-num-layers`` and/or
  ``--decoder-last-pipeline-num-layers`` fix the first / last rank's layers; the rest are
  split evenly over the ranks between (each must get some). With V chunks each of those
  counts is cut in V equal parts.
* **virtual size from layers**: ``--num-layers-per-virtual-pipeline-stage N`` gives
  V = (layers per rank) / N for an even split.
* **layout**: ``--pipeline-model-parallel-layout`` names every piece: ``E`` the
  embedding, ``t`` a transformer layer, ``L`` the loss, ``|`` between pieces, ``(..)*n``
  and ``x*n`` repeat, commas are cosmetic: ``"Ett|(tt|)*2,tL"`` is PP x V = 4 pieces
  with 2, 2, 2 and 1 layers (``E`` and ``L`` beside them). The number of pieces is PP x V.
  Pieces may be empty; ``E`` opens piece 0 and ``L`` closes the last.

Megatron's rules, each an error naming the flags (:class:`hybrid.errors.ConfigError`):
an even split must divide (``--num-layers 30`` on PP 4 does not); each rank's layers
must divide into its V chunks; an uneven first or last rank holds at least one layer, and
so does every rank between; a layout places exactly ``--num-layers`` ``t``s. The
arithmetic is Megatron-Core's (``get_num_layers_to_build`` and the layer offsets of
``transformer_layer.py``, ``PipelineParallelLayerLayout``), written here from scratch; its
multi-token-prediction ``m`` has no counterpart in hybrid and is refused.

:mod:`hybrid.config.checks` calls :func:`split_layers` on the command line before any
worker starts; the result travels in ``cfg.pipeline.split``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.config.options import opt
from hybrid.errors import ConfigError

PP = "--pipeline-model-parallel-size"
VPP = "--virtual-pipeline-model-parallel-size"
PER_VIRTUAL = "--num-layers-per-virtual-pipeline-stage"
FIRST = "--decoder-first-pipeline-num-layers"
LAST = "--decoder-last-pipeline-num-layers"
ACC_EMB = "--account-for-embedding-in-pipeline-split"
ACC_LOSS = "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"


@dataclass(frozen=True)
class SplitFlags:
    """The flags that say which layers each stage holds, besides the sizes
    (:func:`split_layers` takes them; the result is ``PipelineConfig.split``)."""

    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "layers per model chunk of an even split: the chunks per rank are the layers per "
        "stage / N")
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "transformer layers on the first pipeline stage (the rest split evenly over the "
        "stages after it)")
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "transformer layers on the last pipeline stage (the rest split evenly over the "
        "stages before it)")
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "count the embedding as a layer when splitting evenly: the first stage gets one "
        "transformer layer fewer")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "count the loss (final norm, output layer) as a layer when splitting evenly: the "
        "last stage gets one transformer layer fewer")
    pipeline_model_parallel_layout: str | None = opt(
        None, "every stage's layers as Megatron writes them: E embedding, t transformer layer, L "
        "loss, | between stages (PP x virtual stages of them, in model order), (..)*n and x*n "
        "repeat, commas for the eye; e.g. \"Ett|(tt|)*2,tL\"")


@dataclass(frozen=True)
class StageSplit:
    """The transformer layers of every piece of a pipelined model.

    ``layers[i]``: how many consecutive layers piece ``i`` holds, in model order, where
    piece ``i`` is virtual stage (chunk) ``i // pp`` of pipeline rank ``i % pp`` (the module
    note); ``len(layers) == pp * vpp``. ``how``: the flags that chose it, for the start-up
    line (:meth:`describe`).
    """

    pp: int
    vpp: int
    layers: tuple[int, ...]
    how: str = "even"

    def __post_init__(self):
        if len(self.layers) != self.pp * self.vpp or min(self.layers, default=0) < 0:
            raise ValueError(f"a split of PP {self.pp} x V {self.vpp} needs "
                             f"{self.pp * self.vpp} counts >= 0, got {self.layers}")

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    def piece(self, pp_rank: int, vp_stage: int = 0) -> int:
        """The model-order index of chunk ``vp_stage`` of pipeline rank ``pp_rank``."""
        if not (0 <= pp_rank < self.pp and 0 <= vp_stage < self.vpp):
            raise IndexError(f"no chunk {vp_stage} of pipeline rank {pp_rank} at PP {self.pp} "
                             f"x V {self.vpp}")
        return vp_stage * self.pp + pp_rank

    def layer_ids(self, pp_rank: int, vp_stage: int = 0) -> range:
        """The global layer numbers chunk ``vp_stage`` of pipeline rank ``pp_rank`` builds
        (Megatron's layer offset and count)."""
        i = self.piece(pp_rank, vp_stage)
        start = sum(self.layers[:i])
        return range(start, start + self.layers[i])

    def rank_layers(self, pp_rank: int) -> int:
        """Transformer layers on pipeline rank ``pp_rank``, all its chunks together."""
        return sum(len(self.layer_ids(pp_rank, v)) for v in range(self.vpp))

    def holds_embedding(self, pp_rank: int, vp_stage: int = 0) -> bool:
        """The chunk that embeds the tokens: chunk 0 of the first pipeline rank."""
        return self.piece(pp_rank, vp_stage) == 0

    def holds_loss(self, pp_rank: int, vp_stage: int = 0) -> bool:
        """The chunk with the final norm, output layer and loss: the last chunk of the
        last pipeline rank."""
        return self.piece(pp_rank, vp_stage) == self.pp * self.vpp - 1

    def describe(self) -> str:
        """The start-up text: one line per pipeline rank, its chunks' layers."""
        chunks = f", {self.vpp} virtual stages each" if self.vpp > 1 else ""
        head = (f"layers per pipeline stage (PP {self.pp}{chunks}; {self.num_layers} layers, "
                f"{self.how}):")
        lines = [head]
        for p in range(self.pp):
            parts = []
            for v in range(self.vpp):
                ids = self.layer_ids(p, v)
                text = (f"{len(ids)} layer{'s' * (len(ids) != 1)} "
                        f"({ids[0]}-{ids[-1]})" if len(ids) > 1 else
                        f"1 layer ({ids[0]})" if ids else "no layers")
                if self.holds_embedding(p, v):
                    text = "embedding + " + text
                if self.holds_loss(p, v):
                    text += " + loss"
                parts.append(text)
            lines.append(f"  stage {p}: " + " | ".join(parts))
        return "\n".join(lines)


def split_layers(num_layers: int, pp: int, vpp: int | None = None, *,
                 layers_per_virtual_stage: int | None = None, first: int | None = None,
                 last: int | None = None, account_for_embedding: bool = False,
                 account_for_loss: bool = False, layout: str | None = None) -> StageSplit:
    """The layers of every (virtual) stage, as Megatron's flags ask (the module note).

    ``vpp``: ``--virtual-pipeline-model-parallel-size`` (None: 1, or what
    ``layers_per_virtual_stage`` or ``layout`` imply). ``first`` / ``last``:
    ``--decoder-first/last-pipeline-num-layers``. A combination Megatron refuses, or a
    split that leaves a layer without a stage or a stage without the layers Megatron
    requires, is one ConfigError naming the flags.
    """
    if num_layers < 1 or pp < 1:
        raise ConfigError(f"--num-layers ({num_layers}) and {PP} ({pp}) must be >= 1")
    if vpp is not None and vpp < 1:
        raise ConfigError(f"{VPP} must be >= 1, got {vpp}")
    if layers_per_virtual_stage is not None and layers_per_virtual_stage < 1:
        raise ConfigError(f"{PER_VIRTUAL} must be >= 1, got {layers_per_virtual_stage}")
    if layers_per_virtual_stage is not None and layout is not None:
        raise ConfigError(f"{PER_VIRTUAL} and {LAYOUT} each set the virtual pipeline size: "
                          f"keep one")
    if layout is not None:
        others = [name for name, on in ((FIRST, first is not None), (LAST, last is not None),
                                        (ACC_EMB, account_for_embedding),
                                        (ACC_LOSS, account_for_loss)) if on]
        if others:
            raise ConfigError(f"{LAYOUT} places every layer itself: drop {', '.join(others)}")
        return _from_layout(layout, num_layers, pp, vpp)
    if first is not None or last is not None:
        if account_for_embedding or account_for_loss:
            acc = ACC_EMB if account_for_embedding else ACC_LOSS
            raise ConfigError(f"{FIRST} / {LAST} and {acc} are exclusive (Megatron has no "
                              f"uneven split that also counts the embedding or loss): keep one")
        if layers_per_virtual_stage is not None:
            raise ConfigError(f"with {FIRST} / {LAST}, give the chunks per rank with {VPP} "
                              f"(not {PER_VIRTUAL})")
        return _uneven(num_layers, pp, vpp or 1, first, last)
    return _even(num_layers, pp, vpp, layers_per_virtual_stage, account_for_embedding,
                 account_for_loss)


def _even(num_layers: int, pp: int, vpp: int | None, per_virtual: int | None,
          acc_emb: bool, acc_loss: bool) -> StageSplit:
    counted = num_layers + acc_emb + acc_loss
    what = f"--num-layers {num_layers}" + "".join(
        f" + 1 ({name})" for name, on in ((ACC_EMB, acc_emb), (ACC_LOSS, acc_loss)) if on)
    if counted % pp:
        raise ConfigError(f"{what} is not divisible by {PP} {pp}: set {FIRST} / {LAST} or "
                          f"{LAYOUT}")
    per_rank = counted // pp
    if per_virtual is not None:
        if per_rank % per_virtual:
            raise ConfigError(f"{PER_VIRTUAL} {per_virtual} does not divide the {per_rank} "
                              f"layers of each pipeline stage ({what} / {PP} {pp})")
        if vpp is not None and vpp != per_rank // per_virtual:  # (the same size twice: fine)
            raise ConfigError(f"{PER_VIRTUAL} {per_virtual} makes {per_rank // per_virtual} "
                              f"chunks of the {per_rank} layers per stage, but {VPP} is "
                              f"{vpp}: keep one")
        vpp = per_rank // per_virtual
    vpp = vpp or 1
    if per_rank % vpp:
        raise ConfigError(f"the {per_rank} layers of each pipeline stage ({what} / {PP} {pp}) "
                          f"do not split into {VPP} {vpp} equal chunks")
    layers = [per_rank // vpp] * (pp * vpp)
    # the embedding / loss takes a layer's place on the first / last chunk, which may be
    # left with none (each chunk has at least one place: L + 2 >= PP x V here)
    layers[0] -= acc_emb
    layers[-1] -= acc_loss
    how = "even" + "".join(f", {name}" for name, on in ((ACC_EMB, acc_emb),
                                                          (ACC_LOSS, acc_loss)) if on)
    if per_virtual is not None:
        how += f", {PER_VIRTUAL} {per_virtual}"
    return StageSplit(pp, vpp, tuple(layers), how)


def _uneven(num_layers: int, pp: int, vpp: int, first: int | None,
            last: int | None) -> StageSplit:
    for name, n in ((FIRST, first), (LAST, last)):
        if n is None:
            continue
        if n < 1:
            raise ConfigError(f"{name} must be >= 1, got {n} (Megatron: the stage it sets "
                              f"holds layers)")
        if n % vpp:
            raise ConfigError(f"{name} {n} does not split into {VPP} {vpp} equal chunks")
    fixed = (first or 0) + (last or 0)
    middle_ranks = pp - (first is not None) - (last is not None)
    given = " + ".join(f"{name} {n}" for name, n in ((FIRST, first), (LAST, last))
                       if n is not None)
    if middle_ranks < 0:
        raise ConfigError(f"{FIRST} and {LAST} set two different stages: they need {PP} >= 2 "
                          f"(got {pp})")
    middle = num_layers - fixed
    if middle < 0:
        raise ConfigError(f"{given} = {fixed} is more than --num-layers {num_layers}")
    if middle and not middle_ranks:
        raise ConfigError(f"{given} = {fixed} of --num-layers {num_layers}: "
                          f"{_count(middle, 'layer')} left with no stage ({PP} {pp} has none "
                          f"between)")
    if middle_ranks and not middle:
        raise ConfigError(f"{given} = --num-layers {num_layers}: the "
                          f"{_count(middle_ranks, 'stage')} between get no layers ({PP} {pp})")
    if middle_ranks and middle % middle_ranks:
        raise ConfigError(f"the {middle} layers after {given} (--num-layers {num_layers}) are "
                          f"not divisible by the {_count(middle_ranks, 'stage')} between ({PP} "
                          f"{pp}): change {FIRST} / {LAST}")
    per_middle = middle // middle_ranks if middle_ranks else 0
    if per_middle % vpp:
        raise ConfigError(f"the {per_middle} layers of each stage between the first and last "
                          f"(--num-layers {num_layers} after {given}) do not split into {VPP} "
                          f"{vpp} equal chunks")
    layers = []
    for _ in range(vpp):
        for p in range(pp):
            if p == 0 and first is not None:
                layers.append(first // vpp)
            elif p == pp - 1 and last is not None:
                layers.append(last // vpp)
            else:
                layers.append(per_middle // vpp)
    return StageSplit(pp, vpp, tuple(layers), given)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


# -- the layout string ---------------------------------------------------------------------
_KINDS = {"E": "embedding", "t": "transformer layer", "L": "loss"}


def parse_layout(text: str) -> list[str]:
    """Megatron's layout string -> its pieces, each a string of ``E``, ``t`` and ``L``
    (``"E(t|)*2L"`` is ``"Et|t|L"``: ``["Et", "t", "L"]``).

    Commas are dropped; ``(...)*n`` repeats a group (groups may nest), ``x*n`` one
    character (``|*3`` is three separators). A character other than ``E t L | ( ) * ,``
    and digits, an unclosed group or a ``*`` without a count is an error naming the flag.
    """
    src = text.replace(",", "")
    out, i = _parse_seq(src, 0, text)
    if i != len(src):
        raise ConfigError(f"{LAYOUT} {text!r}: unmatched ')'")
    return out.split("|")


def _parse_seq(src: str, i: int, text: str) -> tuple[str, int]:
    """Expand ``src[i:]`` up to an unmatched ')' or the end: (the expansion, where it stops)."""
    out = []
    while i < len(src) and src[i] != ")":
        c = src[i]
        if c == "(":
            atom, i = _parse_seq(src, i + 1, text)
            if i >= len(src):
                raise ConfigError(f"{LAYOUT} {text!r}: '(' without its ')'")
            i += 1
        elif c in _KINDS or c == "|":
            atom, i = c, i + 1
        elif c == "m":
            raise ConfigError(f"{LAYOUT} {text!r}: 'm' (a multi-token-prediction layer) is "
                              f"not in hybrid: the layout holds E, t and L only")
        else:
            raise ConfigError(f"{LAYOUT} {text!r}: {c!r} is not a layout character (E: "
                              f"embedding, t: transformer layer, L: loss, '|' between stages, "
                              f"'(...)*n' or 'x*n' to repeat, ',' for the eye)")
        if i < len(src) and src[i] == "*":
            j = i + 1
            while j < len(src) and src[j].isdigit():
                j += 1
            if j == i + 1:
                raise ConfigError(f"{LAYOUT} {text!r}: '*' needs a count after it")
            atom, i = atom * int(src[i + 1:j]), j
        out.append(atom)
    return "".join(out), i


def _from_layout(text: str, num_layers: int, pp: int, vpp: int | None) -> StageSplit:
    pieces = parse_layout(text)
    if len(pieces) % pp:
        raise ConfigError(f"{LAYOUT} {text!r} has {len(pieces)} stages ('|'-separated), not a "
                          f"multiple of {PP} {pp}")
    found = len(pieces) // pp
    if vpp is not None and vpp != found:
        raise ConfigError(f"{LAYOUT} {text!r} has {len(pieces)} stages = {PP} {pp} x {found} "
                          f"virtual stages, but {VPP} is {vpp}: drop {VPP}")
    flat = "".join(pieces)
    t = flat.count("t")
    if t != num_layers:
        raise ConfigError(f"{LAYOUT} {text!r} places {t} transformer layers ('t'), but "
                          f"--num-layers is {num_layers}: each layer needs one stage")
    for c in "EL":
        if flat.count(c) != 1:
            raise ConfigError(f"{LAYOUT} {text!r} holds {flat.count(c)} '{c}' ({_KINDS[c]}): "
                              f"give exactly one")
    if not pieces[0].startswith("E"):
        raise ConfigError(f"{LAYOUT} {text!r}: 'E' (the embedding) must open the first stage")
    if not pieces[-1].endswith("L"):
        raise ConfigError(f"{LAYOUT} {text!r}: 'L' (the loss) must close the last stage")
    return StageSplit(pp, found, tuple(p.count("t") for p in pieces), f"{LAYOUT} {text}")
