# A U-Net (Ronneberger et al. 2015) for the digits: a contracting path of two 3x3 convolutions per level and 2x2
# max pooling, an expanding path that doubles the resolution by a 2x2 stride-2 transposed convolution ("up-
# convolution") and concatenates the contracting path's maps of the same resolution (the skip connections) before
# its two 3x3 convolutions. Padded convolutions with batch normalization (as U-Nets are written today) keep the maps
# 28x28, 14x14, 7x7. The output is one map per class: per-pixel class scores, averaged over the plane into the
# image's scores, so the network trains on the digits' labels.
import math

from deepdsl import dsl as D

K = 10                        # classes
N, C, H, W = 100, 1, 28, 28   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)
relu = D.relu


def double_conv(name, fan_in, channels):
    """Two 3x3 convolutions, each with batch normalization and ReLU."""
    def conv_bn_relu(layer, inputs):
        weight = D.gaussian(math.sqrt(2.0 / (inputs * 9)))
        return relu @ D.batch_norm(f"{layer}_bn") @ D.conv(layer, kernel=3, channels=channels, padding=1,
                                                           bias=False, weight=weight)
    return conv_bn_relu(f"{name}_b", channels) @ conv_bn_relu(f"{name}_a", fan_in)


def up(name, fan_in, channels):
    """The expanding path's up-convolution: twice the resolution, half the channels."""
    return D.conv_transpose(name, kernel=2, channels=channels, stride=2,
                            weight=D.gaussian(math.sqrt(1.0 / (fan_in * 4))))


down1, down2, bottom = double_conv("down1", C, 16), double_conv("down2", 16, 32), double_conv("bottom", 32, 64)
up2, up1 = up("up2", 64, 32), up("up1", 32, 16)
merge2, merge1 = double_conv("merge2", 64, 32), double_conv("merge1", 32, 16)
pool = D.max_pool(2)
classes = D.conv("classes", kernel=1, channels=K)        # per-pixel class scores


def unet(image):
    skip1 = down1(image)                                 # 16 x 28 x 28
    skip2 = down2(pool(skip1))                           # 32 x 14 x 14
    deepest = bottom(pool(skip2))                        # 64 x 7 x 7
    joined2 = merge2(D.concat(skip2, up2(deepest)))      # 32 x 14 x 14
    joined1 = merge1(D.concat(skip1, up1(joined2)))      # 16 x 28 x 28
    return classes(joined1)                              # K x 28 x 28


network = D.flatten @ D.avg_pool() @ D.fn(unet, "unet")
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("unet", iters=300, test_iters=5, lr=0.05, momentum=0.9, decay=0.0001)
loop = D.Loop(loss, accuracy, solver)
