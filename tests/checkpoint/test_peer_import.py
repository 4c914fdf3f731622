"""The import of another framework's checkpoint (hybrid/checkpoint/peers/importing.py),
with a stand-in reader: what it yields is what the hybrid checkpoint holds, bit for bit
(masters, both moments, step, iteration, consumed samples); one parameter is asked for
at a time, once; a reader's error leaves --save without a checkpoint; a second import of
the same checkpoint reuses the first, another one's is refused; --load equal to --save
and no --save are refused by name."""

from __future__ import annotations

import os

import pytest
import torch

from hybrid.checkpoint import merged_state
from hybrid.checkpoint.peers.importing import import_for_load, import_peer
from hybrid.errors import CheckpointError
from hybrid.parallel.state import ParallelState


class FakePeer:
    format = "fake"

    def __init__(self, path, fail_on=None):
        g = torch.Generator().manual_seed(0)
        self.path, self.fail_on, self.asked = path, fail_on, []
        self.iteration, self.consumed_samples, self.step = 7, 56, 7
        self.shapes = {"wte.weight": [10, 4], "blocks.0.mlp.fc.weight": [2, 6, 4],
                       "ln_f.bias": [4]}
        self.columns = ("master", "exp_avg", "exp_avg_sq")
        self.flags, self.vocab_size = {"hidden_size": 4}, 10
        self.notes = ["the data position: another data pipeline"]
        self.values = {n: {c: torch.randn(s, generator=g) for c in self.columns}
                       for n, s in self.shapes.items()}

    def configure(self, config):
        pass

    def read(self, name):
        self.asked.append(name)
        if name == self.fail_on:
            raise CheckpointError(f"{self.path}/part.bin: truncated")
        return self.values[name]

    def close(self):
        pass


def test_the_import_holds_the_peers_values_exactly(tmp_path, caplog):
    peer = FakePeer(str(tmp_path / "peer"))
    out = import_peer(peer, str(tmp_path / "save"), {"num_layers": 1}, None)
    assert out == str(tmp_path / "save" / "iter_0000007")
    assert peer.asked == list(peer.shapes)  # one parameter at a time, each once
    meta, state = merged_state(out)
    assert (meta["iteration"], meta["consumed_samples"], meta["step"]) == (7, 56, 7)
    assert meta["config"] == {"num_layers": 1, "hidden_size": 4} and meta["vocab_size"] == 10
    assert meta["imported_from"]["not_carried"] == peer.notes
    assert "another data pipeline" in caplog.text
    for n, cols in peer.values.items():
        for c, t in cols.items():
            assert torch.equal(state[n][c], t), (n, c)


def test_a_failed_import_writes_nothing_and_a_second_reuses_the_first(tmp_path, monkeypatch):
    ps = ParallelState.single()
    save = tmp_path / "save"
    bad = FakePeer(str(tmp_path / "peer"), fail_on="ln_f.bias")
    with pytest.raises(CheckpointError, match="part.bin: truncated"):
        import_peer(bad, str(save), {}, None)
    assert os.listdir(save) == []  # not even the temporary
    (tmp_path / "peer").mkdir()
    opened = []

    def open_peer(path, fmt, step):
        opened.append(path)
        return FakePeer(path)

    monkeypatch.setattr("hybrid.checkpoint.peers.importing.open_peer", open_peer)
    peer_dir = str(tmp_path / "peer")
    assert import_for_load(peer_dir, str(save), ps, {}, 10, "deepspeed") == (str(save), 7)
    # a restart finds its import and reads nothing of the peer (opened for its iteration):
    # the load takes --save's newest, which may be a later save of the run
    assert import_for_load(peer_dir, str(save), ps, {}, 10, "deepspeed") == (str(save), None)
    assert opened == [peer_dir, peer_dir]
    other = str(tmp_path / "other")
    os.makedirs(other)
    with pytest.raises(CheckpointError, match="already holds iter_0000007, not imported from"):
        import_for_load(other, str(save), ps, {}, 10, "deepspeed")
    with pytest.raises(CheckpointError, match="is also --save"):
        import_for_load(peer_dir, peer_dir, ps, {}, 10, "deepspeed")
    with pytest.raises(CheckpointError, match="give --save"):
        import_for_load(peer_dir, None, ps, {}, 10, "deepspeed")
    assert import_for_load(peer_dir, str(save), ps, {}, 10, "hybrid") is None
