"""The nvme tier's read-ahead of a step's first tiles (hybrid/zero/offload/nvme/tiles.py,
[Note: reading ahead of the step]): the states a prefetched step updates are bit for bit
the states it reads itself, a skipped step keeps the prefetch for the next, and whatever
writes the file outside a step lets it go."""

from __future__ import annotations

import torch

from hybrid.kernels.aio import AsyncIO
from hybrid.zero.offload.nvme.swap import SwapSpace
from hybrid.zero.offload.nvme.tiles import FILE, SwappedStates

TILE, N, BUFFERS = 256, 5 * 256 - 17, 3  # five tiles, the last one short


def _states(root: str) -> tuple[SwappedStates, list]:
    io = AsyncIO(threads=2)
    space = SwapSpace(root, 0, {FILE: SwappedStates.space_for(N, TILE)})
    st = SwappedStates(N, TILE, space, io, buffers=BUFFERS)
    st.fill(lambda lo, hi, dst: dst.copy_(torch.arange(lo, hi, dtype=torch.float32) / 7))
    reads: list = []  # the offsets of every read of the states file
    read = io.read

    def counted(file, offset, dst):
        if file is st.file:
            reads.append(offset)
        return read(file, offset, dst)
    io.read = counted  # type: ignore[method-assign]
    return st, reads


def _step(st: SwappedStates, order=None) -> None:
    """A stand-in update, elementwise like AdamW: each tile's states from their own."""
    for t in st.each(order):
        t.exp_avg.mul_(0.9).add_(t.master, alpha=0.1)
        t.exp_avg_sq.mul_(0.99).addcmul_(t.master, t.master, value=0.01)
        t.master.sub_(t.exp_avg / (t.exp_avg_sq.sqrt() + 1e-8), alpha=1e-3)


def _planes(st: SwappedStates) -> list[torch.Tensor]:
    return [st.read_range(key, 0, N) for key in ("master", "exp_avg", "exp_avg_sq")]


def _close(st: SwappedStates) -> None:
    st.close()
    st.space.close()
    st.io.close()


def test_a_prefetched_step_is_the_step_bit_for_bit(tmp_path):
    plain, _ = _states(str(tmp_path / "plain"))
    early, reads = _states(str(tmp_path / "early"))
    try:
        for _ in range(2):
            _step(plain)
        reads.clear()
        early.prefetch()
        early.prefetch()  # (already on their way: nothing more)
        assert len(reads) == BUFFERS - 1
        _step(early)  # reads each tile's states once: C - 1 of them were read ahead
        assert sorted(reads) == [early._offset(k) for k in range(early.tiles)]
        early.prefetch()
        # a skipped step updates nothing: the read-ahead stays for the next step
        reads.clear()
        early.prefetch()
        assert reads == []
        _step(early)
        for a, b in zip(_planes(plain), _planes(early)):
            assert torch.equal(a, b)
    finally:
        _close(plain)
        _close(early)


def test_writes_outside_a_step_and_another_order_let_the_read_ahead_go(tmp_path):
    st, _ = _states(str(tmp_path))
    try:
        st.prefetch()
        st.write_range("master", 0, N, torch.full((N,), 3.0))  # (a checkpoint load)
        seen = []
        for t in st.each():
            seen.append(t.master.clone())
        assert all(bool((m == 3.0).all()) for m in seen)  # not the values read ahead
        st.prefetch()
        order = list(range(st.tiles - 1, -1, -1))  # last to first: other buffers
        got = {t.k: t.master.clone() for t in st.each(order)}
        assert all(bool((m == 3.0).all()) for m in got.values())
        assert sorted(got) == list(range(st.tiles))
    finally:
        _close(st)
