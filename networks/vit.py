# A Vision Transformer (Dosovitskiy et al. 2021) for the digits: the 28x28 image cut into 16 patches of 7x7, each
# embedded as a token of 64 features by one stride-7 convolution, learned position embeddings added, four pre-norm
# Transformer encoder blocks (multi-head self-attention with 4 heads, then an MLP of twice the width with exact GELU,
# each after a layer norm and inside a residual connection), a final layer norm, the mean of the tokens (as the
# "GAP" variant of the paper) and a classifier. AdamW with a cosine schedule after a warm-up, as ViTs are trained.
from deepdsl import dsl as D

K = 10                             # classes
N, C, H, W = 100, 1, 28, 28        # batch, channels, height, width
PATCH, DIM, HEADS, DEPTH = 7, 64, 4, 4

x = D.images("x", (N, C, H, W), dataset="digits")
y = D.labels("y", N, classes=K)
gelu = D.elementwise("gelu", "v * (1 + erf(v / sqrt(2))) / 2")


def attention(name, tokens):
    """Multi-head self-attention: softmax(q k^T / sqrt(d)) v per head, the heads joined and projected. The key
    projection has no bias: it would add one number to all the scores of a query, which the softmax ignores (its
    gradient is zero)."""
    n, t, d = tokens.shape
    width = d // HEADS

    def heads(z):                                        # (N, T, D) -> (N, HEADS, T, D / HEADS)
        return z.reshape(n, t, HEADS, width).transpose(1, 2)
    q, k, v = (heads(D.full(f"{name}_{part}", d, bias=part != "k")(tokens)) for part in "qkv")
    mixed = D.attention(q, k, v, name=name)      # softmax(q k^T / sqrt(width)) v: (N, HEADS, T, width)
    mixed = mixed.transpose(1, 2).reshape(n, t, d)
    return D.full(f"{name}_out", d)(mixed)


def encoder_block(name):
    mlp = D.full(f"{name}_fc2", DIM) @ gelu @ D.full(f"{name}_fc1", 2 * DIM) @ D.layer_norm(f"{name}_ln2")

    def apply(tokens):
        tokens = tokens + attention(f"{name}_attn", D.layer_norm(f"{name}_ln1")(tokens))
        return tokens + mlp(tokens)
    return D.fn(apply, name)


def vit(image):
    patches = D.conv("patch", kernel=PATCH, channels=DIM, stride=PATCH)(image)      # (N, DIM, 4, 4)
    n, d, h, w = patches.shape
    tokens = patches.reshape(n, d, h * w).transpose(1, 2) + D.param("pos", (1, h * w, d))
    for i in range(DEPTH):
        tokens = encoder_block(f"block{i + 1}")(tokens)
    return D.full("head", K)(D.layer_norm("ln")(tokens).mean(1))


network = D.fn(vit, "vit")
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.AdamW("vit", iters=600, test_iters=5, lr=0.002, decay=0.05, schedule="cosine", warmup=50)
loop = D.Loop(loss, accuracy, solver)
