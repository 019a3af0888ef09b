"""Models for the torch examples and benchmarks: ResNet-18/50 and a plain MLP.

The ResNets follow the layout of He et al., "Deep Residual Learning for Image
Recognition" (2015): a 7x7 stem, four stages of residual blocks, global average
pooling and one linear classifier.  ResNet-50 uses bottleneck blocks with the
stride on the 3x3 convolution ("ResNet v1.5"), which is what most frameworks
benchmark.  ResNet-50 has 161 parameter tensors (25.6 M parameters, about
97.5 MiB in float32); the benchmarks check this.

Only torch is needed: nothing here talks to hora, so the benchmarks can import
this module to get the gradient shapes before any engine exists.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias (a BatchNorm follows)."""
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution with no bias (a BatchNorm follows)."""
    return nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = _conv3x3(in_ch, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _projection(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, plus shortcut."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = _conv1x1(in_ch, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, out_ch)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _projection(in_ch, out_ch, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Bottleneck residual block."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


def _projection(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    """Shortcut: identity when shapes match, else a strided 1x1 conv and BatchNorm."""
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(_conv1x1(in_ch, out_ch, stride), nn.BatchNorm2d(out_ch))


class ResNet(nn.Module):
    """ImageNet-style ResNet: stem, four stages, global pooling, classifier.

    Args:
        block: ``BasicBlock`` or ``Bottleneck``.
        depths: number of blocks in each of the four stages.
        num_classes: size of the classifier output.
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], depths: tuple[int, int, int, int],
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        stages = []
        in_ch = 64
        for i, (width, depth) in enumerate(zip((64, 128, 256, 512), depths, strict=True)):
            blocks = []
            for j in range(depth):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(in_ch, width, stride))
                in_ch = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """He init for convolutions; zero the last BatchNorm of each block so it starts as identity."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)
            elif isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(N, 3, H, W)`` to logits ``(N, num_classes)``."""
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18: basic blocks, stage depths 2-2-2-2."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50: bottleneck blocks, stage depths 3-4-6-3."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes)


class MLP(nn.Module):
    """Fully connected ReLU network, e.g. ``MLP((784, 1024, 1024, 10))``.

    Inputs of any shape ``(N, ...)`` are flattened to ``(N, sizes[0])``.
    """

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output size, got sizes={sizes}")
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU(inplace=True))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flatten and apply the layers."""
        return self.net(torch.flatten(x, 1))


#: Names accepted by :func:`build_model`.
MODEL_NAMES = ("resnet50", "resnet18", "mlp")


def build_model(name: str, num_classes: int = 1000, image_size: int = 224) -> nn.Module:
    """Build a model by name.

    Args:
        name: one of :data:`MODEL_NAMES`.
        num_classes: classifier output size.
        image_size: side of the square RGB input; the MLP takes ``3 * image_size**2`` inputs.

    Raises:
        ValueError: unknown model name.
    """
    if name == "resnet50":
        return resnet50(num_classes)
    if name == "resnet18":
        return resnet18(num_classes)
    if name == "mlp":
        return MLP((3 * image_size * image_size, 1024, 1024, num_classes))
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
