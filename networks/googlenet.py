# GoogLeNet (Szegedy et al. 2015) as in Caffe's bvlc_googlenet train_val.prototxt: the inception widths of the
# paper's Table 1, local response normalization after pool1 and conv2, both auxiliary classifiers (on inception 4a
# and 4d) and the training loss main + 0.3 x aux1 + 0.3 x aux2. Pooling rounds sizes up as Caffe does; the final
# 7x7 average pooling is global average pooling, so smaller images work too.
from deepdsl import dsl as D

K = 1000                        # classes
N, C, H, W = 128, 3, 224, 224   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="synthetic")
y = D.labels("y", N, classes=K)

w = D.xavier()
b02 = D.constant(0.2, lr_mult=2, decay_mult=0)    # Caffe: biases start at 0.2, twice the rate, no decay
b0 = D.constant(0.0, lr_mult=2, decay_mult=0)
relu = D.relu
lrn = D.lrn(size=5, alpha=1e-4, beta=0.75)
pool = D.max_pool(3, stride=2, ceil=True)


def conv(name, kernel, channels, stride=1, padding=0):
    """Convolution followed by ReLU (every convolution of GoogLeNet is)."""
    return relu @ D.conv(name, kernel=kernel, channels=channels, stride=stride, padding=padding,
                         weight=w, bias_init=b02)


def inception(name, c1, c3r, c3, c5r, c5, pp):
    """Four branches concatenated: 1x1; 1x1 then 3x3; 1x1 then 5x5; 3x3 max pooling then 1x1 projection."""
    b1 = conv(f"{name}_1x1", 1, c1)
    b3 = conv(f"{name}_3x3", 3, c3, padding=1) @ conv(f"{name}_3x3_reduce", 1, c3r)
    b5 = conv(f"{name}_5x5", 5, c5, padding=2) @ conv(f"{name}_5x5_reduce", 1, c5r)
    bp = conv(f"{name}_pool_proj", 1, pp) @ D.max_pool(3, stride=1, padding=1, ceil=True)
    return D.fn(lambda p: D.concat(b1(p), b3(p), b5(p), bp(p)), name)


def auxiliary(name):
    """A side classifier: 5x5/3 average pooling, 1x1 convolution (128), fc 1024, dropout 0.7, fc K; its logits."""
    fc = D.full(f"{name}_fc", 1024, weight=w, bias_init=b02)
    classifier = D.full(f"{name}_classifier", K, weight=w, bias_init=b0)
    return (classifier @ D.dropout(0.7) @ relu @ fc @ D.flatten @ conv(f"{name}_conv", 1, 128)
            @ D.avg_pool(5, stride=3, ceil=True))


stem = (pool @ lrn @ conv("conv2_3x3", 3, 192, padding=1) @ conv("conv2_3x3_reduce", 1, 64)
        @ lrn @ pool @ conv("conv1_7x7_s2", 7, 64, stride=2, padding=3))
to_4a = inception("inception_4a", 192, 96, 208, 16, 48, 64) @ pool \
    @ inception("inception_3b", 128, 128, 192, 32, 96, 64) @ inception("inception_3a", 64, 96, 128, 16, 32, 32) @ stem
to_4d = inception("inception_4d", 112, 144, 288, 32, 64, 64) @ inception("inception_4c", 128, 128, 256, 24, 64, 64) \
    @ inception("inception_4b", 160, 112, 224, 24, 64, 64)
head = D.full("loss3_classifier", K, weight=w, bias_init=b0) @ D.dropout(0.4) @ D.flatten @ D.avg_pool() \
    @ inception("inception_5b", 384, 192, 384, 48, 128, 128) @ inception("inception_5a", 256, 160, 320, 32, 128, 128) \
    @ pool @ inception("inception_4e", 256, 160, 320, 32, 128, 128)
aux1, aux2 = auxiliary("loss1"), auxiliary("loss2")
network = head @ to_4d @ to_4a


def train_loss(image):
    """The main classifier's loss plus 0.3 x each auxiliary classifier's (the side heads share the trunk)."""
    p4a = to_4a(image)
    p4d = to_4d(p4a)
    ce = D.cross_entropy(y)
    return ce(head(p4d)) + 0.3 * ce(aux1(p4a)) + 0.3 * ce(aux2(p4d))


loss = train_loss(x)
accuracy = (D.precision(y) @ network)(x)

# Caffe's quick_solver: base_lr 0.01, momentum 0.9, weight_decay 0.0002 (2.4M iterations at batch 32)
solver = D.Train("googlenet", iters=2400000, test_iters=1000, lr=0.01, momentum=0.9, decay=0.0002)
loop = D.Loop(loss, accuracy, solver)
