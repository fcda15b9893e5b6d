"""The networks of `networks/` written independently in plain PyTorch, to check deepdsl end to end against.

Each twin keeps its layers in one flat `nn.ModuleDict` under the layer names the network file uses, so parameter
`<layer>_W` / `<layer>_B` of deepdsl is `layers.<layer>.weight` / `.bias` here and batch-norm statistics
`<layer>_mean` / `<layer>_var` are `running_mean` / `running_var`. Layouts are PyTorch's, which deepdsl shares.

Dropout: a twin in training mode takes its masks from `twin.masks` (a list of 0/1 tensors, consumed in the order
the forward pass applies dropout) when it is set, so a test can apply exactly the masks deepdsl drew; otherwise it
draws its own like `nn.Dropout`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Twin(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict()
        self.masks: list[torch.Tensor] | None = None

    def add(self, name: str, module: nn.Module) -> nn.Module:
        assert name not in self.layers, name
        self.layers[name] = module
        return module

    def dropout(self, x: torch.Tensor, ratio: float) -> torch.Tensor:
        if not self.training:
            return x
        if self.masks is None:
            return F.dropout(x, ratio, training=True)
        mask = self.masks.pop(0)
        assert mask.shape == x.shape, (mask.shape, x.shape)
        return x * mask / (1.0 - ratio)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), y)

    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.logits(x).argmax(1) == y).float().mean()

    def deepdsl_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and running statistics under deepdsl's names."""
        suffix = {"weight": "W", "bias": "B", "running_mean": "mean", "running_var": "var"}
        out = {}
        for name, module in self.layers.items():
            for key, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if key in suffix:
                    out[f"{name}_{suffix[key]}"] = tensor
        return out


def _features_size(features, channels: int, image: tuple[int, int]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, channels, *image)).numel()


class LeNet(Twin):
    """networks/lenet.py in PyTorch: its loss is -mean log(softmax(z)[y]), written as the network writes it."""

    def __init__(self, image=(28, 28), classes=10):
        super().__init__()
        self.cv1 = self.add("cv1", nn.Conv2d(1, 20, 5))
        self.cv2 = self.add("cv2", nn.Conv2d(20, 50, 5))
        h, w = (((s - 4) // 2 - 4) // 2 for s in image)
        self.fc1 = self.add("fc1", nn.Linear(50 * h * w, 500))
        self.fc2 = self.add("fc2", nn.Linear(500, classes))

    def logits(self, x):
        x = F.max_pool2d(self.cv2(F.max_pool2d(self.cv1(x), 2)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))

    def loss(self, x, y):
        return F.nll_loss(torch.log(F.softmax(self.logits(x), dim=1)), y)


class MLP(Twin):
    def __init__(self, image=(28, 28), classes=10):
        super().__init__()
        self.fc1 = self.add("fc1", nn.Linear(image[0] * image[1], 300))
        self.fc2 = self.add("fc2", nn.Linear(300, 100))
        self.fc3 = self.add("fc3", nn.Linear(100, classes))

    def logits(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


class AlexNet(Twin):
    """Caffe's AlexNet without channel groups; its loss is -mean log softmax(z)[y] computed as log of softmax."""

    def __init__(self, image=(227, 227), classes=1000):
        super().__init__()
        self.conv1 = self.add("conv1", nn.Conv2d(3, 96, 11, stride=4))
        self.conv2 = self.add("conv2", nn.Conv2d(96, 256, 5, padding=2))
        self.conv3 = self.add("conv3", nn.Conv2d(256, 384, 3, padding=1))
        self.conv4 = self.add("conv4", nn.Conv2d(384, 384, 3, padding=1))
        self.conv5 = self.add("conv5", nn.Conv2d(384, 256, 3, padding=1))
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.lrn = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)
        flat = _features_size(self.features, 3, image)
        self.fc6 = self.add("fc6", nn.Linear(flat, 4096))
        self.fc7 = self.add("fc7", nn.Linear(4096, 4096))
        self.fc8 = self.add("fc8", nn.Linear(4096, classes))

    def features(self, x):
        x = self.pool(self.lrn(F.relu(self.conv1(x))))
        x = self.pool(self.lrn(F.relu(self.conv2(x))))
        x = F.relu(self.conv5(F.relu(self.conv4(F.relu(self.conv3(x))))))
        return self.pool(x)

    def logits(self, x):
        x = self.features(x).flatten(1)
        x = self.dropout(F.relu(self.fc6(x)), 0.5)
        x = self.dropout(F.relu(self.fc7(x)), 0.5)
        return self.fc8(x)

    def loss(self, x, y):
        return F.nll_loss(torch.log(F.softmax(self.logits(x), dim=1)), y)


class Overfeat(Twin):
    def __init__(self, image=(231, 231), classes=1000):
        super().__init__()
        self.convs = [self.add("conv1", nn.Conv2d(3, 96, 11, stride=4)),
                      self.add("conv2", nn.Conv2d(96, 256, 5)),
                      self.add("conv3", nn.Conv2d(256, 512, 3, padding=1)),
                      self.add("conv4", nn.Conv2d(512, 1024, 3, padding=1)),
                      self.add("conv5", nn.Conv2d(1024, 1024, 3, padding=1))]
        flat = _features_size(self.features, 3, image)
        self.fc6 = self.add("fc6", nn.Linear(flat, 3072))
        self.fc7 = self.add("fc7", nn.Linear(3072, 4096))
        self.fc8 = self.add("fc8", nn.Linear(4096, classes))

    def features(self, x):
        c1, c2, c3, c4, c5 = self.convs
        x = F.max_pool2d(F.relu(c1(x)), 2)
        x = F.max_pool2d(F.relu(c2(x)), 2)
        return F.max_pool2d(F.relu(c5(F.relu(c4(F.relu(c3(x)))))), 2)

    def logits(self, x):
        x = self.features(x).flatten(1)
        x = self.dropout(F.relu(self.fc6(x)), 0.5)
        x = self.dropout(F.relu(self.fc7(x)), 0.5)
        return self.fc8(x)


class VGG16(Twin):
    CONFIG = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))

    def __init__(self, image=(224, 224), classes=1000):
        super().__init__()
        self.blocks = []
        cin = 3
        for b, widths in enumerate(self.CONFIG, start=1):
            convs = []
            for i, cout in enumerate(widths, start=1):
                convs.append(self.add(f"conv{b}_{i}", nn.Conv2d(cin, cout, 3, padding=1)))
                cin = cout
            self.blocks.append(convs)
        flat = _features_size(self.features, 3, image)
        self.fc6 = self.add("fc6", nn.Linear(flat, 4096))
        self.fc7 = self.add("fc7", nn.Linear(4096, 4096))
        self.fc8 = self.add("fc8", nn.Linear(4096, classes))

    def features(self, x):
        for convs in self.blocks:
            for conv in convs:
                x = F.relu(conv(x))
            x = F.max_pool2d(x, 2, 2)
        return x

    def logits(self, x):
        x = self.features(x).flatten(1)
        x = self.dropout(F.relu(self.fc6(x)), 0.5)
        x = self.dropout(F.relu(self.fc7(x)), 0.5)
        return self.fc8(x)


class Inception:
    """GoogLeNet's inception module; its convolutions live in the twin's layer table."""

    def __init__(self, twin: Twin, name, cin, c1, c3r, c3, c5r, c5, pp, pool_ceil=True):
        self.b1 = twin.add(f"{name}_1x1", nn.Conv2d(cin, c1, 1))
        self.b3r = twin.add(f"{name}_3x3_reduce", nn.Conv2d(cin, c3r, 1))
        self.b3 = twin.add(f"{name}_3x3", nn.Conv2d(c3r, c3, 3, padding=1))
        self.b5r = twin.add(f"{name}_5x5_reduce", nn.Conv2d(cin, c5r, 1))
        self.b5 = twin.add(f"{name}_5x5", nn.Conv2d(c5r, c5, 5, padding=2))
        self.proj = twin.add(f"{name}_pool_proj", nn.Conv2d(cin, pp, 1))
        self.pool = nn.MaxPool2d(3, 1, padding=1, ceil_mode=pool_ceil)
        self.out = c1 + c3 + c5 + pp

    def __call__(self, x):
        return torch.cat([F.relu(self.b1(x)),
                          F.relu(self.b3(F.relu(self.b3r(x)))),
                          F.relu(self.b5(F.relu(self.b5r(x)))),
                          F.relu(self.proj(self.pool(x)))], dim=1)


class GoogLeNet(Twin):
    WIDTHS = {  # Szegedy et al. 2015, Table 1: #1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj
        "3a": (64, 96, 128, 16, 32, 32), "3b": (128, 128, 192, 32, 96, 64),
        "4a": (192, 96, 208, 16, 48, 64), "4b": (160, 112, 224, 24, 64, 64), "4c": (128, 128, 256, 24, 64, 64),
        "4d": (112, 144, 288, 32, 64, 64), "4e": (256, 160, 320, 32, 128, 128),
        "5a": (256, 160, 320, 32, 128, 128), "5b": (384, 192, 384, 48, 128, 128),
    }

    def __init__(self, image=(224, 224), classes=1000):
        super().__init__()
        self.conv1 = self.add("conv1_7x7_s2", nn.Conv2d(3, 64, 7, stride=2, padding=3))
        self.conv2r = self.add("conv2_3x3_reduce", nn.Conv2d(64, 64, 1))
        self.conv2 = self.add("conv2_3x3", nn.Conv2d(64, 192, 3, padding=1))
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.lrn = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)
        self.inc = {}
        cin = 192
        for key, widths in self.WIDTHS.items():
            self.inc[key] = Inception(self, f"inception_{key}", cin, *widths)
            cin = self.inc[key].out
        with torch.no_grad():
            p4a, p4d, _ = self.trunk(torch.zeros(1, 3, *image))
        self.aux = {name: self._aux(name, p) for name, p in (("loss1", p4a), ("loss2", p4d))}
        self.classifier = self.add("loss3_classifier", nn.Linear(1024, classes))

    def _aux(self, name, p, classes=1000):
        conv = self.add(f"{name}_conv", nn.Conv2d(p.shape[1], 128, 1))
        pooled = F.avg_pool2d(p, 5, 3, ceil_mode=True)
        fc = self.add(f"{name}_fc", nn.Linear(128 * pooled.shape[2] * pooled.shape[3], 1024))
        out = self.add(f"{name}_classifier", nn.Linear(1024, classes))

        def head(x):
            x = F.relu(conv(F.avg_pool2d(x, 5, 3, ceil_mode=True)))
            x = self.dropout(F.relu(fc(x.flatten(1))), 0.7)
            return out(x)
        return head

    def trunk(self, x):
        x = self.lrn(self.pool(F.relu(self.conv1(x))))
        x = self.pool(self.lrn(F.relu(self.conv2(F.relu(self.conv2r(x))))))
        x = self.pool(self.inc["3b"](self.inc["3a"](x)))
        p4a = self.inc["4a"](x)
        p4d = self.inc["4d"](self.inc["4c"](self.inc["4b"](p4a)))
        x = self.inc["5b"](self.inc["5a"](self.pool(self.inc["4e"](p4d))))
        return p4a, p4d, x

    def main(self, x):
        return self.classifier(self.dropout(x.mean(dim=(2, 3)), 0.4))

    def logits(self, x):
        return self.main(self.trunk(x)[2])

    def loss(self, x, y):
        # dropout order: the network file applies the main head's dropout, then aux1's, then aux2's
        p4a, p4d, top = self.trunk(x)
        main = F.cross_entropy(self.main(top), y)
        aux1 = F.cross_entropy(self.aux["loss1"](p4a), y)
        aux2 = F.cross_entropy(self.aux["loss2"](p4d), y)
        return main + 0.3 * aux1 + 0.3 * aux2


class _ConvBN:
    def __init__(self, twin: Twin, conv: str, bn: str, cin, cout, kernel, stride=1, padding=0):
        self.conv = twin.add(conv, nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False))
        self.bn = twin.add(bn, nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1))

    def __call__(self, x):
        return self.bn(self.conv(x))


class Bottleneck:
    """ResNet v1 bottleneck, stride on the first 1x1 convolution (and on the projection)."""

    def __init__(self, twin: Twin, stage, block, cin, mid, stride):
        res, bn, out = f"res{stage}{block}", f"bn{stage}{block}", 4 * mid
        self.a = _ConvBN(twin, f"{res}_branch2a", f"{bn}_branch2a", cin, mid, 1, stride)
        self.b = _ConvBN(twin, f"{res}_branch2b", f"{bn}_branch2b", mid, mid, 3, 1, 1)
        self.c = _ConvBN(twin, f"{res}_branch2c", f"{bn}_branch2c", mid, out, 1)
        self.proj = _ConvBN(twin, f"{res}_branch1", f"{bn}_branch1", cin, out, 1, stride) \
            if stride != 1 or cin != out else None

    def __call__(self, x):
        main = self.c(F.relu(self.b(F.relu(self.a(x)))))
        return F.relu(main + (self.proj(x) if self.proj else x))


class ResNet50(Twin):
    def __init__(self, image=(224, 224), classes=1000):
        super().__init__()
        self.stem = _ConvBN(self, "conv1", "bn_conv1", 3, 64, 7, 2, 3)
        self.blocks = []
        cin = 64
        for stage, blocks, mid, stride in ((2, 3, 64, 1), (3, 4, 128, 2), (4, 6, 256, 2), (5, 3, 512, 2)):
            for i in range(blocks):
                self.blocks.append(Bottleneck(self, stage, "abcdef"[i], cin, mid, stride if i == 0 else 1))
                cin = 4 * mid
        self.fc = self.add("fc1000", nn.Linear(2048, classes))

    def logits(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, ceil_mode=True)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


class _SqueezeExcite:
    """maps * sigmoid(up(relu(down(mean of each map)))), one gate per channel (Hu et al. 2018)."""

    def __init__(self, twin: Twin, name, channels, reduction):
        self.down = twin.add(f"{name}_down", nn.Linear(channels, channels // reduction))
        self.up = twin.add(f"{name}_up", nn.Linear(channels // reduction, channels))

    def __call__(self, x):
        return x * torch.sigmoid(self.up(F.relu(self.down(x.mean(dim=(2, 3))))))[:, :, None, None]


class _BasicBlock:
    def __init__(self, twin: Twin, name, cin, cout, stride, se_reduction=None):
        self.a = _ConvBN(twin, f"{name}_a", f"{name}_a_bn", cin, cout, 3, stride, 1)
        self.b = _ConvBN(twin, f"{name}_b", f"{name}_b_bn", cout, cout, 3, 1, 1)
        self.se = _SqueezeExcite(twin, f"{name}_se", cout, se_reduction) if se_reduction else (lambda t: t)
        self.proj = _ConvBN(twin, f"{name}_proj", f"{name}_proj_bn", cin, cout, 1, stride) \
            if stride != 1 or cin != cout else None

    def __call__(self, x):
        return F.relu(self.se(self.b(F.relu(self.a(x)))) + (self.proj(x) if self.proj else x))


class ResNetMini(Twin):
    def __init__(self, image=(28, 28), classes=10, se_reduction=None):
        super().__init__()
        self.stem = _ConvBN(self, "conv1", "conv1_bn", 1, 16, 3, 1, 1)
        self.blocks = [_BasicBlock(self, "res2", 16, 16, 1, se_reduction),
                       _BasicBlock(self, "res3", 16, 32, 2, se_reduction),
                       _BasicBlock(self, "res4", 32, 64, 2, se_reduction)]
        self.fc = self.add("fc", nn.Linear(64, classes))

    def logits(self, x):
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


class SEResNet(ResNetMini):
    """ResNetMini with a squeeze-and-excitation module (4x reduction) on every block's residual branch."""

    def __init__(self, image=(28, 28), classes=10):
        super().__init__(image, classes, se_reduction=4)


class UNet(Twin):
    """Two levels down (double 3x3 conv-BN-ReLU, 2x2 max pooling), a 64-wide bottom, two levels up (2x2 stride-2
    transposed convolution, concatenation after the skip's maps, double conv), 1x1 class maps averaged."""

    def __init__(self, image=(28, 28), classes=10):
        super().__init__()
        self.down1, self.down2, self.bottom = self._double("down1", 1, 16), self._double("down2", 16, 32), \
            self._double("bottom", 32, 64)
        self.up2 = self.add("up2", nn.ConvTranspose2d(64, 32, 2, stride=2))
        self.merge2 = self._double("merge2", 64, 32)
        self.up1 = self.add("up1", nn.ConvTranspose2d(32, 16, 2, stride=2))
        self.merge1 = self._double("merge1", 32, 16)
        self.classes = self.add("classes", nn.Conv2d(16, classes, 1))

    def _double(self, name, cin, cout):
        a = _ConvBN(self, f"{name}_a", f"{name}_a_bn", cin, cout, 3, 1, 1)
        b = _ConvBN(self, f"{name}_b", f"{name}_b_bn", cout, cout, 3, 1, 1)
        return lambda x: F.relu(b(F.relu(a(x))))

    def logits(self, x):
        skip1 = self.down1(x)
        skip2 = self.down2(F.max_pool2d(skip1, 2))
        deepest = self.bottom(F.max_pool2d(skip2, 2))
        joined2 = self.merge2(torch.cat([skip2, self.up2(deepest)], 1))
        joined1 = self.merge1(torch.cat([skip1, self.up1(joined2)], 1))
        return self.classes(joined1).mean(dim=(2, 3))


class MobileNetV2(Twin):
    """torchvision's MobileNetV2 (width 1.0) under deepdsl's layer names."""

    BLOCKS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, image=(224, 224), classes=1000):
        super().__init__()
        self.stem = self._conv_bn("conv1", 3, 32, 3, 2)
        self.blocks = []
        cin, index = 32, 0
        for t, c, n, s in self.BLOCKS:
            for i in range(n):
                index += 1
                self.blocks.append(self._inverted_residual(f"block{index}", cin, t, c, s if i == 0 else 1))
                cin = c
        self.last = self._conv_bn("conv_last", cin, 1280, 1)
        self.fc = self.add("fc", nn.Linear(1280, classes))

    def _conv_bn(self, name, cin, cout, kernel, stride=1, groups=1):
        conv = self.add(name, nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False))
        bn = self.add(f"{name}_bn", nn.BatchNorm2d(cout))
        return lambda x: bn(conv(x))

    def _inverted_residual(self, name, cin, t, cout, stride):
        hidden = cin * t
        expand = self._conv_bn(f"{name}_expand", cin, hidden, 1) if t != 1 else None
        depthwise = self._conv_bn(f"{name}_dw", hidden, hidden, 3, stride, groups=hidden)
        project = self._conv_bn(f"{name}_project", hidden, cout, 1)

        def block(x):
            h = F.relu6(expand(x)) if expand else x
            out = project(F.relu6(depthwise(h)))
            return out + x if stride == 1 and cin == cout else out
        return block

    def logits(self, x):
        x = F.relu6(self.stem(x))
        for block in self.blocks:
            x = block(x)
        x = F.relu6(self.last(x)).mean(dim=(2, 3))
        return self.fc(self.dropout(x, 0.2))


def _transformer_blocks(twin: Twin, depth: int, dim: int, widen: int) -> list[dict[str, nn.Module]]:
    """The modules of `depth` pre-norm Transformer blocks, as `block<i>_<part>`: layer norms, q/k/v/out projections
    (k without bias: a key bias changes no softmax) and an MLP `widen` times wider."""
    blocks = []
    for i in range(1, depth + 1):
        parts = {"ln1": nn.LayerNorm(dim), "attn_q": nn.Linear(dim, dim), "attn_k": nn.Linear(dim, dim, bias=False),
                 "attn_v": nn.Linear(dim, dim), "attn_out": nn.Linear(dim, dim), "ln2": nn.LayerNorm(dim),
                 "fc1": nn.Linear(dim, widen * dim), "fc2": nn.Linear(widen * dim, dim)}
        for key, module in parts.items():
            twin.add(f"block{i}_{key}", module)
        blocks.append(parts)
    return blocks


def _transformer_block(twin: Twin, parts: dict[str, nn.Module], h: torch.Tensor, heads: int, causal: bool,
                       dropout: float = 0.0) -> torch.Tensor:
    """h + attention(ln1(h)), then + fc2(gelu(fc1(ln2(.)))); causal: position i attends to positions 0..i;
    `dropout`: of the attention weights."""
    n, t, d = h.shape
    x = parts["ln1"](h)
    q, k, v = (parts[f"attn_{p}"](x).reshape(n, t, heads, d // heads).transpose(1, 2) for p in "qkv")
    scores = q @ k.transpose(2, 3) / (d // heads) ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if dropout:
        weights = twin.dropout(weights, dropout)
    h = h + parts["attn_out"]((weights @ v).transpose(1, 2).reshape(n, t, d))
    return h + parts["fc2"](F.gelu(parts["fc1"](parts["ln2"](h))))


class ViT(Twin):
    """A pre-norm Vision Transformer: 7x7 patches embedded by a strided convolution, position embeddings, 4 encoder
    blocks of 4-head self-attention and a GELU MLP of twice the width, a final layer norm, the tokens' mean, a
    classifier."""

    def __init__(self, image=(28, 28), classes=10, patch=7, dim=64, heads=4, depth=4):
        super().__init__()
        self.heads = heads
        self.patch = self.add("patch", nn.Conv2d(1, dim, patch, stride=patch))
        self.pos = nn.Parameter(torch.zeros(1, (image[0] // patch) * (image[1] // patch), dim))
        self.blocks = _transformer_blocks(self, depth, dim, 2)
        self.ln = self.add("ln", nn.LayerNorm(dim))
        self.head = self.add("head", nn.Linear(dim, classes))

    def logits(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        for parts in self.blocks:
            tokens = _transformer_block(self, parts, tokens, self.heads, causal=False)
        return self.head(self.ln(tokens).mean(1))

    def deepdsl_tensors(self):
        return {**super().deepdsl_tensors(), "pos": self.pos}


class CharLM(Twin):
    """A small causal Transformer language model over bytes: embedding, position embeddings, pre-norm blocks of causal
    4-head self-attention (a tenth of its weights dropped while training) and a GELU MLP of 4x width, a final layer
    norm, next-byte scores."""

    def __init__(self, image=None, classes=256, length=64, dim=64, heads=4, depth=2, attention_dropout=0.1):
        super().__init__()
        self.heads, self.attention_dropout = heads, attention_dropout
        self.embed = self.add("embed", nn.Embedding(classes, dim))
        self.pos = nn.Parameter(torch.zeros(1, length, dim))
        self.blocks = _transformer_blocks(self, depth, dim, 4)
        self.ln = self.add("ln", nn.LayerNorm(dim))
        self.next = self.add("next", nn.Linear(dim, classes))

    def logits(self, x):
        h = self.embed(x) + self.pos
        for parts in self.blocks:
            h = _transformer_block(self, parts, h, self.heads, causal=True, dropout=self.attention_dropout)
        return self.next(self.ln(h))

    def loss(self, x, y):
        scores = self.logits(x)
        return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), y.reshape(-1))

    def accuracy(self, x, y):
        return (self.logits(x).argmax(-1) == y).to(torch.float64).mean()

    def deepdsl_tensors(self):
        return {**super().deepdsl_tensors(), "pos": self.pos}


class InceptionMini(Twin):
    def __init__(self, image=(28, 28), classes=10):
        super().__init__()
        self.conv1 = self.add("conv1", nn.Conv2d(1, 32, 3, padding=1))
        self.a = Inception(self, "inception_a", 32, 16, 16, 24, 4, 8, 16, pool_ceil=False)
        self.b = Inception(self, "inception_b", self.a.out, 32, 32, 48, 8, 16, 16, pool_ceil=False)
        self.classifier = self.add("classifier", nn.Linear(self.b.out, classes))

    def logits(self, x):
        x = self.a(F.max_pool2d(F.relu(self.conv1(x)), 2))
        x = self.b(F.max_pool2d(x, 2))
        return self.classifier(self.dropout(x.mean(dim=(2, 3)), 0.2))
