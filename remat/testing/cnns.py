"""Small CNNs with normalization and pooling: a VGG-style stack, a ResNet-style net and a
MobileNet-style net (inverted residuals: 1x1 expansion, depthwise 3x3, 1x1 projection).

``SHAPES`` are six fixed shapes (ReLU, BatchNorm); ``cnn_shape(seed)`` draws one from a seed (the
architecture, sizes, activation and normalization), so a corpus can hold CNNs nobody has tuned to.
Each is built with ``torch.manual_seed(seed)``; its repeated blocks sit in ``model.blocks``
(an ``nn.ModuleList`` run in order), and ``checkpoint_blocks=True`` runs each of them under
non-reentrant ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class CNNShape:
    arch: str           # "vgg" | "resnet" | "mobile"
    batch: int
    side: int           # input images are batch x 3 x side x side
    width: int          # channels of the first stage (doubled at every later stage)
    stages: int
    activation: str = "relu"        # "relu" | "silu" | "gelu"
    norm: str = "batch"             # "batch" (BatchNorm2d) | "group" (GroupNorm, 4 groups)
    seed: Optional[int] = None      # the seed ``cnn_shape`` drew it from; None for the fixed ``SHAPES``

    @property
    def name(self) -> str:
        if self.seed is not None:
            return f"cnn-{self.seed}"
        return f"cnn-{self.arch}-b{self.batch}-s{self.side}-w{self.width}"

    def describe(self) -> str:
        norm = {"batch": "BN", "group": "GroupNorm"}[self.norm]
        act = {"relu": "ReLU", "silu": "SiLU", "gelu": "GELU"}[self.activation]
        what = {"vgg": f"VGG-style: per stage conv-{norm}-{act} x2 then max pooling",
                "resnet": f"ResNet-style: basic blocks (conv-{norm}-{act}-conv-{norm} + shortcut), stride-2 1x1 "
                          "projections, avg pooling",
                "mobile": f"MobileNet-style: inverted residuals (1x1 expand x{MOBILE_EXPANSION}, depthwise 3x3, 1x1 "
                          f"project; {norm}, {act}; residual where the shape allows), avg pooling"}[self.arch]
        return f"{what}; {self.stages} stages from {self.width} channels, batch {self.batch} x 3x{self.side}x{self.side}"


MOBILE_EXPANSION = 4


SHAPES = (
    CNNShape("vgg", 8, 32, 16, 3),
    CNNShape("vgg", 16, 32, 24, 2),
    CNNShape("vgg", 4, 64, 8, 3),
    CNNShape("resnet", 8, 32, 16, 3),
    CNNShape("resnet", 16, 32, 16, 2),
    CNNShape("resnet", 4, 64, 8, 3),
)


def cnn_shape(seed: int) -> CNNShape:
    """The CNN ``seed`` names (pure). The batch is halved until a rough count of one step's
    activation bytes (about ten feature maps per stage) is under 25 MB, like the random nets'."""
    rng = random.Random(f"cnn-{seed}")   # a string seed is hashed: nearby integers draw unlike nets
    arch = rng.choice(["vgg", "resnet", "mobile"])
    stages, width = rng.randint(2, 3), rng.choice([8, 12, 16, 24])
    side, batch = rng.choice([16, 32, 48]), rng.choice([4, 8, 16])
    activation, norm = rng.choice(["relu", "silu", "gelu"]), rng.choice(["batch", "batch", "group"])
    per_image = sum(10 * width * 2 ** s * (side // 2 ** s) ** 2 * 4 for s in range(stages))
    per_image *= MOBILE_EXPANSION if arch == "mobile" else 1
    while batch > 1 and batch * per_image > 25e6:
        batch //= 2
    return CNNShape(arch, batch, side, width, stages, activation, norm, seed)


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(4, channels)


def _activation(kind: str) -> nn.Module:
    return {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU}[kind]()


def _conv_norm_act(c_in: int, c_out: int, shape: CNNShape) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), _norm(shape.norm, c_out),
                         _activation(shape.activation))


class VGGStage(nn.Module):
    def __init__(self, c_in: int, c_out: int, shape: CNNShape) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_norm_act(c_in, c_out, shape), _conv_norm_act(c_out, c_out, shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(self.body(x), 2)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, shape: CNNShape) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(shape.norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = _norm(shape.norm, c_out)
        self.shortcut = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(shape.norm, c_out))
                         if stride != 1 or c_in != c_out else nn.Identity())
        self.act = _activation(shape.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn1(self.conv1(x)))
        return self.act(self.bn2(self.conv2(h)) + self.shortcut(x))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, depthwise 3x3 (stride 1 or 2), 1x1 projection with no
    activation after it; the input is added back when the shapes allow."""

    def __init__(self, c_in: int, c_out: int, stride: int, shape: CNNShape) -> None:
        super().__init__()
        hidden = c_in * MOBILE_EXPANSION
        self.body = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False), _norm(shape.norm, hidden), _activation(shape.activation),
            nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False),
            _norm(shape.norm, hidden), _activation(shape.activation),
            nn.Conv2d(hidden, c_out, 1, bias=False), _norm(shape.norm, c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class StagedCNN(nn.Module):
    def __init__(self, shape: CNNShape, checkpoint_blocks: bool = False, n_classes: int = 10) -> None:
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        w = shape.width
        self.stem = _conv_norm_act(3, w, shape)
        blocks: list[nn.Module] = []
        for stage in range(shape.stages):
            c_out = w * 2 ** stage
            c_in = w * 2 ** max(stage - 1, 0)
            if shape.arch == "vgg":
                blocks.append(VGGStage(c_in, c_out, shape))
            else:
                block = BasicBlock if shape.arch == "resnet" else InvertedResidual
                blocks += [block(c_in, c_out, 1 if stage == 0 else 2, shape), block(c_out, c_out, 1, shape)]
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
