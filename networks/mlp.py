# A multilayer perceptron: LeCun et al. 1998's 784-300-100-10 network with ReLU, on the digits resized to 28x28.
from deepdsl import dsl as D

K = 10                        # classes
N, C, H, W = 100, 1, 28, 28   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)

fc1 = D.full("fc1", 300)
fc2 = D.full("fc2", 100)
fc3 = D.full("fc3", K)

network = fc3 @ D.relu @ fc2 @ D.relu @ fc1 @ D.flatten
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("mlp", iters=1000, test_iters=10, lr=0.1, momentum=0.9, decay=0.0005)
loop = D.Loop(loss, accuracy, solver)
