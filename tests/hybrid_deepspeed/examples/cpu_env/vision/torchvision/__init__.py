"""A stand-in for the parts of torchvision the DeepSpeedExamples scripts use, for a
CPU-only machine: the same under DeepSpeed and under hybrid, so their runs compare.

``datasets.CIFAR10``: synthetic images of CIFAR-10's shape (32 x 32 RGB, uint8) and
labels, drawn from the index (``$EXAMPLE_CIFAR_SIZE`` training images, default 320; a
tenth of that for the test split), never downloaded. ``transforms``: ``Compose``,
``ToTensor``, ``Normalize``, ``Resize``, ``CenterCrop`` on tensors. ``models.AlexNet``:
the AlexNet torchvision builds (the layers in the same order and shapes).
"""

from torchvision import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
