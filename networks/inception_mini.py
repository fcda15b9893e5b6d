# A small inception network for the digits (8x8 images resized to 28x28): a 3x3 stem, two inception modules
# (four branches concatenated, as in GoogLeNet) separated by max pooling, global average pooling and one classifier
# with dropout.
from deepdsl import dsl as D

K = 10                        # classes
N, C, H, W = 100, 1, 28, 28   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)
relu = D.relu
bias = D.constant(0.1, lr_mult=2, decay_mult=0)


def conv(name, kernel, channels):
    return relu @ D.conv(name, kernel=kernel, channels=channels, padding=kernel // 2, bias_init=bias)


def inception(name, c1, c3r, c3, c5r, c5, pp):
    b1 = conv(f"{name}_1x1", 1, c1)
    b3 = conv(f"{name}_3x3", 3, c3) @ conv(f"{name}_3x3_reduce", 1, c3r)
    b5 = conv(f"{name}_5x5", 5, c5) @ conv(f"{name}_5x5_reduce", 1, c5r)
    bp = conv(f"{name}_pool_proj", 1, pp) @ D.max_pool(3, stride=1, padding=1)
    return D.fn(lambda p: D.concat(b1(p), b3(p), b5(p), bp(p)), name)


pool = D.max_pool(2)
network = (D.full("classifier", K) @ D.dropout(0.2) @ D.flatten @ D.avg_pool()
           @ inception("inception_b", 32, 32, 48, 8, 16, 16) @ pool
           @ inception("inception_a", 16, 16, 24, 4, 8, 16) @ pool @ conv("conv1", 3, 32))
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("inception_mini", iters=300, test_iters=5, lr=0.05, momentum=0.9, decay=0.0001)
loop = D.Loop(loss, accuracy, solver)
