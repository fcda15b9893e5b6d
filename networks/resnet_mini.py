# A small residual network for the digits (8x8 images resized to 28x28): a 3x3 stem and three residual stages of
# two-convolution basic blocks (He et al. 2016, Figure 2 left), batch normalization after every convolution,
# projection shortcuts where the width or the resolution changes, global average pooling and one classifier.
import math

from deepdsl import dsl as D

K = 10                        # classes
N, C, H, W = 100, 1, 28, 28   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)
relu = D.relu


def conv_bn(name, fan_in, kernel, channels, stride=1):
    weight = D.gaussian(math.sqrt(2.0 / (fan_in * kernel * kernel)))
    return D.batch_norm(f"{name}_bn") @ D.conv(name, kernel=kernel, channels=channels, stride=stride,
                                               padding=kernel // 2, bias=False, weight=weight)


def basic_block(name, fan_in, channels, stride=1):
    """relu(conv_bn(relu(conv_bn(p))) + shortcut(p))."""
    main = conv_bn(f"{name}_b", channels, 3, channels) @ relu @ conv_bn(f"{name}_a", fan_in, 3, channels, stride)
    if stride != 1 or fan_in != channels:
        shortcut = conv_bn(f"{name}_proj", fan_in, 1, channels, stride)
    else:
        shortcut = D.fn(lambda p: p, "identity")
    return relu @ D.fn(lambda p: D.add(main(p), shortcut(p)), name)


network = (D.full("fc", K) @ D.flatten @ D.avg_pool()
           @ basic_block("res4", 32, 64, stride=2) @ basic_block("res3", 16, 32, stride=2)
           @ basic_block("res2", 16, 16) @ relu @ conv_bn("conv1", C, 3, 16))
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("resnet_mini", iters=300, test_iters=5, lr=0.05, momentum=0.9, decay=0.0001)
loop = D.Loop(loss, accuracy, solver)
