# A squeeze-and-excitation residual network for the digits (Hu et al. 2018, "SE-ResNet"): resnet_mini's stem and
# three stages of basic blocks, each block's residual branch rescaled channel by channel before the sum by an SE
# module: global average pooling squeezes every map to one number, two fully connected layers (a 4x reduction,
# ReLU, then a sigmoid) give one gate per channel, and the branch's maps are multiplied by their gates.
import math

from deepdsl import dsl as D

K = 10                        # classes
N, C, H, W = 100, 1, 28, 28   # batch, channels, height, width
REDUCTION = 4                 # the SE bottleneck's width: channels / REDUCTION

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)
relu = D.relu


def conv_bn(name, fan_in, kernel, channels, stride=1):
    weight = D.gaussian(math.sqrt(2.0 / (fan_in * kernel * kernel)))
    return D.batch_norm(f"{name}_bn") @ D.conv(name, kernel=kernel, channels=channels, stride=stride,
                                               padding=kernel // 2, bias=False, weight=weight)


def squeeze_excite(name, channels):
    """maps * sigmoid(fc_up(relu(fc_down(mean of each map)))), the gates broadcast over each map's plane."""
    gates = D.sigmoid @ D.full(f"{name}_up", channels) @ relu @ D.full(f"{name}_down", channels // REDUCTION)

    def rescale(maps):
        n, c = maps.shape[:2]
        return maps * gates(maps.mean((2, 3))).reshape(n, c, 1, 1)
    return D.fn(rescale, f"{name}")


def se_block(name, fan_in, channels, stride=1):
    """relu(se(conv_bn(relu(conv_bn(p)))) + shortcut(p))."""
    main = (squeeze_excite(f"{name}_se", channels) @ conv_bn(f"{name}_b", channels, 3, channels)
            @ relu @ conv_bn(f"{name}_a", fan_in, 3, channels, stride))
    if stride != 1 or fan_in != channels:
        shortcut = conv_bn(f"{name}_proj", fan_in, 1, channels, stride)
    else:
        shortcut = D.fn(lambda p: p, "identity")
    return relu @ D.fn(lambda p: D.add(main(p), shortcut(p)), name)


network = (D.full("fc", K) @ D.flatten @ D.avg_pool()
           @ se_block("res4", 32, 64, stride=2) @ se_block("res3", 16, 32, stride=2)
           @ se_block("res2", 16, 16) @ relu @ conv_bn("conv1", C, 3, 16))
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("se_resnet", iters=300, test_iters=5, lr=0.05, momentum=0.9, decay=0.0001)
loop = D.Loop(loss, accuracy, solver)
