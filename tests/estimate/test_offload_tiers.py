"""The offload tiers' terms, by hand, and the ladder's recommendation.

Pure arithmetic (no processes): a small GPT whose every term is written out
below; a 2.42B-parameter GPT at DP 2 on this machine's 24 GiB of host memory
and 70 GiB of disk, which only the nvme tier for both the optimizer states
and the parameters fits; a tiny one that needs no offload; one whose disk is
too small, which says so and by how much. The script is run in this process
(``main``) and its JSON lines and text read back.
"""

import importlib.util
import json
import os
from dataclasses import replace

import pytest

from hybrid.config.model import ModelConfig
from hybrid.config.sections import OffloadConfig
from hybrid.estimate.memory import Workload, activation_bytes, buffer_bytes
from hybrid.estimate.model_states import model_state_bytes
from hybrid.estimate.tiers import (
    HOST_BASELINE_BYTES,
    LADDER,
    Capacity,
    device_terms,
    disk_bytes_per_step,
    disk_terms,
    host_terms,
    largest_fitting,
    offload_ladder,
    pcie_bytes_per_step,
    recommend_offload,
    rung_workload,
    setting_name,
    shard_elements,
    shortfalls,
    tier_bytes,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2 ** 30

# The small GPT: h = 64, 2 layers, 256-token vocabulary (already a multiple of 128),
# 32 positions. A block is 12 h^2 + 13 h = 49,984 parameters, the root (embeddings,
# positions, final LayerNorm) 256 x 64 + 32 x 64 + 2 x 64 = 18,560: Psi = 118,528.
# At DP 3 the shard is ceil(118,528 / 3) = 39,510 elements (not a whole third).
BLOCK, ROOT_UNIT, PSI, SHARD = 49_984, 18_560, 118_528, 39_510
T, C = 1024, 4  # --offload-buffer-size, --offload-buffer-count
SMALL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                    max_position_embeddings=32, vocab_size=256)


def _small(**kw):
    base = dict(model=SMALL, micro_batch_size=2, dp=3, zero_stage=3, params_dtype="bf16",
                grads_dtype="fp32")
    return Workload(**{**base, **kw})


def _off(optimizer=None, param=None, **kw):
    return OffloadConfig(optimizer=optimizer, param=param, buffer_count=C, buffer_size=T, **kw)


def test_small_model_sizes():
    w = _small()
    assert (SMALL.block_parameters(), SMALL.root_parameters(), w.psi) == (BLOCK, ROOT_UNIT, PSI)
    assert shard_elements(w) == SHARD and 3 * SHARD > PSI


def test_host_terms_by_hand():
    """bf16 params (e_p 2), fp32 gradients (e_g 4), on a GPU."""
    w = _small()
    zero = dict(baseline=7, master_and_moments=0, grad_buffer=0, grad_staging=0, upload_copy=0,
                optimizer_staging=0, param_shard=0, param_staging=0, param_write_staging=0)
    assert host_terms(w, _off(), 7) == zero
    assert host_terms(w, _off("cpu"), 7) == dict(
        zero, master_and_moments=12 * 39_510, grad_buffer=4 * 39_510, upload_copy=2 * 39_510)
    # nvme: no master, moments or gradient shard on the host: C tiles of 12 bytes per
    # element, and the gradients' staging -- 2 shards of the largest unit (a block's
    # 16,662) and C tile slots of T x 4 bytes
    grads = 2 * 16_662 * 4 + C * T * 4
    assert host_terms(w, _off("nvme"), 7) == dict(
        zero, grad_staging=grads, upload_copy=2 * 39_510, optimizer_staging=4 * 1024 * 12)
    # param cpu: the shard's home (the step writes the new parameters there)
    assert host_terms(w, _off("cpu", "cpu"), 7) == dict(
        zero, master_and_moments=12 * 39_510, grad_buffer=4 * 39_510, param_shard=2 * 39_510)
    # tiles straddle units: the new parameters go home through 2 scratch tiles
    assert host_terms(w, _off("nvme", "cpu"), 7) == dict(
        zero, grad_staging=grads, optimizer_staging=49_152, param_shard=79_020,
        param_write_staging=2 * 1024 * 2)
    # 2 reads of the largest unit's shard in flight
    assert host_terms(w, _off("nvme", "nvme"), 7) == dict(
        zero, grad_staging=grads, optimizer_staging=49_152, param_staging=2 * 16_662 * 2,
        param_write_staging=2 * 1024 * 2)
    # the host step writes whole units: scratch for the disk writes of the largest
    assert host_terms(w, _off("cpu", "nvme"), 7) == dict(
        zero, master_and_moments=12 * 39_510, grad_buffer=4 * 39_510,
        param_staging=2 * 16_662 * 2, param_write_staging=2 * 16_662 * 2)
    # the delayed update holds a step's new parameters in the upload copy instead
    assert host_terms(w, _off("nvme", "nvme", delayed_update=True), 7) == dict(
        zero, grad_staging=grads, optimizer_staging=49_152, param_staging=2 * 16_662 * 2,
        upload_copy=2 * 39_510)
    assert host_terms(w, _off())["baseline"] == HOST_BASELINE_BYTES


def test_disk_terms_by_hand():
    w = _small()
    assert disk_terms(w, _off("cpu", "cpu")) == {"optimizer_swap": 0, "grad_swap": 0,
                                                 "param_swap": 0}
    # 39,510 elements are 39 tiles of 1,024 (39,936 elements), 12 bytes each, and a
    # gradient slot of 4,096 bytes each
    assert disk_terms(w, _off("nvme")) == {"optimizer_swap": 12 * 39 * 1024,
                                           "grad_swap": 39 * 4096, "param_swap": 0}
    assert disk_terms(w, _off("nvme", "nvme")) == {"optimizer_swap": 479_232,
                                                   "grad_swap": 159_744,
                                                   "param_swap": 2 * 39_510}
    assert tier_bytes(w, _off("nvme", "nvme"))["disk_bytes"] == 479_232 + 159_744 + 79_020


def test_fp32_params_need_no_narrow_copies():
    w = _small(params_dtype="fp32", grads_dtype=None)
    assert host_terms(w, _off("cpu"), 0) == dict(
        baseline=0, master_and_moments=12 * SHARD, grad_buffer=4 * SHARD, grad_staging=0,
        upload_copy=0,
        optimizer_staging=0, param_shard=0, param_staging=0, param_write_staging=0)
    assert host_terms(w, _off("nvme", "nvme"), 0)["optimizer_staging"] == 4 * 1024 * 12
    assert host_terms(w, _off("nvme", "nvme"), 0)["param_staging"] == 2 * 16_662 * 4


def test_device_terms_by_hand():
    w = _small()
    states = model_state_bytes(PSI, 3, 3, "bf16", "fp32")
    bufs, acts = buffer_bytes(w), activation_bytes(w)["peak"]
    none = device_terms(w, _off(), 5)
    assert none == {"runtime": 5, "params": states["params"], "grads": states["grads"],
                    "optimizer": states["optimizer"], "gathered_units": bufs["gathered"],
                    "unit_grads": bufs["grads"], "reduce_staging": bufs["staging"],
                    "activations": acts}
    # the optimizer offloaded at stage 3: no gradient shard, 2 landing buffers of the
    # largest unit's (a block's 49,984 elements) shard, fp32
    landing = 2 * 16_662 * 4
    assert device_terms(w, _off("cpu"), 5) == dict(none, optimizer=0, grads=landing)
    assert device_terms(w, _off("nvme"), 5) == dict(none, optimizer=0, grads=landing)
    # param offload: no shard; the computed unit + 2 prefetched, each the largest unit
    # in bf16
    for opt, param in (("cpu", "cpu"), ("nvme", "nvme")):
        assert device_terms(w, _off(opt, param), 5) == dict(
            none, params=0, grads=landing, optimizer=0, gathered_units=3 * 49_984 * 2)
    # ... and GPUDirect reads of params.swp: the 2 reads in flight move from the host's
    # staging to the device
    gds, plain = _off("nvme", "nvme", gds=True), _off("nvme", "nvme")
    assert device_terms(w, gds, 5) == dict(device_terms(w, plain, 5),
                                           param_reads=2 * 16_662 * 2)
    assert host_terms(w, gds, 0) == dict(host_terms(w, plain, 0), param_staging=0)
    # stage 2: a bucket's shard, or the word embedding's when it is larger
    w2 = replace(w.with_stage(2), reduce_bucket_size=10**6)
    assert device_terms(w2, _off("cpu"))["grads"] == 2 * -(-PSI // 3) * 4
    w2 = replace(w2, reduce_bucket_size=100)
    emb = w.padded_vocab_size * SMALL.hidden_size
    assert device_terms(w2, _off("cpu"))["grads"] == 2 * -(-emb // 3) * 4
    # stage 1: full parameters and gradients stay, only the optimizer states leave
    w1 = w.with_stage(1)
    assert device_terms(w1, _off("cpu"))["params"] == 2 * PSI
    assert device_terms(w1, _off("cpu"))["grads"] == 4 * PSI


def test_pcie_per_step_by_hand():
    w = _small()
    assert pcie_bytes_per_step(w, _off()) == {"grads_down": 0, "grads_up": 0, "params_up": 0,
                                              "param_gathers_up": 0, "total": 0}
    assert pcie_bytes_per_step(w, _off("nvme")) == {
        "grads_down": 4 * SHARD, "grads_up": 0, "params_up": 2 * SHARD, "param_gathers_up": 0,
        "total": 6 * SHARD}
    # param offload: the shard goes up for the forward's and the backward's gathers
    assert pcie_bytes_per_step(w, _off("cpu", "cpu")) == {
        "grads_down": 4 * SHARD, "grads_up": 0, "params_up": 0,
        "param_gathers_up": 2 * 2 * SHARD, "total": 8 * SHARD}
    # full recompute gathers a third time; 4 micro-batches each gather and send their
    # sums down, 3 come back up to be added to
    w4 = replace(w, recompute=True, micro_batches=4)
    assert pcie_bytes_per_step(w4, _off("nvme", "nvme")) == {
        "grads_down": 4 * 4 * SHARD, "grads_up": 3 * 4 * SHARD, "params_up": 0,
        "param_gathers_up": 4 * 3 * 2 * SHARD, "total": 52 * SHARD}
    # stage 1 accumulates in its full device buffer: one shard down per step
    assert pcie_bytes_per_step(w4.with_stage(1), _off("cpu"))["grads_down"] == 4 * SHARD
    assert pcie_bytes_per_step(replace(w, device="cpu"), _off("cpu", "cpu"))["total"] == 0


def test_disk_per_step_by_hand():
    w = _small()
    assert disk_bytes_per_step(w, _off("cpu", "cpu"))["total"] == 0
    nvme = disk_bytes_per_step(w, _off("nvme", "cpu"))
    # the states in and out, the gradient shard (fp32) out during backward, in at the step
    assert (nvme["read"], nvme["write"], nvme["total"]) == (16 * SHARD, 16 * SHARD, 32 * SHARD)
    both = disk_bytes_per_step(w, _off("nvme", "nvme"))
    assert both == {"optimizer_read": 12 * SHARD, "optimizer_write": 12 * SHARD,
                    "grad_write": 4 * SHARD, "grad_read": 4 * SHARD,
                    "param_read": 2 * 2 * SHARD, "param_write": 2 * SHARD,
                    "read": 20 * SHARD, "write": 18 * SHARD, "total": 38 * SHARD}
    # 4 micro-batches: every sum goes out, 3 partial ones come back and the step's
    w4 = disk_bytes_per_step(replace(w, micro_batches=4), _off("nvme"))
    assert (w4["grad_write"], w4["grad_read"]) == (4 * 4 * SHARD, 4 * 4 * SHARD)
    # stage 1 accumulates in its device buffer: one shard out, one in
    w1 = disk_bytes_per_step(replace(w, micro_batches=4).with_stage(1), _off("nvme"))
    assert (w1["grad_write"], w1["grad_read"]) == (4 * SHARD, 4 * SHARD)
    rc = disk_bytes_per_step(replace(w, recompute=True), _off("nvme", "nvme"))
    assert rc["param_read"] == 3 * 2 * SHARD and rc["param_write"] == 2 * SHARD


def test_cpu_device_is_host_memory():
    """On a CPU the process's host bytes are the device's and the host's terms; at
    stages 2-3 the host step reads the gradient shard in place
    (hybrid/zero/offload/host_step.py)."""
    w = _small(device="cpu")
    est = tier_bytes(w, _off("cpu"), 0, 100)
    dev, host = est["terms"]["device"], est["terms"]["host"]
    assert host["grad_buffer"] == 0 and dev["grads"] == 4 * PSI // 3
    assert est["host_bytes"] == sum(dev.values()) + sum(host.values())
    assert est["device_bytes"] == sum(dev.values())
    # a separate buffer: at stage 1, and with the delayed update (which reads it while
    # the next step's gradients land)
    assert host_terms(w.with_stage(1), _off("cpu"))["grad_buffer"] == 4 * SHARD
    assert host_terms(w, _off("cpu", delayed_update=True))["grad_buffer"] == 4 * SHARD
    assert tier_bytes(w, _off("cpu", delayed_update=True))["terms"]["device"]["grads"] == \
        2 * 16_662 * 4
    assert host_terms(w, _off("cpu", "cpu"))["grad_buffer"] == 0
    # a GPU's host bytes are the host's terms only
    gpu = tier_bytes(replace(w, device="cuda"), _off("cpu"), 0, 100)
    assert gpu["host_bytes"] == sum(gpu["terms"]["host"].values())


def test_shortfalls_name_the_capacity_and_the_bytes():
    est = {"device_bytes": 10, "host_bytes": 30, "disk_bytes": 50}
    assert shortfalls(est, Capacity()) == []
    short = shortfalls(est, Capacity(device_bytes=9, host_bytes=60, nvme_bytes=99,
                                     ranks_per_node=2))
    assert short == [{"capacity": "device", "need_bytes": 10, "have_bytes": 9,
                      "short_by_bytes": 1},
                     {"capacity": "nvme", "need_bytes": 100, "have_bytes": 99,
                      "short_by_bytes": 1}]


def test_ladder_stages_and_order():
    w = _small(zero_stage=1)
    assert [setting_name(*s) for s in LADDER] == [
        "none", "optimizer cpu", "optimizer cpu + param cpu", "optimizer nvme + param cpu",
        "optimizer nvme + param nvme"]
    assert [rung_workload(w, *s).zero_stage for s in LADDER] == [1, 1, 3, 3, 3]
    assert rung_workload(w.with_stage(0), "cpu", None).zero_stage == 1
    rungs = offload_ladder(w, _off(), Capacity())
    assert all(r["fits"] for r in rungs) and recommend_offload(rungs)["setting"] == "none"


# -- the script --------------------------------------------------------------------------

# A 2.42B-parameter GPT-2 (20 layers x 3072, 24 heads, GPT-2's vocabulary padded to
# 50,304): 20 x 113,305,600 + 157,288,448 = 2,423,408,640 parameters.
BIG = ["--num-layers", "20", "--hidden-size", "3072", "--num-attention-heads", "24",
       "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "2",
       "--global-batch-size", "4", "--bf16", "--hidden-dropout", "0", "--attention-dropout",
       "0", "--tokenizer-type", "gpt2bpe", "--world-size", "2", "--zero-stage", "3",
       "--device", "cpu"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--world-size", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "estimate_memory", os.path.join(ROOT, "scripts", "estimate_memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(script, capsys, argv):
    capsys.readouterr()
    assert script.main(argv) == 0
    return capsys.readouterr().out


def _records(script, capsys, argv):
    return [json.loads(line) for line in _run(script, capsys, argv).splitlines()]


def _by_key(records, key):
    return [r for r in records if key in r]


def test_big_gpt_at_dp2_needs_the_nvme_optimizer_tier(script, capsys):
    records = _records(script, capsys, BIG + ["--host-memory-gb", "24", "--nvme-gb", "70"])
    assert records[0]["params_per_tp_rank"] == 2_423_408_640
    rungs = _by_key(records, "offload_rung")
    # (with its gradients on disk too, the nvme optimizer leaves room for host param homes)
    assert [r["fits"] for r in rungs] == [False, False, False, True, True]
    best = _by_key(records, "recommended_offload")[-1]
    assert (best["recommended_offload"], best["optimizer"], best["param"], best["zero_stage"],
            best["ranks_per_node"]) == ("optimizer nvme + param cpu", "nvme", "cpu", 3, 2)
    # every cheaper setting says why: the host memory of the node's two ranks
    why = best["why_not"]
    assert list(why) == [r["setting"] for r in rungs[:3]]
    for r in rungs[:3]:
        (short,) = [s for s in why[r["setting"]] if s["capacity"] == "host"]
        assert short["need_bytes"] == 2 * r["host_bytes"]
        assert short["short_by_bytes"] == 2 * r["host_bytes"] - 24 * GIB > 0
    nvme = rungs[4]
    assert 2 * nvme["host_bytes"] <= 24 * GIB and 2 * nvme["disk_bytes"] <= 70 * GIB
    # the disk: 12 bytes per shard element in whole tiles of 2^23, their fp32 gradient
    # slots, and a bf16 shard
    shard = 2_423_408_640 // 2
    tiles = -(-shard // (1 << 23))
    assert nvme["terms"]["disk"] == {"optimizer_swap": 12 * tiles * (1 << 23),
                                     "grad_swap": 4 * tiles * (1 << 23),
                                     "param_swap": 2 * shard}
    assert nvme["disk_bytes_per_step"]["total"] == (24 + 2 * 4 + 2 * 2 + 2) * shard
    assert nvme["pcie_bytes_per_step"]["total"] == 0  # --device cpu: no PCIe


def test_tiny_gpt_needs_no_offload(script, capsys):
    records = _records(script, capsys, TINY + ["--host-memory-gb", "24", "--nvme-gb", "70"])
    best = _by_key(records, "recommended_offload")[-1]
    assert (best["recommended_offload"], best["optimizer"], best["param"]) == ("none", None,
                                                                              None)
    assert best["why_not"] == {}


def test_output_has_the_three_byte_counts_and_the_traffic(script, capsys):
    argv = [a for a in BIG if a not in ("--device", "cpu")] + [
        "--offload-optimizer", "nvme", "--offload-param", "nvme", "--gpu-memory-gb", "80"]
    records = _records(script, capsys, argv)
    (own,) = _by_key(records, "offload")
    est = own["offload"]
    assert (est["optimizer"], est["param"], est["zero_stage"]) == ("nvme", "nvme", 3)
    for key in ("device_bytes", "host_bytes", "disk_bytes"):
        assert est[key] == sum(est["terms"][key.split("_")[0]].values()) > 0
    shard = 2_423_408_640 // 2
    # gradients down (fp32), the shard up for 2 gathers (bf16); on the GPU's host only
    assert est["pcie_bytes_per_step"] == {"grads_down": 4 * shard, "grads_up": 0, "params_up": 0,
                                          "param_gathers_up": 2 * 2 * shard,
                                          "total": 8 * shard}
    assert est["disk_bytes_per_step"]["read"] == (12 + 4 + 4) * shard
    assert est["disk_bytes_per_step"]["write"] == (12 + 4 + 2) * shard
    assert "recommended_zero_stage" in records[-1]  # the last line, as before
    text = _run(script, capsys, argv + ["--format", "text"])
    assert "this run's offload: optimizer nvme + param nvme at ZeRO-3" in text
    for word in (f"device {est['device_bytes'] / GIB:.2f} GiB ({est['device_bytes']:,} B)",
                 f"host   {est['host_bytes'] / GIB:.2f} GiB ({est['host_bytes']:,} B)",
                 f"disk   {est['disk_bytes'] / GIB:.2f} GiB ({est['disk_bytes']:,} B)",
                 f"grads down {4 * shard:,} B", f"gathers up {4 * shard:,} B",
                 f"disk read {20 * shard / GIB:.2f} GiB ({20 * shard:,} B)"):
        assert word in text, word


def test_too_small_a_disk_says_which_capacity_is_short(script, capsys):
    argv = BIG + ["--host-memory-gb", "24", "--nvme-gb", "20"]
    records = _records(script, capsys, argv)
    best = _by_key(records, "recommended_offload")[-1]
    assert best["recommended_offload"] is None and len(best["why_not"]) == 5
    last = _by_key(records, "offload_rung")[-1]
    assert best["why_not"]["optimizer nvme + param nvme"] == [{
        "capacity": "nvme", "need_bytes": 2 * last["disk_bytes"], "have_bytes": 20 * GIB,
        "short_by_bytes": 2 * last["disk_bytes"] - 20 * GIB}]
    text = _run(script, capsys, argv + ["--format", "text"])
    short = 2 * last["disk_bytes"] - 20 * GIB
    assert f"recommended offload: none fits; even the last: nvme short by {short:,} B" in text


def test_nvme_offload_flags_validate_without_a_path(script, capsys):
    """--offload-optimizer nvme needs --offload-nvme-path to train, not to estimate; the
    project's own checks still apply (param offload is stage 3's)."""
    records = _records(script, capsys, TINY + ["--zero-stage", "3", "--offload-optimizer",
                                               "nvme", "--offload-param", "cpu"])
    (own,) = _by_key(records, "offload")
    assert own["offload"]["setting"] == "optimizer nvme + param cpu"
    with pytest.raises(SystemExit):
        script.main(TINY + ["--zero-stage", "2", "--offload-optimizer", "--offload-param",
                            "cpu"])
    assert "needs --zero-stage 3" in capsys.readouterr().err


def test_largest_fitting_bisects_to_the_last_size_that_fits():
    """What bench_offload.py --largest sizes a model with: exact at every cut, 0 when
    nothing fits, the limit when everything does, in O(log n) estimates."""
    for cut in (0, 1, 2, 3, 7, 100, 1000, 4096):
        calls = []
        assert largest_fitting(lambda n, calls=calls, cut=cut: calls.append(n) or n <= cut) == cut
        assert len(calls) <= 2 * max(1, cut).bit_length() + 2, (cut, calls)
    assert largest_fitting(lambda n: True, limit=50) == 50
