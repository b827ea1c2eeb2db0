"""Example model factories for ``--model module:callable``, used by the tests and the docs.

Try ``poet solve --model host.graph.examples:small_cnn --input-shape 4,3,16,16`` (a bare module) or
``poet solve --model host.graph.examples:bundle_with_custom_loss`` (a complete bundle; also
``small_cnn_images``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from host.graph.zoo import ModelBundle


def small_cnn() -> nn.Module:
    """A bare module (so ``--input-shape`` is required): 3-channel images of any size -> 10 classes.

    Two conv layers with BatchNorm, a max-pool and global average pooling; e.g. input 4,3,16,16.
    """
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def bundle_with_custom_loss() -> ModelBundle:
    """A complete bundle with its own batch and loss: regression of 16 features to 1 value with MSE.

    Inputs and targets come from the global torch RNG, which ``load_factory_bundle`` seeds.
    """
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    inputs = torch.randn(8, 16)
    targets = torch.randn(8, 1)
    return ModelBundle(name="regression_mlp", module=module, inputs=(inputs,), labels=targets, loss_fn=F.mse_loss)


def small_cnn_images() -> ModelBundle:
    """:func:`small_cnn` as a complete bundle: a batch of 8 RGB 32x32 images, 10 classes, cross-entropy.

    What ``bench/calibration.py`` predicts after calibrating on other models (a board needs no data: the
    fleet trains it on the reserved ``:synthetic`` dataset of this shape).
    """
    from host.graph.zoo import default_loss, seeded_labels

    module = small_cnn()
    inputs = torch.randn(8, 3, 32, 32)
    return ModelBundle(name="small_cnn_images", module=module, inputs=(inputs,), labels=seeded_labels((8, 10), 0),
                       loss_fn=default_loss)


def tiny_mlp() -> ModelBundle:
    """A 16 -> 16 -> ReLU -> 4 classifier, batch 4: 340 parameters, for a microcontroller's link at its worst
    (`poet mcu run --model host.graph.examples:tiny_mlp --link-corrupt 1%`)."""
    from host.graph.zoo import default_loss, seeded_labels

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return ModelBundle(name="tiny_mlp", module=module, inputs=(torch.randn(4, 16),), labels=seeded_labels((4, 4), 0),
                       loss_fn=default_loss)
