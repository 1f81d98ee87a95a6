"""Small CNNs with BatchNorm and pooling, in a few shapes: a VGG-style stack and a ResNet-style net.

Each is built with ``torch.manual_seed(seed)``; its repeated blocks sit in ``model.blocks``
(an ``nn.ModuleList`` run in order), and ``checkpoint_blocks=True`` runs each of them under
non-reentrant ``torch.utils.checkpoint``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class CNNShape:
    arch: str           # "vgg" | "resnet"
    batch: int
    side: int           # input images are batch x 3 x side x side
    width: int          # channels of the first stage (doubled at every later stage)
    stages: int

    @property
    def name(self) -> str:
        return f"cnn-{self.arch}-b{self.batch}-s{self.side}-w{self.width}"

    def describe(self) -> str:
        what = ("VGG-style: per stage conv-BN-ReLU x2 then max pooling" if self.arch == "vgg" else
                "ResNet-style: basic blocks (conv-BN-ReLU-conv-BN + shortcut), stride-2 1x1 projections, avg pooling")
        return f"{what}; {self.stages} stages from {self.width} channels, batch {self.batch} x 3x{self.side}x{self.side}"


SHAPES = (
    CNNShape("vgg", 8, 32, 16, 3),
    CNNShape("vgg", 16, 32, 24, 2),
    CNNShape("vgg", 4, 64, 8, 3),
    CNNShape("resnet", 8, 32, 16, 3),
    CNNShape("resnet", 16, 32, 16, 2),
    CNNShape("resnet", 4, 64, 8, 3),
)


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class VGGStage(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_bn_relu(c_in, c_out), _conv_bn_relu(c_out, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(self.body(x), 2)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
                         if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class StagedCNN(nn.Module):
    def __init__(self, shape: CNNShape, checkpoint_blocks: bool = False, n_classes: int = 10) -> None:
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        w = shape.width
        self.stem = _conv_bn_relu(3, w)
        blocks: list[nn.Module] = []
        for stage in range(shape.stages):
            c_out = w * 2 ** stage
            c_in = w * 2 ** max(stage - 1, 0)
            if shape.arch == "vgg":
                blocks.append(VGGStage(c_in, c_out))
            else:
                blocks += [BasicBlock(c_in, c_out, 1 if stage == 0 else 2), BasicBlock(c_out, c_out, 1)]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(w * 2 ** (shape.stages - 1), n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpoint_blocks else block(h)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def build_cnn(shape: CNNShape, seed: int, checkpoint_blocks: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The CNN in training mode and its input batch, both fixed by ``seed``."""
    torch.manual_seed(seed)
    model = StagedCNN(shape, checkpoint_blocks)
    gen = torch.Generator().manual_seed(seed)
    return model.train(), (torch.randn(shape.batch, 3, shape.side, shape.side, generator=gen),)
