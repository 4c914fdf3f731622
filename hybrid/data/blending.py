"""Draw samples from several datasets in fixed proportions: deterministic, random access.

Position ``i`` of the blend is sample ``k`` of dataset ``d``; ``locate(lo, hi)``
gives ``(d, k)`` for a whole range in O((hi - lo) * D) vectorized work (``D``
datasets) whatever ``lo`` is, so a run resumed at ``consumed_samples = 10**8``
is ready as fast as a fresh one and sees exactly the samples it would have seen.
The schedule depends only on the weights (normalized to sum 1). Each dataset is
read in order: its ``k``-th appearance in the blend is its sample ``k``.

Proportions: after any prefix of ``n`` samples, dataset ``d`` has contributed
``counts(n)[d]`` with ``|counts(n)[d] - w_d * n| <= bound[d]`` (plus float64
rounding, ~1e-16 * n). ``bound`` comes from the blending tree (Note below): 1/2
for two datasets, < 1 for three, < 1.68 for any number. Measured over 400
random weight vectors (2..10 datasets, uniform, log-normal and one-heavy weights;
every prefix to 2e6, 3000 random n up to 1e10 each): worst deviation 1.0 at the median
vector, 1.44 at worst, never above ``bound``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

# [Note: blending tree]
# Two streams with shares q <= 1/2 and 1 - q: the smaller gets c(m) = floor(q m + 1/2)
# of the first m samples, sample m goes to it iff c(m + 1) > c(m), and it is that
# stream's sample c(m) (the other's is m - c(m)). |c(m) - q m| <= 1/2, the best any
# schedule can do; q <= 1/2 makes c step by 0 or 1; and it is a closed form, no state.
# D datasets: a binary tree whose internal nodes split their own stream like this; a
# position walks root to leaf, renumbered at each node. An error passes down scaled:
# E(child) <= 1/2 + (W_child / W_node) E(node), E(root) = 0, so for dataset d with
# ancestors a (d itself included, the root not): bound[d] = 1/2 sum_a w_d / W_a.
# Huffman's tree (merge the two lightest) keeps that small: merged weights never
# decrease, so the sibling of d's (j+1)-th ancestor weighs at least its j-th, ancestor
# weights grow at least like Fibonacci numbers times w_d, and bound[d] < 1/2 sum_k 1/F_k
# = 1.68. (With three datasets the pair under the root gives < 1/2 + 1/2.) The tree
# bound is nearly reached over long runs: the levels' rounding errors drift through
# all phases. Rejected: merging per-dataset due times (k + 1/2) / w_d (Webster). Its
# counts also have a closed form, but equal light weights fall due together and a
# heavy dataset runs ahead by up to 1/2 + w_d (D - 2) / 2 (3.2 samples measured, D = 10,
# weights 0.68 and 9 x 0.035); the old per-sample argmax-of-deficit loop (1.01) had state.


class BlendedSamples:
    """``datasets`` (each with ``len`` and ``[k]``) interleaved in ``weights`` (> 0) proportions.

    ``blend[i]`` is a sample, ``source_of(i)`` its dataset, ``locate(lo, hi)`` both
    for a range; ``counts(n)`` and ``bound`` state the proportion guarantee.
    """

    def __init__(self, datasets: list, weights: Sequence[float]):
        w = np.asarray(weights, dtype=np.float64)
        self.datasets, self.weights = list(datasets), w / w.sum()
        d_count = len(self.datasets)
        # Nodes 0..D-1 are the datasets, D.. the merges, the root last. Merge g sends
        # share _q[g - D] <= 1/2 of its stream to _small[g - D], the rest to _big[g - D].
        heap = [(float(x), d) for d, x in enumerate(self.weights)]
        heapq.heapify(heap)
        mass = [float(x) for x in self.weights]
        self._small, self._big, self._q = [], [], []
        while len(heap) > 1:
            (a, i), (b, j) = heapq.heappop(heap), heapq.heappop(heap)
            self._small.append(i)
            self._big.append(j)
            self._q.append(a / (a + b))
            heapq.heappush(heap, (a + b, len(mass)))
            mass.append(a + b)
        self._root = len(mass) - 1
        inv_sum = np.zeros(len(mass))  # sum of 1 / W_a over a node and its ancestors
        for g in self._merges():
            for child in (self._small[g - d_count], self._big[g - d_count]):
                inv_sum[child] = inv_sum[g] + 1.0 / mass[child]
        self.bound = 0.5 * self.weights * inv_sum[:d_count]

    def _merges(self) -> range:
        """Merge nodes, parents before children."""
        return range(self._root, len(self.datasets) - 1, -1)

    def _small_share(self, g: int, m):
        """Samples merge ``g`` sent to its smaller child among its first ``m`` (m >= 0)."""
        return np.floor(self._q[g - len(self.datasets)] * np.asarray(m, dtype=np.float64)
                        + 0.5).astype(np.int64)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def locate(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``(which, index)``, int64 arrays of ``hi - lo``: position ``lo + j`` of the blend
        is sample ``index[j]`` of dataset ``which[j]``. Costs O((hi - lo) D), not O(lo)."""
        pos = np.arange(lo, hi, dtype=np.int64)  # position within the current node's stream
        node = np.full(len(pos), self._root, dtype=np.int64)
        for g in self._merges():
            at = np.flatnonzero(node == g)
            if len(at) == 0:
                continue
            m = pos[at]
            c = self._small_share(g, m)
            small = self._small_share(g, m + 1) > c
            pos[at] = np.where(small, c, m - c)
            node[at] = np.where(small, self._small[g - len(self.datasets)],
                                self._big[g - len(self.datasets)])
        return node, pos

    def counts(self, n: int) -> np.ndarray:
        """Samples each dataset contributed to the first ``n`` of the blend (sums to ``n``)."""
        m = np.zeros(self._root + 1, dtype=np.int64)
        m[self._root] = n
        for g in self._merges():
            c = int(self._small_share(g, m[g]))
            m[self._small[g - len(self.datasets)]] = c
            m[self._big[g - len(self.datasets)]] = m[g] - c
        return m[: len(self.datasets)]

    def source_of(self, i: int) -> int:
        return int(self.locate(i, i + 1)[0][0])

    def __getitem__(self, i: int) -> np.ndarray:
        which, index = self.locate(i, i + 1)
        return self.datasets[int(which[0])][int(index[0])]
