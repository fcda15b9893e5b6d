# MobileNet-v2 (Sandler et al. 2018, Table 2) as torchvision builds it: a 3x3 stride-2 stem of 32 channels, 17
# inverted residual blocks, a 1x1 convolution to 1280 channels, global average pooling, dropout 0.2 and the
# classifier. An inverted residual block expands its input t times by a 1x1 convolution, filters each channel on its
# own by a 3x3 depthwise convolution (groups = channels; the block's stride), and projects back down by a linear 1x1
# convolution (no activation after it); the input is added back where the shape is unchanged. Batch normalization
# after every convolution (no convolution biases), ReLU6 after the expansion and the depthwise filter. Weights as
# torchvision initializes them: convolutions N(0, 2 / fan_out), the classifier N(0, 0.01^2); SGD with learning rate
# 0.045, momentum 0.9 and weight decay 4e-5 (torchvision's recipe).
import math

from deepdsl import dsl as D

K = 1000                       # classes
N, C, H, W = 32, 3, 224, 224   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="synthetic")
y = D.labels("y", N, classes=K)
relu6 = D.clipped_relu(6)

# (expansion t, output channels c, blocks n, stride of the first block s), the paper's Table 2
BLOCKS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


def conv_bn(name, kernel, channels, stride=1, groups=1):
    """Convolution without bias (padding keeps the size at stride 1) followed by batch normalization."""
    weight = D.gaussian(math.sqrt(2.0 / (channels * kernel * kernel)))
    return D.batch_norm(f"{name}_bn") @ D.conv(name, kernel=kernel, channels=channels, stride=stride,
                                               padding=kernel // 2, bias=False, weight=weight, groups=groups)


def inverted_residual(name, fan_in, expansion, channels, stride):
    """project(relu6(depthwise(relu6(expand(p))))), plus p where the shape is unchanged."""
    hidden = fan_in * expansion
    expand = relu6 @ conv_bn(f"{name}_expand", 1, hidden) if expansion != 1 else D.fn(lambda p: p, "identity")
    depthwise = relu6 @ conv_bn(f"{name}_dw", 3, hidden, stride=stride, groups=hidden)
    branch = conv_bn(f"{name}_project", 1, channels) @ depthwise @ expand
    if stride == 1 and fan_in == channels:
        return D.fn(lambda p: D.add(branch(p), p), name)
    return branch


def features():
    layers, fan_in, index = [relu6 @ conv_bn("conv1", 3, 32, stride=2)], 32, 0
    for expansion, channels, count, stride in BLOCKS:
        for i in range(count):
            index += 1
            layers.append(inverted_residual(f"block{index}", fan_in, expansion, channels, stride if i == 0 else 1))
            fan_in = channels
    layers.append(relu6 @ conv_bn("conv_last", 1, 1280))
    net = layers[0]
    for layer in layers[1:]:
        net = layer @ net
    return net


network = (D.full("fc", K, weight=D.gaussian(0.01)) @ D.dropout(0.2) @ D.flatten @ D.avg_pool() @ features())
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("mobilenet_v2", iters=1000, test_iters=10, lr=0.045, momentum=0.9, decay=0.00004)
loop = D.Loop(loss, accuracy, solver)
