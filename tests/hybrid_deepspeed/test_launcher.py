"""``hybrid-deepspeed``: DeepSpeed's launcher command line, and a script that imports
``deepspeed`` and its submodules running with no line changed (hybrid/deepspeed/launcher.py,
hybrid/deepspeed/alias.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hybrid.deepspeed.launcher import LaunchError, plan
from tests.helpers.launch import free_port

ALIAS = ["-m", "hybrid.deepspeed.alias"]


def _plan(argv, gpus=0, host="node0", environ=None, **kw):
    return plan(argv, visible_gpus=gpus, hostname=host, environ=environ or {}, **kw)


def _torchrun(launch) -> dict[str, str]:
    """torchrun's --key=value options of a plan, and the worker's command after them."""
    cmd = launch.command
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    at = cmd.index("-m", 3)
    assert cmd[at:at + 2] == ALIAS
    opts = dict(o[2:].split("=", 1) for o in cmd[3:at])
    return {**opts, "worker": cmd[at + 2:]}


def test_deepspeed_command_lines_become_this_node_s_torchrun(tmp_path):
    got = _torchrun(_plan(["--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json"]))
    assert got == {"nproc_per_node": "2", "nnodes": "1", "node_rank": "0",
                   "master_addr": "127.0.0.1", "master_port": "29500",
                   "worker": ["train.py", "--deepspeed_config", "ds.json"]}
    assert _torchrun(_plan(["train.py"]))["nproc_per_node"] == "1"  # a CPU, no --num_gpus
    # GPUs: all visible by default; --include picks device ids, --num_gpus caps
    four = _plan(["train.py"], gpus=4)
    assert _torchrun(four)["nproc_per_node"] == "4" and four.env["CUDA_VISIBLE_DEVICES"] == \
        "0,1,2,3"
    some = _plan(["--include", "localhost:1,3", "train.py"], gpus=4)
    assert _torchrun(some)["nproc_per_node"] == "2" and some.env["CUDA_VISIBLE_DEVICES"] == "1,3"
    # device ids through a CUDA_VISIBLE_DEVICES the user already set
    shown = _plan(["--exclude", "node0:0", "train.py"], gpus=3,
                  environ={"CUDA_VISIBLE_DEVICES": "5,6,7"})
    assert shown.env["CUDA_VISIBLE_DEVICES"] == "6,7"
    capped = _plan(["--num_gpus", "2", "train.py"], gpus=4)
    assert capped.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    # a hostfile's line for this node gives its slots
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=3  # this one\n")
    assert _torchrun(_plan(["-H", str(hostfile), "train.py"]))["nproc_per_node"] == "3"
    # a node of a multi-node job, started on each node without ssh
    node = _torchrun(_plan(["--num_nodes", "2", "--no_ssh", "--node_rank", "1",
                            "--master_addr", "node0", "--master_port", "6000", "--num_gpus",
                            "2", "--module", "--no_local_rank", "pkg.train", "--x", "1"]))
    assert (node["nnodes"], node["node_rank"], node["master_addr"], node["master_port"]) == \
        ("2", "1", "node0", "6000")
    assert node["worker"] == ["--module", "--no_local_rank", "pkg.train", "--x", "1"]


@pytest.mark.parametrize("argv, says", [
    (["--num_nodes", "2", "train.py"], "--num_nodes 2 .*hybrid does not log into other hosts; "
                                        "run this command on each node with --no_ssh"),
    (["--launcher", "openmpi", "train.py"], "--launcher openmpi: hybrid starts"),
    (["--autotuning", "tune", "train.py"], "--autotuning: not supported .*no autotuner"),
    (["--no_python", "train.sh"], "--no_python: not supported"),
    (["--include", "a:0", "--exclude", "a:1", "train.py"], "--include and --exclude"),
    (["--include", "other:0", "train.py"], "--include other:0: names no slot of this node"),
    (["--include", "localhost:x", "train.py"], "--include 'localhost:x': slots are integers"),
    (["--include", "localhost:5", "train.py"], "slot 5 is not one of this node's 1"),
    (["--num_nodes", "2", "--no_ssh", "--node_rank", "2", "train.py"], "--node_rank 2: must"),
    (["--hostfile", "/nonexistent/hosts", "train.py"], "--hostfile /nonexistent/hosts: no such"),
])
def test_what_hybrid_deepspeed_cannot_honour_is_named(argv, says):
    with pytest.raises(LaunchError, match=says):
        _plan(argv)


SCRIPT = """
import argparse, atexit, json, os, sys


def gloo_threads():
    # this process's threads that gloo started (its groups' workers, its transport loop)
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += "gloo" in f.read()
        except OSError:  # (the thread ended meanwhile)
            pass
    return n


# registered before hybrid's exit hook, so it runs after it (atexit is last in, first out)
atexit.register(lambda: print(f"gloo threads at exit: {gloo_threads()}", file=sys.stderr,
                              flush=True))
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule, LayerSpec
from deepspeed.utils import RepeatingLoader

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed(dist_backend="gloo")
import torch
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
groups = split_params_into_different_moe_groups_for_optimizer({"params": [], "name": "p"})
try:
    deepspeed.moe.layer.MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=3,
                            ep_size=2)
    moe = "built"
except ValueError as e:
    moe = f"{type(e).__name__}: {e}"
try:
    from deepspeed.profiling.flops_profiler import get_model_profile
    profiler = "imported"
except ModuleNotFoundError as e:
    profiler = f"{type(e).__name__}: {e}"
real = sorted(m for m, mod in sys.modules.items()
              if m.split(".")[0] == "deepspeed"
              and "hybrid" not in (getattr(mod, "__file__", None) or "hybrid"))
# a file per rank: the two ranks' prints to one stdout may interleave within a line
with open(os.path.join(os.environ["RESULTS"], f"{dist.get_rank()}.json"), "w") as out:
    out.write(json.dumps({
    "rank": dist.get_rank(), "world": dist.get_world_size(), "local_rank": args.local_rank,
    "env_local_rank": int(os.environ["LOCAL_RANK"]), "steps": args.steps,
    "deepspeed": deepspeed.__name__, "pipe": PipelineModule.__module__,
    "loader": RepeatingLoader.__module__, "device": get_accelerator().device_name(),
    "same": sys.modules["deepspeed.pipe"] is sys.modules["hybrid.deepspeed.pipe"],
    "spec": sys.modules["hybrid.deepspeed.pipe"].__spec__.name,
    "moe_groups": groups, "moe": moe, "profiler": profiler, "real_deepspeed": real}))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).pow(2).mean()


# a few ZeRO-3 steps, then the script just ends: no engine close, no destroy_process_group
torch.manual_seed(0)
net = Net()
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
for _ in range(2):
    engine.backward(engine(torch.randn(2, 8)))
    engine.step()
"""


def _launch_and_read(tmp_path) -> tuple[list[dict], str]:
    """The script under ``python -m hybrid.deepspeed --num_gpus 2``: each rank's record
    (by rank) and the launch's stderr."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RESULTS": str(results)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "hybrid.deepspeed", "--num_gpus", "2",
                               "--master_port", str(free_port()), str(script), "--steps", "3"],
                              capture_output=True, text=True, timeout=240, env=env, check=False)
        # [gloo's pair connect] On a loaded 2-core machine gloo's connectFullMesh inside
        # torch's init_process_group has twice failed ("Connection closed by peer"),
        # before any line of the script ran: the launch is tried once more then.
        # Anything else fails at once.
        if done.returncode == 0 or "Gloo connectFullMesh failed" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(f.read_text()) for f in results.glob("*.json")]
    return sorted(got, key=lambda r: r["rank"]), done.stderr


def _check(launched):
    results, stderr = launched
    # the script trains a few ZeRO-3 steps and just ends: it exits 0 (checked above), no
    # rank aborts ("terminate called without an active exception"), and no gloo thread is
    # left when the interpreter finalizes (hybrid/parallel/teardown.py)
    assert "terminate called" not in stderr, stderr[-3000:]
    assert stderr.count("gloo threads at exit: 0") == 2, stderr[-3000:]
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    for r in results:
        assert r["local_rank"] == r["env_local_rank"] == r["rank"] and r["steps"] == 3
        assert (r["deepspeed"], r["pipe"], r["loader"]) == (
            "hybrid.deepspeed", "hybrid.deepspeed.pipe", "hybrid.deepspeed.pipe_engine")
        assert r["same"] and r["spec"] == "hybrid.deepspeed.pipe" and r["device"] == "cpu"
        # deepspeed.moe imports (the CIFAR example's top line); a layer of experts that
        # do not split over its EP size is one error naming both; an unserved module is
        # hybrid's own ModuleNotFoundError
        assert r["moe_groups"] == [{"params": [], "name": "p"}]
        assert r["moe"] == ("ValueError: deepspeed.moe.layer.MoE: num_experts 3 must be a "
                            "multiple of ep_size 2"), r["moe"]
        assert r["profiler"].startswith("ModuleNotFoundError: No module named "
                                        "'deepspeed.profiling' under hybrid") and \
            "flops profiler" in r["profiler"], r["profiler"]
        assert r["real_deepspeed"] == []


def test_a_deepspeed_script_runs_unchanged_without_deepspeed(tmp_path):
    """On a machine without DeepSpeed: every ``deepspeed`` import is hybrid's, the ranks
    get --local_rank, an unserved module is hybrid's own error; a script that trains
    through ``deepspeed.initialize`` and just ends, as users' scripts do, exits clean."""
    _check(_launch_and_read(tmp_path))


@pytest.mark.peer("deepspeed")
def test_a_deepspeed_script_runs_on_hybrid_with_deepspeed_installed(tmp_path):
    """With the real DeepSpeed installed beside hybrid, the script still runs on hybrid's
    modules: no module of the installed DeepSpeed is imported."""
    _check(_launch_and_read(tmp_path))
