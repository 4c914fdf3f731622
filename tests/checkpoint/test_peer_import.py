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
    frozen_shapes: dict = {}  # (a GPT: nothing frozen, no buffers)
    excludes_frozen = False

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

    def untrained(self):
        return {}

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


class SlowPeer(FakePeer):
    """A peer whose every read takes 0.3 s: 9 reads outlast a 2 s collective timeout."""

    def __init__(self, path):
        super().__init__(path)
        self.shapes = {f"blocks.{i}.ln_1.weight": [4] for i in range(9)}
        g = torch.Generator().manual_seed(1)
        self.values = {n: {c: torch.randn(s, generator=g) for c in self.columns}
                       for n, s in self.shapes.items()}

    def read(self, name):
        import time
        time.sleep(0.3)
        return super().read(name)


def _import_slowly(ps, peer_dir, save):
    from hybrid.checkpoint.peers import importing
    waits = []
    real = importing.ImportWait

    class Counted(real):
        def __init__(self, ps):
            super().__init__(ps)
            waits.append(self)
    importing.ImportWait = Counted
    importing.open_peer = lambda path, fmt, step: SlowPeer(path)
    try:
        got = import_for_load(peer_dir, save, ps, {}, 10, "deepspeed")
    finally:
        importing.ImportWait = real
    return got, waits[0].rounds, waits[0].every_s


def test_an_import_longer_than_the_collective_timeout_keeps_the_other_ranks_waiting(tmp_path):
    """[Note: waiting for an import of any size]: rank 0's import takes 2.7 s, the
    collectives time out at 2 s; rank 1 waits through short rounds (every 0.5 s of the
    import) and both ranks get the import."""
    from tests.helpers.harness import run_ranks
    peer_dir, save = str(tmp_path / "peer"), str(tmp_path / "save")
    os.makedirs(peer_dir)
    out = run_ranks(_import_slowly, world_size=2, args=(peer_dir, save), collective_timeout=2)
    assert [o[0] for o in out] == [(save, 7), (save, 7)]
    assert out[0][1] == out[1][1] >= 5 and out[0][2] == 0.5  # paired rounds, 1 per 0.5 s
    _, state = merged_state(os.path.join(save, "iter_0000007"))
    assert sorted(state) == sorted(SlowPeer(peer_dir).shapes)
