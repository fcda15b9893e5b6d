# AlexNet (Krizhevsky et al. 2012) as in Caffe's bvlc_alexnet train_val.prototxt and solver, on one device: the
# two-way channel grouping of conv2, conv4 and conv5 (a split across two GPUs in the original) is left out, as in the
# DeepDSL paper's AlexNet; every layer keeps its published width.
from deepdsl import dsl as D

K = 1000                        # classes
N, C, H, W = 128, 3, 227, 227   # batch, channels, height, width (Caffe's 227x227 crop)

x = D.images("x", (N, C, H, W), dataset="synthetic")
y = D.labels("y", N, classes=K)


def weight(std):
    return D.gaussian(std)


def bias(value):
    return D.constant(value, lr_mult=2, decay_mult=0)      # biases: twice the learning rate, no weight decay


conv1 = D.conv("conv1", kernel=11, channels=96, stride=4, weight=weight(0.01), bias_init=bias(0))
conv2 = D.conv("conv2", kernel=5, channels=256, padding=2, weight=weight(0.01), bias_init=bias(0.1))
conv3 = D.conv("conv3", kernel=3, channels=384, padding=1, weight=weight(0.01), bias_init=bias(0))
conv4 = D.conv("conv4", kernel=3, channels=384, padding=1, weight=weight(0.01), bias_init=bias(0.1))
conv5 = D.conv("conv5", kernel=3, channels=256, padding=1, weight=weight(0.01), bias_init=bias(0.1))
fc6 = D.full("fc6", 4096, weight=weight(0.005), bias_init=bias(0.1))
fc7 = D.full("fc7", 4096, weight=weight(0.005), bias_init=bias(0.1))
fc8 = D.full("fc8", K, weight=weight(0.01), bias_init=bias(0))

pool = D.max_pool(3, stride=2, ceil=True)       # Caffe rounds pooled sizes up
lrn = D.lrn(size=5, alpha=1e-4, beta=0.75)
drop = D.dropout(0.5)
relu = D.relu

network = (fc8 @ drop @ relu @ fc7 @ drop @ relu @ fc6 @ D.flatten
           @ pool @ relu @ conv5 @ relu @ conv4 @ relu @ conv3
           @ pool @ lrn @ relu @ conv2
           @ pool @ lrn @ relu @ conv1)
loss = (D.log_loss(y) @ D.softmax @ network)(x)
accuracy = (D.precision(y) @ network)(x)

# Caffe's solver: base_lr 0.01, momentum 0.9, weight_decay 0.0005, 450000 iterations
solver = D.Train("alexnet", iters=450000, test_iters=1000, lr=0.01, momentum=0.9, decay=0.0005)
loop = D.Loop(loss, accuracy, solver)
