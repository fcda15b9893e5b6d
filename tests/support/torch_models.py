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
        x = torch.roll(self.conv(x), 1, dims=2)          # a shift with wrap-around
        x = torch.cumsum(x, dim=1).permute(0, 2, 3, 1)
        return self.fc(x.mean((1, 2)))


# ----------------------------------------------------------------------------------------------------------------
# a Vision Transformer with nn.MultiheadAttention and a class token (Dosovitskiy et al. 2021, in miniature)


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.self_attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """torchvision's VisionTransformer layout: a patch convolution, a class token, position embeddings, encoder
    blocks (dropout of the attention weights inside nn.MultiheadAttention), a final layer norm and a head on the
    class token."""

    def __init__(self, image: int = 16, patch: int = 4, dim: int = 32, depth: int = 2, heads: int = 4,
                 classes: int = 10, attention_dropout: float = 0.1):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.layers = nn.Sequential(*(EncoderBlock(dim, heads, 2 * dim, attention_dropout) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.ln(self.layers(x))[:, 0])


def vit() -> VisionTransformer:
    return VisionTransformer()


# ----------------------------------------------------------------------------------------------------------------
# GPT-2 (Radford et al. 2019) at a small configuration: the same modules and names as the published model, the
# output projection tied to the token embedding


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.heads, self.dropout = heads, dropout

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(n, t, d))


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, attention_dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, attention_dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(dim, 4 * dim), "c_proj": nn.Linear(4 * dim, dim)})

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab: int = 96, context: int = 16, dim: int = 32, depth: int = 2, heads: int = 4,
                 attention_dropout: float = 0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList(GPT2Block(dim, heads, attention_dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight                # tied
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2() -> GPT2:
    return GPT2()


# ----------------------------------------------------------------------------------------------------------------
# a text classifier that ignores padding (token 0): a padding mask in nn.MultiheadAttention and in the mean


class TextClassifier(nn.Module):
    def __init__(self, vocab: int = 96, length: int = 16, dim: int = 32, heads: int = 4, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, length, dim).normal_(std=0.02))
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        pad = tokens == 0
        h = self.embed(tokens) + self.pos
        h = self.ln(h + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0])
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))


def text_classifier() -> TextClassifier:
    return TextClassifier()


# ----------------------------------------------------------------------------------------------------------------
# residual blocks with stochastic depth as torchvision writes it (torchvision.ops.stochastic_depth, "row" mode)


def stochastic_depth(input, p: float, mode: str, training: bool = True):
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


class StochasticDepth(nn.Module):
    def __init__(self, p: float, mode: str):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x):
        return stochastic_depth(x, self.p, self.mode, self.training)


class DropPathNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                                                  nn.BatchNorm2d(width), nn.ReLU()) for _ in range(2))
        self.drop = nn.ModuleList(StochasticDepth(p, "row") for p in (0.25, 0.5))
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for block, drop in zip(self.blocks, self.drop):
            x = x + drop(block(x))
        return self.fc(x.mean((2, 3)))


def drop_path_net() -> DropPathNet:
    return DropPathNet()
