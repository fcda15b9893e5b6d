# VGG-16 (Simonyan and Zisserman 2015, configuration D): thirteen 3x3 convolutions in five blocks, each block
# followed by 2x2 max pooling, then fc6, fc7 (4096, ReLU, dropout 0.5) and fc8. Training as in the paper: weights
# from N(0, 0.01), zero biases, SGD with learning rate 0.01, momentum 0.9 and weight decay 5e-4.
from deepdsl import dsl as D

K = 1000                       # classes
N, C, H, W = 64, 3, 224, 224   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="synthetic")
y = D.labels("y", N, classes=K)

w = D.gaussian(0.01)
b = D.constant(0.0)
relu = D.relu
pool = D.max_pool(2)


def block(index, channels, convs):
    """`convs` 3x3 convolutions of `channels` channels with ReLU, then 2x2 max pooling (conv<index>_1 ...)."""
    f = pool
    for i in range(convs, 0, -1):
        f = f @ relu @ D.conv(f"conv{index}_{i}", kernel=3, channels=channels, padding=1, weight=w, bias_init=b)
    return f


features = block(5, 512, 3) @ block(4, 512, 3) @ block(3, 256, 3) @ block(2, 128, 2) @ block(1, 64, 2)
fc6 = D.full("fc6", 4096, weight=w, bias_init=b)
fc7 = D.full("fc7", 4096, weight=w, bias_init=b)
fc8 = D.full("fc8", K, weight=w, bias_init=b)
drop = D.dropout(0.5)

network = fc8 @ drop @ relu @ fc7 @ drop @ relu @ fc6 @ D.flatten @ features
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("vgg16", iters=370000, test_iters=1000, lr=0.01, momentum=0.9, decay=0.0005)
loop = D.Loop(loss, accuracy, solver)
