# OverFeat, fast model (Sermanet et al. 2014, Table 1): 231x231 input, five convolutions, three fully connected
# layers, ReLU after each layer but the last, dropout 0.5 on fc6 and fc7. Training as in the paper: weights drawn
# from N(0, 0.01), SGD with learning rate 0.05, momentum 0.6 and weight decay 1e-5.
from deepdsl import dsl as D

K = 1000                        # classes
N, C, H, W = 128, 3, 231, 231   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="synthetic")
y = D.labels("y", N, classes=K)

w = D.gaussian(0.01)
b = D.constant(0.0)

conv1 = D.conv("conv1", kernel=11, channels=96, stride=4, weight=w, bias_init=b)
conv2 = D.conv("conv2", kernel=5, channels=256, weight=w, bias_init=b)
conv3 = D.conv("conv3", kernel=3, channels=512, padding=1, weight=w, bias_init=b)
conv4 = D.conv("conv4", kernel=3, channels=1024, padding=1, weight=w, bias_init=b)
conv5 = D.conv("conv5", kernel=3, channels=1024, padding=1, weight=w, bias_init=b)
fc6 = D.full("fc6", 3072, weight=w, bias_init=b)
fc7 = D.full("fc7", 4096, weight=w, bias_init=b)
fc8 = D.full("fc8", K, weight=w, bias_init=b)

pool = D.max_pool(2)
drop = D.dropout(0.5)
relu = D.relu

network = (fc8 @ drop @ relu @ fc7 @ drop @ relu @ fc6 @ D.flatten
           @ pool @ relu @ conv5 @ relu @ conv4 @ relu @ conv3
           @ pool @ relu @ conv2
           @ pool @ relu @ conv1)
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("overfeat", iters=100000, test_iters=1000, lr=0.05, momentum=0.6, decay=1e-5)
loop = D.Loop(loss, accuracy, solver)
