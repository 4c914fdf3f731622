"""``CIFAR10``: synthetic CIFAR-10 of the real one's shape (see the package docstring)."""

import os

import numpy as np


class CIFAR10:
    """Images ``(32, 32, 3)`` uint8 and labels in 0..9, each drawn from its index (and the
    split), so every rank and both runs see the same data."""

    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        size = int(os.environ.get("EXAMPLE_CIFAR_SIZE", "320"))
        self.size = size if train else max(4, size // 10)
        self.offset = 0 if train else 1 << 20
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = np.random.default_rng(self.offset + index)
        image = g.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        label = index % 10  # every class in any ten in a row (the test split is scored per class)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return image, label
