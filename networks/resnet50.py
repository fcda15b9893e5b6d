# ResNet-50 (He et al. 2016) as in the authors' Caffe ResNet-50 prototxt: bottleneck blocks (1x1, 3x3, 1x1 with
# 4x expansion), the stride of a downsampling block on its first 1x1 convolution and on the projection shortcut
# (the original "v1" placement), batch normalization after every convolution (no convolution biases), ReLU after
# the sum. The final 7x7 average pooling is global average pooling, so smaller images work too. Weights use He et
# al.'s initialization N(0, 2 / fan_in); SGD with learning rate 0.1, momentum 0.9, weight decay 1e-4.
import math

from deepdsl import dsl as D

K = 1000                       # classes
N, C, H, W = 32, 3, 224, 224   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="synthetic")
y = D.labels("y", N, classes=K)
relu = D.relu


def conv_bn(name, bn, fan_in, kernel, channels, stride=1, padding=0):
    """Convolution without bias followed by batch normalization `bn`."""
    weight = D.gaussian(math.sqrt(2.0 / (fan_in * kernel * kernel)))
    return D.batch_norm(bn) @ D.conv(name, kernel=kernel, channels=channels, stride=stride, padding=padding,
                                     bias=False, weight=weight)


def bottleneck(stage, block, fan_in, mid, stride=1):
    """res<stage><block>: relu(branch2(p) + branch1(p)); branch1 is a projection when the shape changes."""
    res, bn = f"res{stage}{block}", f"bn{stage}{block}"
    out = 4 * mid
    main = (conv_bn(f"{res}_branch2c", f"{bn}_branch2c", mid, 1, out)
            @ relu @ conv_bn(f"{res}_branch2b", f"{bn}_branch2b", mid, 3, mid, padding=1)
            @ relu @ conv_bn(f"{res}_branch2a", f"{bn}_branch2a", fan_in, 1, mid, stride=stride))
    if stride != 1 or fan_in != out:
        shortcut = conv_bn(f"{res}_branch1", f"{bn}_branch1", fan_in, 1, out, stride=stride)
    else:
        shortcut = D.fn(lambda p: p, "identity")
    return relu @ D.fn(lambda p: D.add(main(p), shortcut(p)), res)


def stage(index, blocks, fan_in, mid, stride):
    f = bottleneck(index, "a", fan_in, mid, stride)
    for letter in "bcdef"[:blocks - 1]:
        f = bottleneck(index, letter, 4 * mid, mid) @ f
    return f


stem = D.max_pool(3, stride=2, ceil=True) @ relu @ conv_bn("conv1", "bn_conv1", C, 7, 64, stride=2, padding=3)
features = stage(5, 3, 1024, 512, 2) @ stage(4, 6, 512, 256, 2) @ stage(3, 4, 256, 128, 2) @ stage(2, 3, 64, 64, 1) \
    @ stem
network = D.full("fc1000", K) @ D.flatten @ D.avg_pool() @ features
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("resnet50", iters=600000, test_iters=1000, lr=0.1, momentum=0.9, decay=0.0001)
loop = D.Loop(loss, accuracy, solver)
