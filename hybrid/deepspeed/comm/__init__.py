"""``deepspeed.comm``: the collectives a training script calls, over torch.distributed.

    import hybrid.deepspeed.comm as dist          # DeepSpeed's ``import deepspeed.comm as dist``
    dist.init_distributed()
    if dist.get_rank() == 0: ...
    dist.all_reduce(loss_sum)                     # the default (world) group, as DeepSpeed's

These are the script's own collectives, on the process groups torch.distributed
holds (the default group, or a group the script made): hybrid's engine runs
its collectives through its own door (:mod:`hybrid.parallel.comm`, with the
byte counters and the flight recorder), and nothing here reaches it. A process
that joined no group (one process started without torchrun) is rank 0 of a
world of 1: the queries say so and each collective leaves its tensors as one
rank would (a reduction of one tensor is itself). In a multi-process job
(WORLD_SIZE > 1) a call before :func:`init_distributed` or
``deepspeed.initialize`` is an error saying so.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import NoReturn

import torch
import torch.distributed as dist

from hybrid.errors import ConfigError

ReduceOp = dist.ReduceOp


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _joined() -> bool:
    """True with a default process group; False for one process alone; an error for a
    rank of a multi-process job that has not joined it yet."""
    if is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("deepspeed.comm: this process is one rank of "
                          f"{os.environ['WORLD_SIZE']} (WORLD_SIZE) but has joined no "
                          "process group yet: call deepspeed.init_distributed() or "
                          "deepspeed.initialize(...) first")
    return False


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Mapping | None = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join torchrun's job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as the default
    process group, once: a second call, or one after ``deepspeed.initialize``, does
    nothing. ``dist_backend``: nccl on a GPU, gloo otherwise (the default). One
    process started without torchrun joins nothing (hybrid runs it without
    torch.distributed). MPI discovery is not done: launch with torchrun."""
    if dist_init_required is False or is_initialized():
        return
    world = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
        return
    if rank < 0:
        if "RANK" not in os.environ:
            raise ConfigError("deepspeed.init_distributed(): no RANK in the environment; "
                              "hybrid does not discover ranks through MPI: launch with "
                              "torchrun (or pass rank= and world_size=)")
        rank = int(os.environ["RANK"])
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank,
                            world_size=world, device_id=device)


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> dist.ProcessGroup | None:
    return dist.new_group(ranks) if _joined() else None


def get_world_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if _joined() else None


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if _joined() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if _joined() else 1


def get_local_rank() -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK (0 without it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: dist.ProcessGroup | None = None, group_rank: int = 0) -> int:
    if not _joined() or group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: dist.ProcessGroup | None = None) -> list[int]:
    if not _joined():
        return [0]
    return [get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def barrier(group: dist.ProcessGroup | None = None, async_op: bool = False,
            device_ids: list[int] | None = None) -> dist.Work | None:
    return dist.barrier(group, async_op, device_ids) if _joined() else None


def monitored_barrier(group: dist.ProcessGroup | None = None,
                      timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    if _joined():
        dist.monitored_barrier(group, timeout, wait_all_ranks)


def all_reduce(tensor: torch.Tensor, op: ReduceOp | ReduceOp.RedOpType = ReduceOp.SUM,
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    return dist.all_reduce(tensor, op, group, async_op) if _joined() else None


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp | ReduceOp.RedOpType = ReduceOp.SUM,
           group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    return dist.reduce(tensor, dst, op, group, async_op) if _joined() else None


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None,
              async_op: bool = False) -> dist.Work | None:
    return dist.broadcast(tensor, src, group, async_op) if _joined() else None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    if _joined():
        return dist.all_gather(tensor_list, tensor, group, async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: dist.ProcessGroup | None = None,
                           async_op: bool = False) -> dist.Work | None:
    if _joined():
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
    output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
    return None


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op: ReduceOp | ReduceOp.RedOpType = ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None,
                          async_op: bool = False) -> dist.Work | None:
    if _joined():
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)
    output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
    return None


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    if _joined():
        return dist.gather(tensor, gather_list, dst, group, async_op)
    if gather_list:
        gather_list[0].copy_(tensor)
    return None


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
            src: int = 0, group: dist.ProcessGroup | None = None,
            async_op: bool = False) -> dist.Work | None:
    if _joined():
        return dist.scatter(tensor, scatter_list, src, group, async_op)
    if scatter_list:
        tensor.copy_(scatter_list[0])
    return None


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None,
                      group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    if _joined():
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      group, async_op)
    output.copy_(input)
    return None


def all_gather_object(object_list: list, obj: object,
                      group: dist.ProcessGroup | None = None) -> None:
    if _joined():
        dist.all_gather_object(object_list, obj, group)
    else:
        object_list[0] = obj


def broadcast_object_list(object_list: list, src: int, group: dist.ProcessGroup | None = None,
                          device: torch.device | None = None) -> None:
    if _joined():
        dist.broadcast_object_list(object_list, src, group, device)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None,
         tag: int = 0) -> None:
    _alone("send")
    return dist.send(tensor, dst, group, tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None,
         tag: int = 0) -> int:
    _alone("recv")
    return dist.recv(tensor, src, group, tag)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None,
          tag: int = 0) -> dist.Work | None:
    _alone("isend")
    return dist.isend(tensor, dst, group, tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None,
          tag: int = 0) -> dist.Work | None:
    _alone("irecv")
    return dist.irecv(tensor, src, group, tag)


def _alone(op: str) -> None:
    if not _joined():
        raise ConfigError(f"deepspeed.comm.{op}: one process alone has no peer to talk to")


def __getattr__(name: str) -> NoReturn:
    raise AttributeError(f"hybrid.deepspeed.comm has no {name!r} (not one of DeepSpeed's comm "
                         f"calls hybrid serves yet; torch.distributed.{name} may do)")
