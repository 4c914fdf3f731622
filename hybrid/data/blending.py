"""Draw samples from several datasets in fixed proportions, deterministically.

Sample ``i`` of the blend goes to the dataset whose share is furthest behind
its target: ``argmax_d (w_d * (i + 1) - drawn_d)`` (ties to the lowest index).
After any prefix of ``n`` samples each dataset has been drawn within one
sample of ``w_d * n``, so proportions hold at every scale, and the assignment
depends only on the weights.
"""

from __future__ import annotations

import numpy as np

_BLOCK = 1 << 14


class BlendedSamples:
    def __init__(self, datasets: list, weights: list[float]):
        w = np.asarray(weights, dtype=np.float64)
        self.datasets, self.weights = datasets, w / w.sum()
        self._which = np.zeros(0, dtype=np.int32)  # dataset of each blended sample
        self._index = np.zeros(0, dtype=np.int64)  # its index inside that dataset
        self._drawn = np.zeros(len(datasets), dtype=np.int64)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def _extend(self, upto: int) -> None:
        while len(self._which) <= upto:
            start = len(self._which)
            which = np.empty(_BLOCK, dtype=np.int32)
            index = np.empty(_BLOCK, dtype=np.int64)
            for k in range(_BLOCK):
                d = int(np.argmax(self.weights * (start + k + 1) - self._drawn))
                which[k], index[k] = d, self._drawn[d]
                self._drawn[d] += 1
            self._which = np.concatenate([self._which, which])
            self._index = np.concatenate([self._index, index])

    def source_of(self, i: int) -> int:
        self._extend(i)
        return int(self._which[i])

    def __getitem__(self, i: int) -> np.ndarray:
        self._extend(i)
        return self.datasets[int(self._which[i])][int(self._index[i])]
