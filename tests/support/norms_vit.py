# The ViT of networks/vit.py, smaller, with its normalizations written out as tensor ops, as a user writes one of
# their own: RMSNorm (Zhang and Sennrich 2019, as in LLaMA), x / sqrt(mean(x^2) + eps) * weight, before attention,
# and a layer norm, (x - mean) / sqrt(var + eps) * weight + bias, before the MLP, over each token's features. They
# make elementwise kernels with operands per token (..., 1) and per feature (D,), and sums over each token's
# features and over every axis but the last: the compiled kernels' tests take them from this program.
from deepdsl import dsl as D

K = 10
N, C, H, W = 8, 1, 28, 28
PATCH, DIM, HEADS, DEPTH = 7, 32, 2, 2

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)
gelu = D.elementwise("gelu", "v * (1 + erf(v / sqrt(2))) / 2")


def rms_norm(name):
    def apply(tokens):
        scale = ((tokens * tokens).mean((2,), keepdims=True) + 1e-6) ** -0.5
        return tokens * scale * D.param(f"{name}_W", (DIM,), init=D.constant(1.0))
    return D.fn(apply, name)


def layer_norm(name):
    def apply(tokens):
        centered = tokens - tokens.mean((2,), keepdims=True)
        scale = ((centered * centered).mean((2,), keepdims=True) + 1e-5) ** -0.5
        return centered * scale * D.param(f"{name}_W", (DIM,), init=D.constant(1.0)) + \
            D.param(f"{name}_B", (DIM,), init=D.constant(0.0))
    return D.fn(apply, name)


def attention(name, tokens):
    n, t, d = tokens.shape
    width = d // HEADS

    def heads(z):
        return z.reshape(n, t, HEADS, width).transpose(1, 2)
    q, k, v = (heads(D.full(f"{name}_{part}", d)(tokens)) for part in "qkv")
    mixed = D.attention(q, k, v, name=name).transpose(1, 2).reshape(n, t, d)
    return D.full(f"{name}_out", d)(mixed)


def encoder_block(name):
    mlp = D.full(f"{name}_fc2", DIM) @ gelu @ D.full(f"{name}_fc1", 2 * DIM) @ layer_norm(f"{name}_norm2")

    def apply(tokens):
        tokens = tokens + attention(f"{name}_attn", rms_norm(f"{name}_norm1")(tokens))
        return tokens + mlp(tokens)
    return D.fn(apply, name)


def norms_vit(image):
    patches = D.conv("patch", kernel=PATCH, channels=DIM, stride=PATCH)(image)
    n, d, h, w = patches.shape
    tokens = patches.reshape(n, d, h * w).transpose(1, 2) + D.param("pos", (1, h * w, d))
    for i in range(DEPTH):
        tokens = encoder_block(f"block{i + 1}")(tokens)
    return D.full("head", K)(rms_norm("norm")(tokens).mean(1))


network = D.fn(norms_vit, "norms_vit")
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("norms_vit", iters=10, lr=0.01, momentum=0.9, decay=0.0005))
