"""The transforms the examples use, on a uint8 ``(H, W, C)`` array or a ``(C, H, W)``
float tensor."""

import numpy as np
import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """uint8 ``(H, W, C)`` -> float ``(C, H, W)`` in [0, 1]; a float tensor (an image
    ``Resize`` or ``CenterCrop`` already made one) as it is."""

    def __call__(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x))
        return x.permute(2, 0, 1).float().div(255)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


def _chw(x):
    if isinstance(x, np.ndarray):
        return ToTensor()(x)
    return x


class Resize:
    """The shorter side to ``size`` (bilinear), the aspect kept."""

    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        x = _chw(x)
        h, w = x.shape[-2:]
        s = self.size / min(h, w)
        out = (round(h * s), round(w * s))
        return F.interpolate(x[None], size=out, mode="bilinear", align_corners=False)[0]


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        x = _chw(x)
        h, w = x.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., top:top + self.size, left:left + self.size]
