# A small causal Transformer language model over bytes (a GPT, Radford et al. 2018, in miniature): each byte of a
# window of T embedded as 64 features, learned position embeddings added, two pre-norm Transformer blocks of causal
# multi-head self-attention (every position attends to itself and the positions before it, never after) and an MLP
# with exact GELU, a final layer norm, and at every position the scores of the next byte. While training, a tenth of
# the attention weights are dropped (each step draws its own mask). Trained on a text file
# with `--data text:PATH` (its bytes, in windows of T + 1), by AdamW with a cosine schedule after a warm-up.
from deepdsl import dsl as D

V = 256                       # vocabulary: the 256 byte values
N, T = 32, 64                 # batch, window length (tokens)
DIM, HEADS, DEPTH = 64, 4, 2
ATTENTION_DROPOUT = 0.1

x = D.tokens("x", (N, T), vocab=V)
y = D.labels("y", (N, T), classes=V)          # each position's next byte
gelu = D.elementwise("gelu", "v * (1 + erf(v / sqrt(2))) / 2")


def causal_attention(name, tokens):
    """Multi-head self-attention in which position i weighs only positions 0..i (the key projection has no bias:
    it would add one number to all the scores of a query, which the softmax ignores)."""
    n, t, d = tokens.shape
    width = d // HEADS

    def heads(z):                                        # (N, T, D) -> (N, HEADS, T, D / HEADS)
        return z.reshape(n, t, HEADS, width).transpose(1, 2)
    q, k, v = (heads(D.full(f"{name}_{part}", d, bias=part != "k")(tokens)) for part in "qkv")
    # (N, HEADS, T, width), query i over keys 0..i
    mixed = D.attention(q, k, v, causal=True, dropout=ATTENTION_DROPOUT, name=name)
    mixed = mixed.transpose(1, 2).reshape(n, t, d)
    return D.full(f"{name}_out", d)(mixed)


def decoder_block(name):
    mlp = D.full(f"{name}_fc2", DIM) @ gelu @ D.full(f"{name}_fc1", 4 * DIM) @ D.layer_norm(f"{name}_ln2")

    def apply(h):
        h = h + causal_attention(f"{name}_attn", D.layer_norm(f"{name}_ln1")(h))
        return h + mlp(h)
    return D.fn(apply, name)


def language_model(tokens):
    h = D.embedding("embed", V, DIM, weight=D.gaussian(0.02))(tokens) + D.param("pos", (1, T, DIM))
    for i in range(DEPTH):
        h = decoder_block(f"block{i + 1}")(h)
    return D.full("next", V)(D.layer_norm("ln")(h))                # (N, T, V) scores of the next byte


network = D.fn(language_model, "char_lm")
loss = (D.cross_entropy(y) @ network)(x)
accuracy = (D.precision(y) @ network)(x)

solver = D.AdamW("char_lm", iters=2000, test_iters=10, lr=0.003, decay=0.01, schedule="cosine", warmup=100)
loop = D.Loop(loss, accuracy, solver)
