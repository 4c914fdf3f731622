"""Checkpoints written in format 2 (interleaved [master, exp_avg, exp_avg_sq] rows)
still load: same layout bit-exact, resharded, weights only, and through the tools.
The 4-process session that writes and reads them is tests/helpers/checkpoint_io_session.py.
"""

import os

import pytest

from tests.helpers.checkpoint_io_session import (
    IO_VOCAB,
    _check_reshard,
    _old_full_tensors,
    _own_file_bytes,
    _rows,
)
from tests.helpers.launch import script_module


def test_format_2_loads_exactly_in_the_same_layout(io_session):
    """A format-2 checkpoint (the test's rewrite of ``a``: the same values, interleaved)
    in the same layout: each rank opens latest, the metadata, its own header and data
    file only, reads its own files once, and gets back bit-exactly the master and
    moments it saved, step and RNG included. Weights only (--finetune): the same data
    file, no header, and -- rows being interleaved -- all 12 bytes of each of its rows,
    of which it keeps the master."""
    import torch
    root, results = io_session
    ckpt, ckpt2 = (os.path.join(root, n, "iter_0000002") for n in ("a", "a2"))
    _, old = _old_full_tensors(ckpt)
    _, old2 = _old_full_tensors(ckpt2)
    assert old.keys() == old2.keys()
    assert all(torch.equal(old[n][0], old2[n][0]) for n in old)
    meta_bytes = os.path.getsize(os.path.join(ckpt2, "metadata.json"))
    for r, out in enumerate(results):
        with open(os.path.join(ckpt, f"rank_{r:05d}.bin"), "rb") as f3, \
                open(os.path.join(ckpt2, f"rank_{r:05d}.bin"), "rb") as f2:
            b3, b2 = f3.read(), f2.read()
        assert len(b3) == len(b2) and b3 != b2  # really another byte order
        s, got, w = out["saved"], out["v2_same"], out["v2_weights"]
        assert "error" not in got, got
        own = {f"iter_0000002/rank_{r:05d}.pt", f"iter_0000002/rank_{r:05d}.bin"}
        assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json", *own])
        assert got["bytes"] == meta_bytes + _own_file_bytes(ckpt2, r)
        assert got["pieces"] == s["pieces"]
        assert torch.equal(got["values"], s["values"])
        assert got["step"] == 2 and not got["rng_kept"]
        assert "error" not in w, w
        assert sorted(w["opened"]) == sorted(["latest", "iter_0000002/metadata.json",
                                              f"iter_0000002/rank_{r:05d}.bin"])
        assert w["bytes"] == meta_bytes + 12 * _rows(ckpt2, r)
        assert torch.equal(w["values"][:, 0], s["values"][:, 0])
        assert not w["values"][:, 1:].any() and w["step"] == 0 and w["rng_kept"]


@pytest.mark.parametrize("case,master_only", [("v2_tp1dp4", False),
                                              ("v2_weights_tp4dp1", True)])
def test_format_2_reshards_exactly(io_session, case, master_only):
    """Format 2 into TP1 x DP4 ZeRO-1 (master and moments) and, weights only, into
    TP4 x DP1 ZeRO-0: the old full tensors' cut to the bit (read from the interleaved
    files by the test), only the data files holding the rank's elements opened, at
    most 2x the interleaved rows needed read."""
    root, results = io_session
    for r, out in enumerate(results):
        _check_reshard(os.path.join(root, "a2", "iter_0000002"), out[case], r, header=False,
                       master_only=master_only)


def test_tools_read_format_2(io_session, tmp_path):
    """merged_state, convert_checkpoint.py --with-optimizer, generate.py's model and
    export_hf.py on the format-2 copy give the format-3 original's values, to the bit."""
    import torch

    from hybrid.checkpoint import merged_state
    root = io_session[0]
    _, full = merged_state(os.path.join(root, "a", "iter_0000002"))
    _, v2 = merged_state(os.path.join(root, "a2", "iter_0000002"))
    assert v2.keys() == full.keys()
    for name, s in v2.items():
        assert s.keys() == full[name].keys()
        assert all(torch.equal(s[k], full[name][k]) for k in s), name
    out = str(tmp_path / "merged.pt")
    assert script_module("convert_checkpoint").main([os.path.join(root, "a2"), out,
                                               "--with-optimizer"]) == 0
    merged = torch.load(out)
    for name, s in full.items():
        assert torch.equal(merged["model"][name], s["master"])
        assert torch.equal(merged["optimizer"][name]["exp_avg_sq"], s["exp_avg_sq"])
    model, _ = script_module("generate").load_model(os.path.join(root, "a2", "iter_0000002"), "cpu")
    for name, p in model.named_parameters():  # the embedding: its real vocabulary rows
        cut = slice(IO_VOCAB if name == "wte.weight" else None)
        assert torch.equal(p.detach()[cut], full[name]["master"][cut]), name
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    hf = str(tmp_path / "hf")
    assert script_module("export_hf").main([os.path.join(root, "a2"), hf]) == 0
    wte = load_file(os.path.join(hf, "model.safetensors"))["transformer.wte.weight"]
    assert torch.equal(wte, full["wte.weight"]["master"][: wte.shape[0]])
