"""The vocabulary of pipeline schedules: what one rank does, one action at a time.

A schedule (:class:`Schedule`) is, for each of the ``p`` pipeline ranks, the ordered
list of :class:`Action` it runs in one optimizer step of ``m`` micro-batches. The
generators (:mod:`hybrid.pipeline.schedules`) write the lists, the simulator
(:mod:`hybrid.pipeline.simulator`) checks and times them, the executor runs them.
This module is the contract between the three. Torch-free.

Stages and ranks
----------------
The model is cut into ``p * v`` stages, numbered in model order ``0 .. p*v - 1``
(``v``, the virtual pipeline size, is 1 without interleaving). Stage ``s`` lives on
rank ``s % p`` as that rank's chunk ``s // p``: Megatron's interleaving, where rank
``r`` holds stages ``r, r + p, r + 2p, ...`` (:func:`stage_rank`,
:func:`stage_chunk`). With ``v == 1`` a stage is a rank. Stage 0 reads the
micro-batch's input; the last stage computes the loss. Micro-batches are numbered
``0 .. m-1``.

Every action in rank ``r``'s list names a stage of rank ``r`` (``stage % p == r``),
except :attr:`Kind.END`, which names none (``stage == microbatch == -1``).

Compute actions (``peer`` is None)
----------------------------------
``F``  FORWARD (s, j): stage s's forward of micro-batch j. Its input is the
       micro-batch (s == 0), or stage s-1's output for j: received by an earlier
       ``RA`` (s, j) of this list, or, when stage s-1 is on this rank (only when
       p == 1), the output of this list's earlier ``F`` (s-1, j), kept in memory.
       It keeps what the backward needs; the last stage also computes j's loss.
``B``  BACKWARD (s, j): the whole backward of (s, j): from the gradient of stage s's
       output (the loss on the last stage; else received by an earlier ``RG``
       (s, j), or, with p == 1, produced by this list's ``B``/``I`` (s+1, j)) to the
       gradient of its input (kept for ``SG`` or the local stage s-1), and the
       weight gradients, added to what earlier micro-batches left. Frees (s, j)'s
       activations.
``I``  BACKWARD_INPUT (s, j): the input-gradient half of ``B``; keeps what ``W``
       needs.
``W``  BACKWARD_WEIGHT (s, j): the weight-gradient half, after ``I`` (s, j) in the
       same list; adds to the weight gradients and frees what (s, j) still held.

Each (stage, micro-batch) gets exactly one ``F`` and either one ``B`` or one ``I``
and one ``W``.

Communication actions (``peer`` is the other rank)
--------------------------------------------------
``SA`` SEND_ACT (s, j, peer): send stage s's output for micro-batch j (made by
       ``F`` (s, j)) to ``peer``, the rank of stage s+1.
``RA`` RECV_ACT (s, j, peer): receive stage s's input for micro-batch j from
       ``peer``, the rank of stage s-1. Matches ``SA`` (s-1, j) there.
``SG`` SEND_GRAD (s, j, peer): send the gradient of stage s's input for j (made by
       ``B``/``I`` (s, j)) to ``peer``, the rank of stage s-1.
``RG`` RECV_GRAD (s, j, peer): receive the gradient of stage s's output for j from
       ``peer``, the rank of stage s+1. Matches ``SG`` (s+1, j) there.
``END`` the step's end; the last action of every list, once.

Two stages on one rank exchange nothing: there is no communication action between
them (which happens only when p == 1); the tensor passes in memory.

[Note: the semantics the executor honours]
1. A rank runs its list in order, one action after another.
2. A send does not block: the executor posts it (``isend``) and goes on. The tensor
   stays alive and unchanged until the send completes.
3. A receive blocks: the action after it starts only once the tensor has arrived.
   (Posting the ``irecv`` earlier is allowed, in the list's order per peer; running
   the next action before it completes is not.)
4. Per ordered pair of ranks (src, dst), the sends src's list makes to dst and the
   receives dst's list makes from src come in the same order, activations and
   gradients alike. So a message is matched by its order on the pair alone (as
   NCCL matches); a tag per (kind, stage, micro-batch) on gloo is allowed, never
   needed.
5. ``END`` waits for every send this rank posted. After it, every stage of this
   rank holds its weight gradients summed over the m micro-batches, and the
   optimizer step may run.
The simulator plays exactly these rules (sends buffered without bound, receives
waiting for their send, END for its sends' receipt), so a list it accepts cannot
deadlock under them. On NCCL, where a posted send can hold the stream until it is
matched, post each run of adjacent communication actions as one batch
(``batch_isend_irecv``), as Megatron pairs send-forward with receive-backward.

Text form: ``F3.s1`` (forward, micro-batch 3, stage 1), likewise ``B``, ``I``, ``W``;
``SA3.s1>2`` (send stage 1's output of micro-batch 3 to rank 2), ``RA3.s2<1``
(receive stage 2's input of micro-batch 3 from rank 1), ``SG3.s2>1``, ``RG3.s1<2``;
``END``. :func:`parse_action` reads it back.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an action does; the value is its code in the text form."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    END = "END"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
# The actions that make the gradient of a stage's input (what SG sends, or stage s-1 reads).
INPUT_GRAD = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT})


@dataclass(frozen=True)
class Action:
    """One step of one rank's list; the module docstring gives each kind's contract."""

    kind: Kind
    stage: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind is Kind.END:
            return "END"
        text = f"{self.kind.value}{self.microbatch}.s{self.stage}"
        if self.kind in SENDS:
            return f"{text}>{self.peer}"
        if self.kind in RECVS:
            return f"{text}<{self.peer}"
        return text


END = Action(Kind.END, -1, -1)

_TEXT = re.compile(r"(F|B|I|W|SA|RA|SG|RG)(\d+)\.s(\d+)(?:([<>])(\d+))?")


def parse_action(text: str) -> Action:
    """The action of a text form (``F3.s1``, ``SA3.s1>2``, ``END``, ...); ValueError if none."""
    if text == "END":
        return END
    forms = "forms: F3.s1, B3.s1, I3.s1, W3.s1, SA3.s1>2, RA3.s2<1, SG3.s2>1, RG3.s1<2, END"
    match = _TEXT.fullmatch(text)
    if match is None:
        raise ValueError(f"not an action: {text!r} ({forms})")
    code, microbatch, stage, arrow, peer = match.groups()
    kind = Kind(code)
    wanted = ">" if kind in SENDS else "<" if kind in RECVS else None
    if arrow != wanted:
        takes = f"'{wanted}' and the peer rank" if wanted else "no peer"
        raise ValueError(f"not an action: {text!r}: {kind.name} takes {takes} ({forms})")
    return Action(kind, int(stage), int(microbatch), None if peer is None else int(peer))


def parse_actions(text: str) -> tuple[Action, ...]:
    """A rank's list from its text forms, separated by white space."""
    return tuple(parse_action(word) for word in text.split())


def format_actions(actions: Iterable[Action]) -> str:
    """A rank's list as text forms separated by spaces (what :func:`parse_actions` reads)."""
    return " ".join(str(a) for a in actions)


def matching_receive(send: Action, sender: int) -> Action:
    """The receive, on ``send``'s peer, that meets ``send`` made on rank ``sender``."""
    if send.kind is Kind.SEND_ACT:
        return Action(Kind.RECV_ACT, send.stage + 1, send.microbatch, sender)
    if send.kind is Kind.SEND_GRAD:
        return Action(Kind.RECV_GRAD, send.stage - 1, send.microbatch, sender)
    raise ValueError(f"{send} is not a send")


def in_words(a: Action, peer: int | None = None) -> str:
    """What communication action ``a`` moves, in words, for reports: "receiving stage 1's
    input for micro-batch 3 from stage 0 (global rank 4)"; ``peer``: the global rank of
    ``a.peer`` (None: leave it out). The action's text form says the same in short."""
    j, s = a.microbatch, a.stage
    at = "" if peer is None else f" (global rank {peer})"
    if a.kind is Kind.RECV_ACT:
        return f"receiving stage {s}'s input for micro-batch {j} from stage {s - 1}{at}"
    if a.kind is Kind.RECV_GRAD:
        return (f"receiving the gradient of stage {s}'s output for micro-batch {j} from "
                f"stage {s + 1}{at}")
    if a.kind is Kind.SEND_ACT:
        return f"sending stage {s}'s output for micro-batch {j} to stage {s + 1}{at}"
    if a.kind is Kind.SEND_GRAD:
        return (f"sending the gradient of stage {s}'s input for micro-batch {j} to stage "
                f"{s - 1}{at}")
    raise ValueError(f"{a} moves nothing between ranks")


def stage_rank(stage: int, p: int) -> int:
    """The rank holding virtual stage ``stage`` of ``p`` ranks (Megatron's interleaving)."""
    return stage % p


def stage_chunk(stage: int, p: int) -> int:
    """Which of its rank's chunks virtual stage ``stage`` is: 0 for stages 0..p-1, 1 for
    the next p, and so on."""
    return stage // p


@dataclass(frozen=True)
class Schedule:
    """One optimizer step of a pipeline: ``ranks[r]`` is rank r's list of actions.

    ``p`` pipeline ranks, ``m`` micro-batches, ``v`` stages per rank (``p * v`` stages
    in all, :attr:`stages`); ``name`` the generator's (``1f1b``, ...).
    """

    name: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.p * self.v

    def text(self) -> list[str]:
        """Each rank's list as one line of text forms."""
        return [format_actions(actions) for actions in self.ranks]

    @classmethod
    def from_text(cls, name: str, p: int, m: int, v: int, lines: list[str]) -> Schedule:
        """A schedule from one line of text forms per rank (hand-written lists, tests)."""
        return cls(name, p, m, v, tuple(parse_actions(line) for line in lines))
