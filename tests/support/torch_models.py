"""Models written in plain torch.nn, as their users write them, for `deepdsl import`: torchvision's ResNet-18 and
MobileNet-v2 architectures (the layers, names and defaults of torchvision.models.resnet18 and mobilenet_v2, written
out here: torchvision is not needed), a U-Net classifying whole images, and a model with ops the DSL lacks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------------------------
# ResNet-18 (torchvision.models.resnet.ResNet with BasicBlock, layers [2, 2, 2, 2])


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10) -> ResNet:
    return ResNet((2, 2, 2, 2), num_classes)


# ----------------------------------------------------------------------------------------------------------------
# MobileNet-v2 (torchvision.models.mobilenetv2.MobileNetV2)


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class Conv2dNormActivation(nn.Sequential):
    def __init__(self, inp: int, oup: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 activation: bool = True):
        layers = [nn.Conv2d(inp, oup, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(oup)]
        if activation:
            layers.append(nn.ReLU6(inplace=True))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers = [Conv2dNormActivation(inp, hidden, kernel_size=1)] if expand_ratio != 1 else []
        layers += [Conv2dNormActivation(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, oup, 1, 1, 0, bias=False), nn.BatchNorm2d(oup)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2):
        super().__init__()
        settings = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
                    [6, 320, 1, 1]]
        input_channel = _make_divisible(32 * width_mult)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [Conv2dNormActivation(3, input_channel, stride=2)]
        for t, c, n, s in settings:
            output_channel = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 10) -> MobileNetV2:
    return MobileNetV2(num_classes)


# ----------------------------------------------------------------------------------------------------------------
# a U-Net (Ronneberger et al. 2015, in miniature) whose per-pixel scores are averaged into an image's class scores


class DoubleConv(nn.Sequential):
    def __init__(self, inp: int, out: int):
        super().__init__(nn.Conv2d(inp, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True),
                         nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 10, width: int = 8):
        super().__init__()
        self.down1, self.down2 = DoubleConv(channels, width), DoubleConv(width, 2 * width)
        self.bottom = DoubleConv(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.merge2 = DoubleConv(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.merge1 = DoubleConv(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        skip1 = self.down1(x)
        skip2 = self.down2(self.pool(skip1))
        deepest = self.bottom(self.pool(skip2))
        joined2 = self.merge2(torch.cat([skip2, self.up2(deepest)], dim=1))
        joined1 = self.merge1(torch.cat([skip1, self.up1(joined2)], dim=1))
        return self.head(joined1).mean((2, 3))


def unet() -> UNet:
    return UNet()


# ----------------------------------------------------------------------------------------------------------------
# a model with two ops the DSL has no layer for


class Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.conv(x).permute(0, 2, 3, 1)             # channels last: a permutation of four axes
        x = torch.cumsum(x, dim=1)
        return self.fc(x.mean((1, 2)))
