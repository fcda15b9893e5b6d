# LeNet (LeCun et al. 1998), the network of the DeepDSL paper's Figure 2.
from deepdsl import dsl as D

K = 10                        # classes
N, C, H, W = 500, 1, 28, 28   # batch, channels, height, width

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)

cv1 = D.conv("cv1", kernel=5, channels=20)
cv2 = D.conv("cv2", kernel=5, channels=50)
mp = D.max_pool(2)
fc1 = D.full("fc1", 500)
fc2 = D.full("fc2", K)

network = fc2 @ D.relu @ fc1 @ D.flatten @ mp @ cv2 @ mp @ cv1      # `@` composes, right to left
loss = (D.log_loss(y) @ D.softmax @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.Train("lenet", iters=1000, test_iters=10, lr=0.01, momentum=0.9, decay=0.0005, clip=0)
loop = D.Loop(loss, accuracy, solver)
