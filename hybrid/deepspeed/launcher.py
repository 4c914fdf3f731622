"""``hybrid-deepspeed`` (and ``python -m hybrid.deepspeed``): DeepSpeed's ``deepspeed``
command line, running the script with no line changed.

    hybrid-deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

starts the node's workers under torchrun (``torch.distributed.run``); each runs the
script through :mod:`hybrid.deepspeed.alias`, so that ``deepspeed`` and its submodules are
:mod:`hybrid.deepspeed`'s, and gets ``--local_rank=N`` as DeepSpeed's launcher gives it.

What DeepSpeed's options become:

* ``--num_gpus`` / ``--num_accelerators``: workers on this node (default: the GPUs
  ``--include`` / ``--exclude`` leave, else the visible GPUs, else 1 on a CPU);
* ``--include`` / ``--exclude`` (``localhost:0,2``, ``host@host:1``): this node's slots,
  as ``CUDA_VISIBLE_DEVICES``; ``-H`` / ``--hostfile`` (``host slots=N``): the slots of
  this node's line;
* ``--num_nodes``, ``--node_rank``, ``--master_addr``, ``--master_port``: torchrun's
  rendezvous. A job of several nodes is started on each node
  (``--no_ssh --node_rank R``, DeepSpeed's way without ssh), or by SLURM; hybrid does not
  log into other hosts (pdsh, MPI);
* ``--module``, ``--no_local_rank``: as in DeepSpeed;
* ``--save_pid``, ``--no_ssh_check``, ``--ssh_port``, ``--log_level``: accepted, no effect
  on one node (a note says so);
* refused by name, with what to do instead: ``--launcher`` other than pdsh (a multi-node
  launcher), ``--launcher_args``, ``--force_multi``, ``--no_python``, ``--autotuning``,
  ``--enable_each_rank_log``, ``--bind_cores_to_rank``, ``--bind_core_list``,
  ``--venv_script``.

Each refusal or bad value is one line naming the option, and exit status 2 before any
worker starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default: used when it exists


class LaunchError(Exception):
    """A command line hybrid-deepspeed cannot honour; the message names the option."""


@dataclass
class Launch:
    """What to run on this node: the torchrun command and the environment it adds."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybrid-deepspeed", allow_abbrev=False,
        description="DeepSpeed's launcher command line over torchrun: the script runs with "
                    "`deepspeed` served by hybrid.deepspeed.")
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE,
                   help="MPI-style hostfile ('host slots=N'); this node's line gives its slots")
    p.add_argument("-i", "--include", default="", help="slots to use: NAME[:SLOT[,SLOT]]@...")
    p.add_argument("-e", "--exclude", default="", help="slots not to use (as --include)")
    p.add_argument("--num_nodes", type=int, default=-1, help="nodes of the job")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                   help="workers on this node")
    p.add_argument("--master_port", type=int, default=29500, help="rendezvous port")
    p.add_argument("--master_addr", default="", help="rendezvous host (default: this one)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index (with --no_ssh)")
    p.add_argument("--launcher", default="pdsh", help="multi-node launcher (pdsh only)")
    p.add_argument("--launcher_args", default="")
    p.add_argument("--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank to the script")
    p.add_argument("--no_ssh", action="store_true",
                   help="this command runs on every node, each with its --node_rank")
    p.add_argument("--no_ssh_check", action="store_true")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("--save_pid", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--autotuning", default="", choices=["", "tune", "run"])
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", default=None)
    p.add_argument("--log_level", default="info")
    p.add_argument("user_script", help="the training script, then its own arguments")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


_REFUSED = {
    "launcher_args": "hybrid starts this node's workers with torchrun; start each node "
                     "with --no_ssh --node_rank R",
    "force_multi": "start each node with --no_ssh --node_rank R, or under SLURM",
    "no_python": "hybrid runs Python scripts (the script, or a module with --module)",
    "autotuning": "hybrid has no autotuner: set the batch sizes in the ds_config",
    "enable_each_rank_log": "each rank writes to this command's stdout and stderr; redirect "
                            "it, or use torchrun's --log-dir",
    "bind_cores_to_rank": "bind with numactl or taskset around this command",
    "bind_core_list": "bind with numactl or taskset around this command",
    "venv_script": "activate the environment before this command, on each node",
}


def _slots(spec: str, option: str) -> dict[str, list[int] | None]:
    """``host[:s,s]@host...`` -> {host: slots, or None for all of them}."""
    out: dict[str, list[int] | None] = {}
    for part in filter(None, spec.split("@")):
        host, _, slots = part.partition(":")
        try:
            out[host] = [int(s) for s in slots.split(",")] if slots else None
        except ValueError:
            raise LaunchError(f"{option} {spec!r}: slots are integers, "
                              f"as in localhost:0,2") from None
    return out


def _hostfile(path: str) -> dict[str, int]:
    """``host slots=N`` lines -> {host: N}."""
    hosts: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#")[0].strip()
            if not line:
                continue
            host, _, slots = line.partition(" ")
            try:
                hosts[host] = int(slots.strip().removeprefix("slots="))
            except ValueError:
                raise LaunchError(f"--hostfile {path}, line {n}: expected 'HOST slots=N', "
                                  f"got {line!r}") from None
    return hosts


def plan(argv: list[str], *, visible_gpus: int, hostname: str,
         environ: Mapping[str, str]) -> Launch:
    """The launch a DeepSpeed command line asks for on this node. ``visible_gpus``,
    ``hostname`` and ``environ``: this node's, passed in by :func:`main` (the entry point)
    so that the plan is a pure function."""
    a = parser().parse_args(argv)
    for name, why in _REFUSED.items():
        value = getattr(a, name)
        if value not in ("", None, False, "None"):
            raise LaunchError(f"--{name}: not supported by hybrid-deepspeed; {why}")
    if a.launcher.lower() != "pdsh":
        raise LaunchError(f"--launcher {a.launcher}: hybrid starts this node's workers with "
                          f"torchrun; start each node with --no_ssh --node_rank R (or run "
                          f"this command under srun, one task per node)")
    if a.include and a.exclude:
        raise LaunchError("--include and --exclude: give one of them, as DeepSpeed requires")
    notes = [f"--{n}: no effect (hybrid-deepspeed starts this node's workers only)"
             for n in ("save_pid", "no_ssh_check") if getattr(a, n)]
    notes += ["--ssh_port: no effect (hybrid does not log into other hosts)"
              ] if a.ssh_port is not None else []

    hosts = _hostfile(a.hostfile) if os.path.isfile(a.hostfile) else {}
    if a.hostfile != DEFAULT_HOSTFILE and not hosts:
        raise LaunchError(f"--hostfile {a.hostfile}: no such file, or no hosts in it")
    nodes = a.num_nodes if a.num_nodes > 0 else max(1, len(hosts))
    if nodes > 1 and not (a.no_ssh or "SLURM_NODEID" in environ):
        raise LaunchError(f"--num_nodes {nodes} (or a hostfile of {len(hosts)} hosts): hybrid "
                          f"does not log into other hosts; run this command on each node with "
                          f"--no_ssh --node_rank R --master_addr NODE0 (or under srun)")
    node_rank = a.node_rank if a.node_rank >= 0 else int(environ.get("SLURM_NODEID", 0))
    if not 0 <= node_rank < nodes:
        raise LaunchError(f"--node_rank {node_rank}: must be in [0, {nodes}) for "
                          f"--num_nodes {nodes}")

    # this node's slots: its hostfile line, else its GPUs, else (a CPU) --num_gpus workers
    # or one; then --include / --exclude (this host's entry, or localhost's), then
    # --num_gpus as a cap
    me = next((h for h in (hostname, "localhost") if h in hosts), None)
    cpu_workers = a.num_gpus if a.num_gpus > 0 else 1
    total = hosts[me] if me is not None else visible_gpus or cpu_workers
    slots = list(range(total))
    for option, spec in (("--include", a.include), ("--exclude", a.exclude)):
        if not spec:
            continue
        chosen = _slots(spec, option)
        host = next((h for h in (hostname, "localhost") if h in chosen), None)
        if option == "--include" and host is None:
            raise LaunchError(f"--include {spec}: names no slot of this node "
                              f"({hostname} or localhost)")
        if host is not None:
            named = chosen[host]
            bad = [s for s in named or () if s not in slots]
            if bad:
                raise LaunchError(f"{option} {spec}: slot {bad[0]} is not one of this node's "
                                  f"{total}")
            if option == "--include":
                slots = slots if named is None else list(named)
            else:
                slots = [] if named is None else [s for s in slots if s not in named]
    if a.num_gpus > 0:
        slots = slots[:a.num_gpus]
    if not slots:
        raise LaunchError("--include/--exclude leave no slot on this node")
    nproc = len(slots)
    env = {}
    if visible_gpus:  # slots are device ids, through a CUDA_VISIBLE_DEVICES already set
        shown = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                 if d.strip()] or [str(i) for i in range(visible_gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(shown[s] for s in slots)

    worker = [*(["--module"] if a.module else []),
              *(["--no_local_rank"] if a.no_local_rank else []), a.user_script, *a.user_args]
    command = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc_per_node={nproc}", f"--nnodes={nodes}", f"--node_rank={node_rank}",
               f"--master_addr={a.master_addr or '127.0.0.1'}",
               f"--master_port={a.master_port}",
               "-m", "hybrid.deepspeed.alias", *worker]
    return Launch(command, env, notes)


def _visible_gpus(environ: dict[str, str]) -> int:
    """GPUs this node shows, without importing torch (seconds) in the launcher."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return len([d for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()]
               ) if os.path.isdir("/dev") else 0


def main(argv: list[str] | None = None) -> None:
    """The ``hybrid-deepspeed`` command: plan, then become torchrun (so that signals and the
    exit status are the workers')."""
    environ = dict(os.environ)
    try:
        launch = plan(sys.argv[1:] if argv is None else argv,
                      visible_gpus=_visible_gpus(environ), hostname=os.uname().nodename,
                      environ=environ)
    except (LaunchError, OSError) as e:
        print(f"hybrid-deepspeed: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for note in launch.notes:
        print(f"hybrid-deepspeed: {note}", file=sys.stderr)
    sys.stdout.flush()
    os.execve(launch.command[0], launch.command, {**environ, **launch.env})


if __name__ == "__main__":
    main()
