"""Why a step was not finite: which micro-batch's loss, which parameters' gradients.

Called only for a step the engine already skipped (every rank agreed it was
not finite: an fp16 overflow, a NaN, an infinite loss), so clean steps pay
nothing. Each rank looks at what it holds -- the losses of its micro-batches,
the gradient shard it owns, parameter by parameter -- and one all-gather of
a fixed-size int64 row per rank over the world gives every rank the whole
picture, so all of them say (or raise) the same words.
"""

from __future__ import annotations

import torch

from hybrid.diagnostics.report import rank_list

_MICRO = 4  # non-finite micro-batches listed per rank
_PARAMS = 8  # non-finite parameters listed per rank


@torch.no_grad()
def local_findings(model, engine, losses: torch.Tensor,
                   grads_held: bool = True) -> tuple[list[int], list[int], int]:
    """(micro-batches with a non-finite loss, model-order indices of parameters with a
    non-finite gradient in this rank's owned shard (first few), how many such).
    ``grads_held``: the engine still holds this step's gradients (else no parameters)."""
    index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    micro = (~torch.isfinite(losses)).nonzero().flatten().tolist()
    if not grads_held:
        return micro, [], 0
    owners, checks = [], []
    for pc in engine.owned_pieces():
        owners.append(index[id(pc.param)])
        checks.append(torch.isfinite(engine.grad_values(pc)).all())
    ok = torch.stack(checks).tolist() if checks else []  # one sync for all of them
    bad = sorted({o for o, fine in zip(owners, ok) if not fine})
    return micro, bad[:_PARAMS], len(bad)


def explain(model, engine, ps, losses: torch.Tensor, first_sample: int,
            global_batch_size: int, micro_batch_size: int, grads_held: bool = True) -> str:
    """One sentence, the same on every rank, on why this step was not finite.

    ``losses``: this rank's micro-batch losses ``(n,)``; ``first_sample``: the
    consumed-samples position where the step's global batch starts. ``grads_held``:
    False when a later step has run since (a bf16/fp32 run reads its skip flags once
    per log interval): then only the micro-batches are named.
    Collective over the world group (one small all-gather).
    """
    micro, params, count = local_findings(model, engine, losses, grads_held)
    width = 2 + _MICRO + _PARAMS
    row = [len(micro), count] + (micro[:_MICRO] + [-1] * _MICRO)[:_MICRO] + \
        (params + [-1] * _PARAMS)[:_PARAMS]
    mine = torch.tensor(row, dtype=torch.int64, device=ps.device)
    every = torch.empty(ps.world_size * width, dtype=torch.int64, device=ps.device)
    ps.world_group.all_gather(every, mine)
    rows = every.view(ps.world_size, width).tolist()

    per_rank = global_batch_size // ps.dp_size
    bad_micro: dict = {}  # (dp rank, micro-batch) -> global ranks that saw it
    names = [n for n, _ in model.named_parameters()]
    bad_params: set = set()
    truncated = False
    for rank, r in enumerate(rows):
        for mb in r[2: 2 + _MICRO]:
            if mb >= 0:
                bad_micro.setdefault((rank // ps.tp_size, mb), []).append(rank)
        truncated |= r[0] > _MICRO or r[1] > _PARAMS
        bad_params.update(p for p in r[2 + _MICRO:] if p >= 0)
    said = []
    for (dp, mb), ranks in sorted(bad_micro.items()):
        lo = first_sample + dp * per_rank + mb * micro_batch_size
        said.append(f"micro-batch {mb} of DP rank {dp} (samples {lo}-{lo + micro_batch_size - 1}"
                    f", {rank_list(ranks)})")
    text = ("non-finite loss in " + "; ".join(said)) if said else "every micro-batch loss finite"
    if bad_params:
        listed = [names[p] for p in sorted(bad_params)][:_PARAMS]
        more = " at least" if truncated or len(bad_params) > _PARAMS else ""
        text += (f"; non-finite gradients in{more} {len(bad_params)} parameter"
                 f"{'s' if len(bad_params) > 1 else ''}: {', '.join(listed)}")
    elif grads_held:
        text += "; every gradient finite"
    else:
        text += "; its gradients are gone (later steps ran before the flag was read)"
    return text
