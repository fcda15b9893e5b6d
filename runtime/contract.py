"""The contract between the compiler and the runtime: every rule both must compute alike, written once.

The compiler (`deepdsl`) imports this module to plan memory, infer shapes, state each op's scratch and define its
reference semantics; the runtime's allocators and kernels import it to place buffers, carve scratch up and draw
random masks. It imports only numpy and the standard library, so a generated program (which imports the runtime,
never the compiler) and the compiler read the same rules, and a rule changed here changes on both sides at once.

- Placement: every buffer starts at a multiple of `ALIGNMENT` bytes and occupies `placed_size(nbytes)` bytes (what
  the memory plan counts, the arena packs and the pool allocator hands out).
- Window geometry: `out_size` (window positions along one axis, for convolution and pooling) and
  `avg_pool_divisor` (the element count each averaging window divides by).
- Random masks: the mask of dropout `key` at training step `step` is drawn from `mask_generator(seed, step, key)`,
  Philox keyed by (seed, `counter_key(step, key)`), the stream the CUDA kernel reproduces bit for bit.
- Scratch: each CPU kernel's scratch per sample (per row for row-wise kernels), in float32 elements of the
  workspace (`FLOAT_BYTES` each; boolean scratch takes `bool_floats(count)` of them). An op's `workspace` rule is
  these figures times the samples of a chunk, in bytes; the kernel derives its chunk from the workspace it is
  handed by the same figures, so the plan's workspace is exactly what the kernel uses.
- Matrix products: `product_cuts` cuts a product into parts by its shape alone, never by the threads computing it,
  so that a step's bits are the same on any number of threads (the compiled kernels' `deepdsl_gemm` and numpy's
  `cpu.linalg.Products` cut alike).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = [
    "ALIGNMENT", "COUNTER_KEY_STEP", "FLOAT_BYTES", "avg_pool_bwd_scratch", "avg_pool_divisor", "avg_pool_scratch",
    "bernoulli_mask", "bernoulli_scratch", "bool_floats", "conv2d_bwd_data_scratch", "conv2d_bwd_filter_scratch",
    "conv2d_scratch",
    "counter_key", "POINTWISE_FILTER_CHANNELS", "pointwise_filter", "FILTER_BY_SAMPLES_PLANE", "filter_by_samples",
    "BLOCKED_CONV_CHANNELS", "BLOCKED_FILTER_ROW", "WIDE_FILTER_ROW", "WIDEST_LANES", "BLOCKED_CONV_ROW",
    "BLOCKED_CHUNK_BYTES", "blocked_conv", "blocked_samples", "blocked_scratch", "CHANNEL_BLOCK",
    "WINOGRAD_CHUNK_BYTES", "WINOGRAD_FILTER_BYTES", "WINOGRAD_ROW", "WINOGRAD_SKEW", "WINOGRAD_OUT",
    "WINOGRAD_POINTS", "winograd_conv", "winograd_blocks", "winograd_samples", "winograd_scratch", "winograd_tiles",
    "WINOGRAD_SUM_TILES", "winograd_sum_samples", "WINOGRAD_PAIR_TILES", "WINOGRAD_PAIR_BYTES",
    "WINOGRAD_PAIR_BLOCKS", "WINOGRAD_FEW_TILES", "winograd_pairs", "THIN_FILTER_CHANNELS", "THIN_FILTER_WIDTH",
    "thin_filter", "thin_filter_scratch",
    "channel_blocks", "DIRECT_CONV_ROWS", "DIRECT_CONV_WIDTH", "direct_conv", "log_softmax_scratch", "lrn_bwd_scratch",
    "lrn_scratch", "LAYER_NORM_PART_ROWS", "layer_norm_rows", "layer_norm_parts", "layer_norm_param_scratch",
    "mask_generator",
    "max_pool_argmax_scratch", "max_pool_bwd_scratch", "max_pool_scratch", "out_size", "placed_size",
    "pointwise_conv", "pool_padded_scratch", "one_product", "WIDE_PLANE", "ADD_COST_FLOPS", "PRODUCT_LANES",
    "PRODUCT_STRIP", "stage_floats", "operand_letter", "operand_pattern", "kernel_rows", "ProductCuts", "product_cuts",
    "PRODUCT_ITEMS", "PRODUCT_PART_WIDTH",
    "PRODUCT_PART_WORK", "PRODUCT_PART_DEPTH", "PRODUCT_HALVES_WORK", "small_product", "SMALL_PRODUCT_WORK",
    "tiled_sum",
]

# ----------------------------------------------------------------------------------------------------------------
# placement

ALIGNMENT = 256     # bytes; what cudaMalloc guarantees, so host and device buffers start alike


def placed_size(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Bytes a buffer of `nbytes` occupies: rounded up to a multiple of `alignment`, at least one unit."""
    return max(alignment, -(-nbytes // alignment) * alignment)


# ----------------------------------------------------------------------------------------------------------------
# matrix products

PRODUCT_ITEMS = 24              # the parts a product (or a stack of them) is cut into at most: 24 share evenly among
                                # 1, 2, 3, 4, 6, 8, 12 or 24 threads
PRODUCT_PART_WIDTH = 128        # a part's rows or columns at least (a multiple of 16 floats: whole vectors)
PRODUCT_PART_WORK = 1 << 20     # a part's multiply-adds at least (packing its operands costs little beside them)
PRODUCT_HALVES_WORK = 1 << 24   # a single product of at least these multiply-adds is cut in two parts at least,
                                # however narrow or deep (LeNet's filter gradients at batch 64: 13.3 ms a step on two
                                # threads uncut, against 11.5 cut in two)
PRODUCT_PART_DEPTH = 8          # a part's width at least its inner dimension over this: each part packs the operand
                                # it shares again, which a long inner dimension makes costly (64 x 6272 by 6272 x 576
                                # on one thread: 6.2 ms whole, 7.9 ms in four parts of 144 columns)
_EVEN_PARTS = (1, 2, 4, 6, 8, 12, 24)    # part counts that share evenly among two threads (or one)


class ProductCuts(tuple):
    """How `batch` products c (m x n) = a (m x k) b (k x n) are cut: (`by_columns`, `parts`, `width`). Each
    product is cut along the longer side of c (its columns where n >= m) into `parts` parts of `width` rows or
    columns (the last one shorter, or empty), each computed by one call of a single-threaded sgemm; the threads
    take whole parts."""

    by_columns = property(lambda self: self[0])
    parts = property(lambda self: self[1])
    width = property(lambda self: self[2])


def product_cuts(batch: int, m: int, n: int, k: int) -> ProductCuts:
    """The cut of `batch` products of (m x k) by (k x n), from their shapes alone: as many parts per product as
    make `PRODUCT_ITEMS` parts in all, no narrower than `PRODUCT_PART_WIDTH` nor than k / `PRODUCT_PART_DEPTH`, and
    no smaller than `PRODUCT_PART_WORK` multiply-adds (but a single product of `PRODUCT_HALVES_WORK` in two
    halves at least), rounded down to an even count; a width of whole vectors of 16 floats. A
    product computed in the same parts rounds alike on any number of threads (a BLAS rounds the edges of a part as
    its kernels for that edge do)."""
    by_columns = n >= m
    side = n if by_columns else m
    widest = max(PRODUCT_PART_WIDTH, k // PRODUCT_PART_DEPTH)
    most = min(-(-PRODUCT_ITEMS // max(batch, 1)), side // widest, m * n * k // PRODUCT_PART_WORK)
    if batch == 1 and side >= 32 and m * n * k >= PRODUCT_HALVES_WORK:
        most = max(most, 2)     # a large product in halves at least: two threads share it (a filter gradient's)
    parts = max(p for p in _EVEN_PARTS if p <= max(most, 1))
    width = (-(-side // parts) + 15) // 16 * 16 if side else 0
    return ProductCuts((by_columns, parts, width))


SMALL_PRODUCT_WORK = 1 << 18    # a product of at most this many multiply-adds is computed in tiles whatever its shape
SMALL_PRODUCT_DEPTH = 256      # terms of a partial sum of the tiles at most (kernels/cpu_gemm.c: DEEPDSL_SG_DEPTH)
SMALL_PRODUCT_SIDE = 1 << 20    # floats of a transposed a (m x k) below this; of b (k x n) below four times this
SMALL_PRODUCT_WIDE = 1 << 24    # floats of an output computed in tiles only up to SMALL_PRODUCT_WIDE_DEPTH deep
SMALL_PRODUCT_WIDE_DEPTH = 64
SMALL_PRODUCT_PACKED_LANES = 16  # vector lanes from which a transposed b of any depth runs in tiles (below: AVX2)
SMALL_PRODUCT_PACKED_ROWS = 16   # ... from this many rows of a


def small_product(m: int, n: int, k: int, ta: bool, tb: bool, lanes: int = 8) -> bool:
    """Whether the compiled kernels compute a product c (m x n) = a (m x k) b (k x n) (each of a stack) in their
    own tiles (`deepdsl_small_gemm`: the same bits on any number of threads, with AVX2 as with AVX-512) rather than
    in the BLAS's sgemm, cut as `product_cuts` says; `ta` / `tb`: a, b read transposed (a's columns, b's rows
    stored one after the other); `lanes`: the kernels' vector lanes (which path a product takes, and so its bits,
    may depend on them, never on the thread count). Measured per shape against the sgemm on one and two threads,
    with AVX-512 and restricted to AVX2 (benchmarks/small_kernels.py): the tiles win on products of at most
    SMALL_PRODUCT_WORK multiply-adds, where the sgemm's packing and calls cost most, and on larger ones but
    - an output too small for its depth (4 k > m n): no tiles to share among threads, where the sgemm's depth cut
      shares it (a filter gradient of few channels, 27 x 21952 by 21952 x 32);
    - a transposed a of SMALL_PRODUCT_SIDE floats or more, or deeper than 1024 (its columns, read across rows
      kilobytes apart, collide in the cache: 1024 x 2048 read transposed, 0.7x; with AVX2's narrower strips, each
      reading a again, 256 x 2048 read transposed 0.7x);
    - a transposed b but with at least 128 rows of a, a depth of at most 512 and at most SMALL_PRODUCT_SIDE floats
      (b is packed by rows for every strip of 64 columns on each thread: fully connected layers of a few rows
      and long inputs, 16 x 4096 by 4096 x 4096, 0.6x), or with `lanes` of SMALL_PRODUCT_PACKED_LANES (AVX-512)
      at least SMALL_PRODUCT_PACKED_ROWS rows of a: packed 8 x 8 floats at a time in registers, such products ran
      1.1-1.8x the sgemm's speed on a Zen 5 at one and two threads (LeNet's second filter gradient, 500 x 4096 by
      4096 x 50 read transposed, 2.1 against 1.3 ms; a fully connected layer's 64 x 800 by 800 x 500, 0.51 against
      0.29; 24 x 768 by 768 x 768, 1.3x), of fewer rows 0.4-0.9x (8 x 4096 by 4096 x 512, 0.5x), and restricted to
      AVX2 on the same machine 0.84-1.0x (there the sgemm keeps them);
    - a b of 4 SMALL_PRODUCT_SIDE floats or more (read from memory for every three tiles of rows: 0.8x);
    - an output of SMALL_PRODUCT_WIDE floats or more deeper than SMALL_PRODUCT_WIDE_DEPTH: the tiles' stores, not
      their multiply-adds, bound such a product where it is shallow (a fully connected layer's weight gradient from
      16 samples, 4096 x 16 read transposed by 16 x 9216: 20.6 ms in tiles, 39.9 in the sgemm at one thread with
      AVX-512; 33.5 and 46.5 with AVX2), and deeper the sgemm is as fast or faster (from 64 samples, 4096 x 4096:
      17.9 and 28.3 ms with AVX-512, 45.7 and 41.5 with AVX2; from 128: 43.7 and 45.3, 88.0 and 70.4; 4096 x 9216
      from 128: 92.7 and 88.4, 230.3 and 144.5)."""
    if m * n * k <= SMALL_PRODUCT_WORK:
        return True
    if 4 * k > m * n or (ta and (m * k >= SMALL_PRODUCT_SIDE or k > 1024)) or n * k >= 4 * SMALL_PRODUCT_SIDE or \
            (m * n >= SMALL_PRODUCT_WIDE and k > SMALL_PRODUCT_WIDE_DEPTH):
        return False
    return not tb or (m >= 128 and k <= 512 and n * k <= SMALL_PRODUCT_SIDE) or \
        (lanes >= SMALL_PRODUCT_PACKED_LANES and m >= SMALL_PRODUCT_PACKED_ROWS)


def tiled_sum(m: int, n: int, k: int, ta: bool, tb: bool, lanes: int = 8) -> bool:
    """Whether the compiled kernels compute a sum of products c (m x n) = the sum over i of a[i] (m x k) b[i] (k x n)
    (a pointwise convolution's filter gradient by samples: `Native.gemm_sum`) in their own tiles, product after
    product added to c (`deepdsl_small_gemm_sum`), rather than by the sgemm: with vectors of `lanes` of
    SMALL_PRODUCT_PACKED_LANES (AVX-512) where the tiles take each product (`small_product`). On a Zen 5 with
    AVX-512, ResNet-50's pointwise filter gradients at batch 8 (512 x 196 by 196 x 128 read transposed and the like)
    ran 1.7-2.2x the sgemm's speed at one and two threads; built for AVX2, against OpenBLAS's Haswell kernels,
    0.90-1.06x: there the sgemm keeps them. Which path, and so the bits, depends on the vectors' width, never on the
    thread count."""
    return lanes >= SMALL_PRODUCT_PACKED_LANES and small_product(m, n, k, ta, tb, lanes)


DOT_PRODUCT_ROWS = 16           # rows of a at most for the dot products (kernels/cpu_gemm.c, DEEPDSL_DOT_MOST)
DOT_PRODUCT_FLOATS = 1 << 22    # floats of b at least: past the caches, read from memory
DOT_PRODUCT_LANES = 16          # vector lanes at least: with AVX2's 8 they tie the sgemm (docs/performance.md)


def dot_product(m: int, n: int, k: int, ta: bool, tb: bool, lanes: int = DOT_PRODUCT_LANES) -> bool:
    """Whether the compiled kernels compute a product c (m x n) = a (m x k) b (k x n) read transposed (b's n rows
    of k floats) as dot products of a's rows and b's, reading each row of b once as it lies (`deepdsl_dot_gemm`: the
    same bits on any number of threads, with AVX2 as with AVX-512): a fully connected layer's forward on a small
    batch, of at most DOT_PRODUCT_ROWS rows, whose weights of DOT_PRODUCT_FLOATS floats or more come from memory.
    The sgemm packs b and the tiles transpose it into strips: on AlexNet's fc6 (16 x 9216 by 4096 x 9216 read
    transposed) both read the weights at about half the speed at which one core reads memory. `lanes`: the compiled
    kernels' vector lanes; with fewer than DOT_PRODUCT_LANES the dot products are no faster than the sgemm, which
    computes the product (so which path it takes, and its bits, depends on the processor's vector width, never on
    the thread count; no workspace either way)."""
    return lanes >= DOT_PRODUCT_LANES and not ta and tb and m <= DOT_PRODUCT_ROWS and n * k >= DOT_PRODUCT_FLOATS


PRODUCT_DEPTH_PART = 256        # a depth cut's part: this many of the inner dimension at least


def product_depth_cut(batch: int, m: int, n: int, k: int) -> int:
    """How many parts of its inner dimension a single product whose output is too small to cut (`product_cuts`
    gives it one part: a weight gradient, 64 x 1024 by 1024 x 64) is computed in, by the compiled kernels given
    `product_depth_scratch` of workspace: 4 or 2 parts of at least PRODUCT_DEPTH_PART of k and PRODUCT_PART_WORK
    multiply-adds, summed in their order (1: none). Fixed by the shapes: the same bits on any number of threads."""
    if batch != 1 or product_cuts(batch, m, n, k).parts > 1:
        return 1
    return next((p for p in (4, 2) if k // p >= PRODUCT_DEPTH_PART and m * n * k // p >= PRODUCT_PART_WORK), 1)


SMALL_PRODUCT_CHUNKS = 8        # a product of the tiles is cut in depth in at most this many chunks


def small_product_chunks(batch: int, m: int, n: int, k: int, ta: bool = False, tb: bool = False,
                         lanes: int = 8) -> int:
    """The chunks of SMALL_PRODUCT_DEPTH of its inner dimension a single product the kernels' own tiles compute
    (`small_product`, vectors of `lanes`) and the depth cut takes (`product_depth_cut`) is computed in on several
    threads, each chunk's partial sums in a plane of its own (`product_depth_scratch`), with the same bits as on
    one (1: it is not; at most SMALL_PRODUCT_CHUNKS)."""
    chunks = -(-k // SMALL_PRODUCT_DEPTH)
    if product_depth_cut(batch, m, n, k) < 2 or not small_product(m, n, k, ta, tb, lanes) or \
            chunks > SMALL_PRODUCT_CHUNKS:
        return 1
    return chunks


def product_depth_scratch(batch: int, m: int, n: int, k: int, ta: bool = False, tb: bool = False) -> int:
    """matmul: the partial products of a depth cut beside the output (the first part is computed into it): of the
    BLAS's parts, or of the tiles' chunks (`small_product_chunks`; `ta` / `tb`: an operand read transposed) as
    the kernels of the widest vectors take them (`WIDEST_LANES`: the plan is made before the program meets its
    processor, and narrower vectors' tiles take no product the widest's do not)."""
    parts = product_depth_cut(batch, m, n, k)
    if parts > 1:
        parts = max(parts, small_product_chunks(batch, m, n, k, ta, tb, WIDEST_LANES))
    return (parts - 1) * m * n


# ----------------------------------------------------------------------------------------------------------------
# window geometry

def out_size(size: int, kernel: int, stride: int, pad: int, ceil: bool = False) -> int:
    """Window positions along an axis of `size` elements padded by `pad` on each side. `ceil` counts a last,
    partial window (Caffe's and PyTorch's ceil mode) as long as it starts inside the input or its left padding."""
    span = size + 2 * pad - kernel
    if ceil:
        out = -(-span // stride) + 1
        if (out - 1) * stride >= size + pad:   # the last window must start inside the input (Caffe, PyTorch)
            out -= 1
        return out
    return span // stride + 1


def avg_pool_divisor(size, kernel: int, stride: int, pad: int, ceil: bool, include_pad: bool) -> np.ndarray:
    """(Ho, Wo) integer array: the number of elements each averaging window over an input of spatial `size` (H, W)
    divides by (PyTorch's rule): the window clipped to the padded input, or with `include_pad` false to the input
    itself."""
    h, w = size
    ho, wo = out_size(h, kernel, stride, pad, ceil), out_size(w, kernel, stride, pad, ceil)

    def counts(n, on):
        start = np.arange(on) * stride - pad
        end = np.minimum(start + kernel, n + pad)
        if not include_pad:
            return np.minimum(end, n) - np.maximum(start, 0)
        return end - start

    return np.outer(counts(h, ho), counts(w, wo))


# ----------------------------------------------------------------------------------------------------------------
# random masks

COUNTER_KEY_STEP = 65536     # dropout keys of one step: a network applies dropout at fewer than this many places


def counter_key(step: int, key: int) -> int:
    """The second Philox key word of the mask of dropout `key` at training step `step` (the first is the seed):
    distinct for every (step, key), so every mask is independent of what ran before and reproducible on resume."""
    return int(step) * COUNTER_KEY_STEP + int(key)


def mask_generator(seed: int, step: int, key: int) -> np.random.Generator:
    """The random stream the mask of dropout `key` at `step` draws its float32 uniforms from, in order."""
    return np.random.Generator(np.random.Philox(key=[seed, counter_key(step, key)]))


def bernoulli_mask(seed: int, step: int, key: int, shape, keep: float) -> np.ndarray:
    """The mask of dropout `key` at `step`: 1 where the float32 uniform drawn from `mask_generator`'s stream is
    below `keep` (the reference semantics; every backend's masks are these bytes)."""
    return (mask_generator(seed, step, key).random(shape, dtype=np.float32) < keep).astype(np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# scratch: float32 elements per sample (or row) of each CPU kernel's workspace

FLOAT_BYTES = 4     # workspaces are float32 arrays


def bool_floats(count: int) -> int:
    """Workspace elements `count` booleans take (four to an element)."""
    return -(-count // FLOAT_BYTES)


def _per_sample(shape) -> int:
    """Elements of one sample (row) of a tensor of `shape`."""
    return int(math.prod(shape[1:]))


def pointwise_conv(kh: int, kw: int, stride: int, pad: int) -> bool:
    """A 1x1 stride-1 unpadded convolution: a GEMM on the input itself, in every direction."""
    return kh == 1 and kw == 1 and stride == 1 and pad == 0


WIDE_PLANE = 256    # output planes (Ho*Wo) at least this large make per-sample products efficient
# What moving one float (an addition or a copy in a memory-bound pass) costs, in the floating-point operations a matrix
# product does meanwhile: measured here (2 cores; col2im at about 0.35 ns a float against products at 150 GFLOP/s)
ADD_COST_FLOPS = 50
PRODUCT_LANES = 16  # the columns of a product's vector (AVX-512's floats): narrower planes leave lanes idle
PRODUCT_STRIP = 64  # the columns of a strip of the compiled products' tiles, for which a is read once


def one_product(hw: int, groups: int = 1, pointwise: tuple[int, int] | None = None) -> bool:
    """Whether a convolution (forward, or input gradient of a pointwise or strided one) whose output planes have
    `hw` positions runs as one product over a chunk of samples rather than as a product per sample (too narrow to
    keep the BLAS threads busy on small planes): its operand regrouped to (rows, samples*hw) in the workspace, and
    room there for the product's result (the forward's goes into its output, then is regrouped by sample through
    the workspace).

    A pointwise one (`pointwise_conv`: the product reads its operand in place), whose product is (m x k) by (k x hw)
    with `pointwise` = (k, m), only on planes narrower than a strip (PRODUCT_STRIP), and there only where regrouping
    costs less than the products per sample waste: regrouping moves (k + 2 m) hw floats a sample (ADD_COST_FLOPS
    each); a product per sample reads a's k m floats for a strip it fills hw / PRODUCT_STRIP of, and computes the
    idle lanes of its last vector (2 k m FLOPs a lane). Measured on ResNet-50's and MobileNet-v2's layers (AVX-512,
    one and two threads), the products per sample against one product regrouped: at 14x14, 1.2-3.2x as fast; at
    7x7, 0.8-0.9x with 256 and 1024 channels, 1.05-1.4x with MobileNet-v2's 64 to 576; at 4x4, 0.55-0.9x."""
    if groups != 1:
        return False
    if pointwise is None:
        return hw < WIDE_PLANE
    k, m = pointwise
    if hw >= PRODUCT_STRIP:
        return False
    wasted = k * m * (ADD_COST_FLOPS * (PRODUCT_STRIP - hw) / PRODUCT_STRIP + 2 * (-hw % PRODUCT_LANES))
    return ADD_COST_FLOPS * (k + 2 * m) * hw < wasted


DIRECT_CONV_ROWS = 32       # at most this many products per output (C*kh*kw) for direct convolution
DIRECT_CONV_WIDTH = 8       # kernels at most this wide (runtime/kernels/cpu_conv.c: DEEPDSL_DIRECT_KW)


def direct_conv(c: int, kh: int, kw: int, stride: int, groups: int = 1) -> bool:
    """A thin stride-1 convolution (C*kh*kw <= DIRECT_CONV_ROWS, kernels at most DIRECT_CONV_WIDTH wide, not
    pointwise; a first layer on images of few channels): the compiled kernels compute it and its filter gradient
    straight from the input (runtime/kernels/cpu_conv.c), without the im2col matrix (its workspace stays planned:
    numpy's kernels, which the program falls back to, use it). A pointwise one is a product on the input itself,
    which the matrix-product library runs several times faster than these kernels (its filter gradient:
    `pointwise_filter`)."""
    return groups == 1 and stride == 1 and kw <= DIRECT_CONV_WIDTH and c * kh * kw <= DIRECT_CONV_ROWS and \
        kh * kw > 1


TILED_CONV_FLOATS = 1 << 21     # a sample's im2col matrix of at most this many floats, for convolutions in the tiles


def tiled_conv(c: int, o: int, kh: int, kw: int, stride: int, pad: int, ho: int, wo: int, groups: int = 1,
               op: str = "conv2d") -> bool:
    """A convolution (not pointwise: that is a product on the input itself) whose product per sample the kernels'
    tiles compute (`small_product`): for `op` "conv2d", the filters (O, C*kh*kw) by the sample's im2col matrix
    (C*kh*kw, Ho*Wo); for "conv2d_bwd_data", the filters read transposed by the sample's output gradient
    (O, Ho*Wo), its column gradients. The compiled kernels compute it sample by sample, each sample's matrix in a
    part of the workspace (which holds one at least: `conv2d_scratch`, `conv2d_bwd_data_scratch`), multiplied
    straight into the sample's output, or its column gradients added into its input gradient (col2im)
    (runtime/kernels/cpu_gemm.c: `deepdsl_conv_tiles`, `deepdsl_conv_data_tiles`), where a thin (`direct_conv`) or
    blocked one (`blocked_conv`) does not run before. The same bits as the tiles' product of each sample's matrix
    (and of several samples' matrix where the tiles compute that product), and its col2im. Measured against the
    matrix of a chunk of samples (AVX-512, one and two threads): LeNet's second layer 1.75-2.0x as fast forward,
    1.3-1.5x its input gradient; stride-2 layers 1.1-1.4x; AlexNet's 1.0-1.1x; an input gradient of a 7x7 layer of
    64 channels at 56x56, its sample's matrix 2.5 M floats, 0.95x: matrices up to TILED_CONV_FLOATS."""
    if groups != 1 or pointwise_conv(kh, kw, stride, pad) or c * kh * kw * ho * wo > TILED_CONV_FLOATS:
        return False
    if op == "conv2d_bwd_data":
        return small_product(c * kh * kw, ho * wo, o, True, False)
    return small_product(o, ho * wo, c * kh * kw, False, False)


POINTWISE_FILTER_CHANNELS = 32   # pointwise filter gradients of at most this many input (or output) channels


def pointwise_filter(c: int, o: int, hw: int, kh: int, kw: int, stride: int, pad: int, groups: int = 1) -> bool:
    """A pointwise convolution's filter gradient of few input channels (at most POINTWISE_FILTER_CHANNELS), or of
    few output channels on planes of at least WIDE_PLANE positions (MobileNet's expansions and projections): a
    product with a very long inner dimension and a thin side, which the compiled kernels compute straight from the
    output gradient and the input (runtime/kernels/cpu_conv.c), without their transposed copies, before the thin
    convolutions' kernels (`direct_conv`) would: a matrix-product library, or those, run such products several
    times slower."""
    return pointwise_conv(kh, kw, stride, pad) and groups == 1 and (
        c <= POINTWISE_FILTER_CHANNELS or (o <= POINTWISE_FILTER_CHANNELS and hw >= WIDE_PLANE))


FILTER_BY_SAMPLES_PLANE = 196   # output planes (Ho*Wo) at least this large: pointwise filter gradients by samples


def filter_by_samples(kh: int, kw: int, stride: int, pad: int, hw: int, groups: int = 1) -> bool:
    """A pointwise convolution's filter gradient on planes of at least FILTER_BY_SAMPLES_PLANE positions (ResNet's
    1x1 layers at 14x14 and larger): the compiled kernels sum one product per sample straight from the output
    gradient and the input (`Native.gemm_sum`), without the transposed copies of both that make them one product
    (1.2-1.4x faster on ResNet-50's layers at 14x14 and 28x28; slower on smaller planes, whose products are too
    shallow). Either way in the op's planned workspace, which the sums leave unused."""
    return pointwise_conv(kh, kw, stride, pad) and groups == 1 and hw >= FILTER_BY_SAMPLES_PLANE


THIN_FILTER_CHANNELS = 4     # input channels at most of a thin filter gradient (images of 1, 3 or 4 channels)
THIN_FILTER_WIDTH = 11       # kernels at most this wide (runtime/kernels/cpu_blocked.c: DEEPDSL_THIN_KW)


def thin_filter(c: int, o: int, kh: int, kw: int, stride: int, pad: int, groups: int = 1) -> bool:
    """A thin layer's filter gradient of any stride: few input channels (at most THIN_FILTER_CHANNELS), a kernel
    larger than 1x1 of at most THIN_FILTER_WIDTH columns, BLOCKED_CONV_CHANNELS output channels at least, and not
    the thin stride-1 kernels' (`direct_conv`): a first layer on images (ResNet's 7x7 by stride 2, AlexNet's 11x11
    by 4, a ViT's patch embedding). The compiled kernels sum it straight from the zero-padded input and the blocked
    output gradient (runtime/kernels/cpu_blocked.c: `deepdsl_thin_filter`), 16 output channels a vector, where the
    planned workspace holds them (`thin_filter_scratch`); its im2col matrix is C*kh*kw rows deep and its product too
    thin for the sgemm (ResNet-50's conv1 by im2col and the sgemm: 59 GFLOP/s on one thread)."""
    return groups == 1 and c <= THIN_FILTER_CHANNELS and 1 < kw <= THIN_FILTER_WIDTH and \
        o >= BLOCKED_CONV_CHANNELS and not direct_conv(c, kh, kw, stride, groups)


def thin_filter_scratch(g_shape, x_shape, kernel, pad: int) -> tuple[int, int]:
    """A thin filter gradient's workspace (`thin_filter`) in floats: (per sample, once), the once part first: once
    its blocked sums (ceil(O / 16), C, kh, kw, 16); per sample the output gradient blocked (ceil(O / 16), Ho, Wo,
    16) and, with padding, the input padded (C, H + 2 pad, W + 2 pad). The chunks of samples: `blocked_samples`."""
    (_, o, ho, wo), (_, c, h, w), (kh, kw) = g_shape, x_shape, kernel
    padded = c * (h + 2 * pad) * (w + 2 * pad) if pad else 0
    return channel_blocks(o) * ho * wo * CHANNEL_BLOCK + padded, channel_blocks(o) * c * kh * kw * CHANNEL_BLOCK


CHANNEL_BLOCK = 16          # channels a blocked copy keeps together (runtime/kernels/cpu_blocked.c: DEEPDSL_BLOCK)
BLOCKED_CONV_CHANNELS = 16  # input and output channels at least, for direct convolution on blocked copies
BLOCKED_CONV_ROW = 7        # output rows at least this long: shorter ones leave the tiles' registers idle, and
                            # their layers' filters (converted on every call) outweigh their few positions
BLOCKED_FILTER_ROW = 14     # the filter gradient's rows at least: on rows of 7 the product of the im2col matrix
                            # is as fast with AVX2's vectors of 8 floats,
WIDE_FILTER_ROW = 7         # slower than the blocked sums with AVX-512's of 16 (docs/performance.md)
WIDEST_LANES = 16           # AVX-512's: the memory plan reserves what the kernels of the widest vectors take


def blocked_conv(c: int, o: int, kh: int, kw: int, stride: int, pad: int, wo: int, groups: int = 1,
                 op: str = "conv2d", lanes: int = WIDEST_LANES) -> bool:
    """A stride-1 "same" convolution (an odd square kernel larger than 1x1, padded by half its width: a residual
    network's 3x3 layers) of many channels (at least BLOCKED_CONV_CHANNELS in and out, filling their blocks to
    three quarters at least) with output rows at least BLOCKED_CONV_ROW long (for `op` "conv2d_bwd_filter",
    WIDE_FILTER_ROW where `lanes`, the compiled kernels' vector lanes, are 16, else BLOCKED_FILTER_ROW): the
    compiled kernels compute it (`op`: the convolution or either of its gradients) directly on channel-blocked
    copies of its operands (runtime/kernels/cpu_blocked.c), in the op's planned workspace where it holds them
    (`blocked_scratch`); numpy's kernels, and the compiled ones where it does not, use im2col. The memory plan asks
    for the widest lanes, so that its workspace holds the copies on any processor; the runtime asks for its
    library's, so which path a layer takes (and its bits) depends on the processor's vector width, never on the
    thread count. (The kernels take any stride-1 geometry, but other padding makes the input gradient's convolution
    sum over padding, and emptier blocks sum over zero channels.)"""
    filled = 4 * c * o >= 3 * CHANNEL_BLOCK ** 2 * channel_blocks(c) * channel_blocks(o)
    row = BLOCKED_CONV_ROW if op != "conv2d_bwd_filter" else \
        WIDE_FILTER_ROW if lanes >= WIDEST_LANES else BLOCKED_FILTER_ROW
    return (groups == 1 and stride == 1 and kh == kw > 1 and kh % 2 == 1 and 2 * pad == kh - 1
            and wo >= row and min(c, o) >= BLOCKED_CONV_CHANNELS and filled)


def channel_blocks(c: int) -> int:
    """Blocks of CHANNEL_BLOCK channels that hold `c` channels (the last one padded with zeros)."""
    return -(-c // CHANNEL_BLOCK)


BLOCKED_CHUNK_BYTES = 1 << 23  # a blocked convolution's operands copied at a time at most: they stay in the cache


def blocked_samples(batch: int, per_sample: int, once: int, room: int | None = None,
                    chunk_bytes: int = BLOCKED_CHUNK_BYTES) -> int:
    """How many samples a blocked convolution copies and computes at a time (`blocked_scratch`'s `per_sample` and
    `once` floats): the batch, at most BLOCKED_CHUNK_BYTES of copies, at most what `room` floats of workspace hold
    after the once part (one at least). The plan reserves exactly that many samples' room, and the kernel, handed
    that workspace, takes the same number."""
    samples = min(batch, max(1, chunk_bytes // FLOAT_BYTES // max(per_sample, 1)))
    if room is not None:
        samples = min(samples, max(1, (room - once) // max(per_sample, 1)))
    return samples


def blocked_scratch(op: str, x_shape, w_shape, pad: int) -> tuple[int, int]:
    """A blocked convolution's workspace (`blocked_conv`) in floats: (per sample, once), the once part first. For
    conv2d the input blocked with its padding, and the filters blocked; for conv2d_bwd_data the output gradient
    blocked with the padding of the transposed convolution (k - 1 - pad), and the filters blocked, turned around;
    for conv2d_bwd_filter the input blocked with its padding and the output gradient blocked, and the gradient's
    blocked sums. `x_shape` is the forward's input, `w_shape` its filters."""
    (_, c, h, w), (o, _, kh, kw) = x_shape, w_shape
    ho, wo = h + 2 * pad - kh + 1, w + 2 * pad - kw + 1
    filters = channel_blocks(o) * channel_blocks(c) * kh * kw * CHANNEL_BLOCK * CHANNEL_BLOCK
    padded = channel_blocks(c) * (h + 2 * pad) * (w + 2 * pad) * CHANNEL_BLOCK
    if op == "conv2d":
        return padded, filters
    if op == "conv2d_bwd_data":
        return channel_blocks(o) * (ho + 2 * (kh - 1 - pad)) * (wo + 2 * (kw - 1 - pad)) * CHANNEL_BLOCK, filters
    return padded + channel_blocks(o) * ho * wo * CHANNEL_BLOCK, filters


WINOGRAD_OUT = 4            # outputs of a Winograd tile along each axis: F(4x4, 3x3) (runtime/kernels/cpu_winograd.c)
WINOGRAD_POINTS = 36        # points of a transformed tile: (4 + 3 - 1) ** 2
WINOGRAD_SKEW = 16          # floats past each point's transformed filters (runtime/kernels/cpu_winograd.c:
                            # DEEPDSL_WINO_SKEW): a transform's 36 stores of an input channel fall in 36 sets of L1
WINOGRAD_ROW = 4            # output rows at least: the 4x4 layers of 512 channels (one tile a sample) take F(4x4,
                            # 3x3) too; their filter gradients only by pairs (`winograd_pairs`), whose tiles are few
WINOGRAD_CHUNK_BYTES = 1 << 22  # a Winograd convolution's copies, tiles and products at a time at most (their
                                # passes stay in the last-level cache; chunks of 2 MiB, a sample of a 28x28 layer of 64
                                # channels, made two threads wait at three barriers a sample: 11 % slower), or as many
                                # as its transformed filters, which each chunk's products read once (many channels on
                                # small planes: fewer, larger chunks)


def winograd_conv(c: int, o: int, kh: int, kw: int, stride: int, pad: int, wo: int, groups: int = 1,
                  op: str = "conv2d") -> bool:
    """A convolution the blocked kernels take (`blocked_conv`, by the forward's rule whatever `op`, its rows of
    WINOGRAD_ROW at least) with a 3x3 kernel, its input gradient (the same convolution of the output gradient) or
    its filter gradient: the compiled kernels compute it by Winograd's F(4x4, 3x3) (runtime/kernels/cpu_winograd.c),
    36 multiplications for every 4 x 4 outputs of a pair of channels where the direct sums take 144, where the
    planned workspace holds its arrays (`winograd_samples`), else directly (rows shorter than `blocked_conv`'s, and
    the filter gradient of rows shorter than BLOCKED_FILTER_ROW with AVX2's lanes: by im2col). Its rounding is not
    the direct sums' (within float32's tolerance); like theirs it depends on neither the vectors' width nor the
    thread count."""
    return kh == kw == 3 and blocked_conv(c, o, kh, kw, stride, pad,
                                          max(wo, BLOCKED_CONV_ROW) if wo >= WINOGRAD_ROW else 0, groups)


def winograd_tiles(h: int, w: int) -> int:
    """Winograd tiles of an (h, w) output plane: 4 x 4 outputs each, the last row and column of tiles partly past
    it."""
    return -(-h // WINOGRAD_OUT) * -(-w // WINOGRAD_OUT)


WINOGRAD_FILTER_BYTES = 1 << 22  # a Winograd convolution's transformed filters at most: a range of output blocks at
                                 # a time, which stays in the cache over the tiles and keeps the workspace it touches
                                 # near the direct sums' (a layer of 512 channels would take 36 MiB at once)


def winograd_blocks(op: str, x_shape, w_shape) -> tuple[int, int, int]:
    """(input blocks, output blocks, output blocks a range) of a Winograd convolution (`winograd_scratch`): ranges of
    as equal sizes as can be whose transformed filters fit WINOGRAD_FILTER_BYTES (one block at least), each range's
    filters transformed and its outputs computed at a time. For conv2d_bwd_data the convolution's inputs are the
    forward's outputs."""
    c, o = x_shape[1], w_shape[0]
    ins, outs = (channel_blocks(o), channel_blocks(c)) if op == "conv2d_bwd_data" else \
        (channel_blocks(c), channel_blocks(o))
    per_block = FLOAT_BYTES * WINOGRAD_POINTS * ins * CHANNEL_BLOCK ** 2
    ranges = -(-outs // max(1, WINOGRAD_FILTER_BYTES // per_block))
    return ins, outs, -(-outs // ranges)


def winograd_scratch(op: str, x_shape, w_shape, pad: int, room: int | None = None) -> tuple[int, int]:
    """A Winograd convolution's workspace (`winograd_conv`) in floats: (per sample, once), the once part first:
    once a range's filters transformed (36 points, WINOGRAD_SKEW floats past each; `winograd_blocks`), straight from
    their own layout; per sample the convolution's input blocked with its padding (`blocked_scratch`), its tiles
    transformed, and their products with a range's filters (36 points of each tile of each block of inputs, and of
    the range's outputs). For
    conv2d_bwd_data the convolution's input is the output gradient and its output the input gradient. For
    conv2d_bwd_filter once the blocked gradient and a range's sums (36 points of each pair of blocks), per sample the
    input blocked with its padding and the output gradient blocked (`blocked_scratch`), the input's tiles
    transformed and the range's output gradient's; by pairs (`winograd_pairs`) neither the sums nor the blocked
    gradient, and every output block's gradient's tiles transformed (those fit `room` floats: `winograd_pairs`)."""
    h, w = x_shape[2:]
    per_sample, filters = blocked_scratch(op, x_shape, w_shape, pad)
    ins, outs, blocks = winograd_blocks(op, x_shape, w_shape)
    points = WINOGRAD_POINTS * winograd_tiles(h, w) * CHANNEL_BLOCK
    if winograd_pairs(op, x_shape, w_shape, pad, room):
        return per_sample + points * (ins + outs), 0
    if op == "conv2d_bwd_filter":
        return per_sample + points * (ins + blocks), filters + WINOGRAD_POINTS * ins * blocks * CHANNEL_BLOCK ** 2
    return per_sample + points * (ins + blocks), WINOGRAD_POINTS * (ins * blocks * CHANNEL_BLOCK ** 2 + WINOGRAD_SKEW)


def winograd_samples(batch: int, op: str, x_shape, w_shape, pad: int, room: int | None = None) -> int:
    """How many samples a Winograd convolution (`winograd_scratch`) copies, transforms and multiplies at a time, 0
    where `room` floats of workspace do not hold its arrays: `blocked_samples` within WINOGRAD_CHUNK_BYTES or a
    range's transformed filters' bytes, whichever is larger, and the room. For conv2d_bwd_filter a multiple of its
    partial sums' samples (`winograd_sum_samples`) where that many fit, so that the chunks do not change its sums;
    and with several ranges of output blocks the whole batch or nothing: each range sums over every chunk, whose
    copies and transformed tiles it would make again (ResNet's 512 channels at 7x7, batch 8, on one thread: 17 ms
    in chunks of 7 and 1, 12 in one, 19.5 by the direct sums); by pairs (`winograd_pairs`) too, and on rows shorter
    than BLOCKED_CONV_ROW by pairs only. The plan reserves that many samples' room; the kernel takes the same
    number."""
    per_sample, once = winograd_scratch(op, x_shape, w_shape, pad, room)
    if room is not None and room < once + per_sample:
        return 0
    ins, outs, blocks = winograd_blocks(op, x_shape, w_shape)
    pairs = winograd_pairs(op, x_shape, w_shape, pad, room)
    if op == "conv2d_bwd_filter" and not pairs and x_shape[3] < BLOCKED_CONV_ROW:
        return 0                    # (short rows' filter gradients by pairs only: their sums lost to im2col)
    if pairs or (op == "conv2d_bwd_filter" and blocks < outs):
        return batch if room is None or room >= once + batch * per_sample else 0
    transformed = FLOAT_BYTES * WINOGRAD_POINTS * ins * blocks * CHANNEL_BLOCK ** 2
    samples = blocked_samples(batch, per_sample, once, room, max(WINOGRAD_CHUNK_BYTES, transformed))
    if op == "conv2d_bwd_filter" and samples < batch:
        together = winograd_sum_samples(*x_shape[2:])
        samples = max(1, samples // together * together) if samples >= together else samples
    return samples


WINOGRAD_PAIR_TILES = 128   # a filter gradient whose batch has at most this many tiles (or rows too short for the
                            # ranges) goes by pairs of blocks where their transformed tiles take at most
WINOGRAD_PAIR_BYTES = 1 << 25   # this many bytes and it has at least
WINOGRAD_PAIR_BLOCKS = 16       # this many pairs of blocks for the threads to share; or where it has at most
WINOGRAD_FEW_TILES = 64         # this many tiles


def winograd_pairs(op: str, x_shape, w_shape, pad: int, room: int | None = None) -> bool:
    """A Winograd filter gradient by pairs of channel blocks: its whole batch at once, each pair's 36 sums on the
    stack and transformed at once (runtime/kernels/cpu_winograd.c: `deepdsl_winograd_filter_pairs`), where the sums
    of a range of output blocks, written and read back for every chunk for a few products a float, cost more than
    the whole batch's transformed tiles kept: a batch of at most WINOGRAD_PAIR_TILES tiles (ResNet-50's 4x4 and 7x7
    layers at batch 8 to 32, its 14x14 at batch 8; measured against the ranges on an AVX2 Zen 3: 1.03-1.17x faster
    at 128 tiles, 0.81-1.0x at 256, 0.85-0.95x at 392: benchmarks/winograd_pairs.py), or any batch of rows shorter
    than the ranges' (their filter gradients otherwise by im2col), whose transformed tiles take at most
    WINOGRAD_PAIR_BYTES with at least WINOGRAD_PAIR_BLOCKS pairs (a thread takes whole pairs); or a batch of at most
    WINOGRAD_FEW_TILES tiles; and where `room` floats hold the whole batch's arrays (`winograd_scratch`), else by
    ranges. The same bits as the ranges' of the whole batch at once. `x_shape` is the forward's input, `w_shape` its
    filters."""
    if op != "conv2d_bwd_filter":
        return False
    (n, c, h, w), o = x_shape, w_shape[0]
    tiles = n * winograd_tiles(h, w)
    points = WINOGRAD_POINTS * tiles * CHANNEL_BLOCK * (channel_blocks(c) + channel_blocks(o))
    if tiles > WINOGRAD_FEW_TILES and (tiles > WINOGRAD_PAIR_TILES and w >= BLOCKED_CONV_ROW or
                                       FLOAT_BYTES * points > WINOGRAD_PAIR_BYTES or
                                       channel_blocks(c) * channel_blocks(o) < WINOGRAD_PAIR_BLOCKS):
        return False
    return room is None or room >= n * blocked_scratch(op, x_shape, w_shape, pad)[0] + points


WINOGRAD_SUM_TILES = 256    # tiles a partial sum of the filter gradient's products adds at most, one sample's at
                            # least (runtime/kernels/cpu_blocked.c: DEEPDSL_SUM_TERMS)


def winograd_sum_samples(h: int, w: int) -> int:
    """The samples whose tiles one partial sum of a Winograd filter gradient adds (`winograd_samples`): as many whole
    samples as WINOGRAD_SUM_TILES tiles hold, one at least. The partial sums begin at each chunk's first sample."""
    return max(1, WINOGRAD_SUM_TILES // winograd_tiles(h, w))


def _padded_input(c: int, h: int, w: int, pad: int) -> int:
    """Elements of a zero-padded copy of one (C, H, W) sample; none without padding."""
    return c * (h + 2 * pad) * (w + 2 * pad) if pad else 0


def conv2d_scratch(x_shape, w_shape, out_shape, stride: int, pad: int, groups: int = 1) -> int:
    """conv2d: the im2col matrix (C*kh*kw, Ho*Wo) and with padding the zero-padded input (with or without `groups`:
    the im2col matrix holds every group's rows); as one product (`one_product`), room for the larger of the im2col
    matrix and the result regrouped (max(C*kh*kw, O) * Ho*Wo); when pointwise, the input regrouped and then the
    result (max(C, O) * Ho*Wo) as one product, or none."""
    (_, c, h, w), (o, _, kh, kw), (ho, wo) = x_shape, w_shape, out_shape[2:]
    if pointwise_conv(kh, kw, stride, pad):
        return max(c, o) * ho * wo if one_product(ho * wo, groups, (c, o)) else 0
    one = one_product(ho * wo, groups)
    return max(c * kh * kw, o if one else 0) * ho * wo + _padded_input(c, h, w, pad)


def conv2d_bwd_data_scratch(g_shape, w_shape, size, stride: int, pad: int, groups: int = 1) -> int:
    """conv2d_bwd_data, for an input of spatial `size`. Stride 1 without groups: the output gradient widened to
    rows as wide as the padded input (O, Ho*Wp), the column gradients (C*kh*kw, Ho*Wp) and the padded input gradient
    (C, Hp*Wp + kw - 1), which also holds each other scheme of runtime/cpu/conv.py (the "columns" one needs
    (O + C*kh*kw) * Ho*Wo); other strides as one product (`one_product`): the output gradient regrouped and the
    column gradients ((O + C*kh*kw) * Ho*Wo), else (and any stride with `groups`) the column gradients
    (C*kh*kw, Ho*Wo); when pointwise, the output gradient regrouped and then the result (max(O, C) * Ho*Wo) as one
    product, or none."""
    (_, o, ho, wo), (_, ci, kh, kw), (h, w) = g_shape, w_shape, size
    c = ci * groups
    if pointwise_conv(kh, kw, stride, pad):
        return max(o, c) * ho * wo if one_product(ho * wo, groups, (o, c)) else 0
    one = one_product(ho * wo, groups)
    if stride != 1 or groups > 1:
        return ((o if one else 0) + c * kh * kw) * ho * wo
    hp, wp = h + 2 * pad, w + 2 * pad
    return (o + c * kh * kw) * ho * wp + c * (hp * wp + kw - 1)


def conv2d_bwd_filter_scratch(g_shape, x_shape, kernel, pad: int, groups: int = 1) -> tuple[int, int]:
    """conv2d_bwd_filter: (per sample, once when the batch runs in more than one chunk). Per sample the im2col
    matrix (C*kh*kw, Ho*Wo), the output gradient transposed (O, Ho*Wo) and with padding the zero-padded input; once
    an accumulator of the weights' size (O, C/groups*kh*kw), at the start of the workspace."""
    (_, o, ho, wo), (_, c, h, w), (kh, kw) = g_shape, x_shape, kernel
    ckk = c * kh * kw
    return (ckk + o) * ho * wo + _padded_input(c, h, w, pad), o * (ckk // groups)


def pool_padded_scratch(size, pooled, kernel: int, stride: int, pad: int, channels: int) -> int:
    """The padded copy of one sample that pooling reads from (or its backward scatters into) when windows leave the
    input (padding, or ceil mode's last window): (C, max(Hp, H+p), max(Wp, W+p)); none otherwise. `size` is the
    input's (H, W), `pooled` the output's (Ho, Wo)."""
    (h, w), (ho, wo) = size, pooled
    hp, wp = (ho - 1) * stride + kernel, (wo - 1) * stride + kernel
    if pad == 0 and hp <= h and wp <= w:
        return 0
    return channels * max(hp, h + pad) * max(wp, w + pad)


def max_pool_scratch(x_shape, out_shape, kernel: int, stride: int, pad: int) -> int:
    """max_pool (and avg_pool): the padded input when windows leave it."""
    return pool_padded_scratch(x_shape[2:], out_shape[2:], kernel, stride, pad, x_shape[1])


avg_pool_scratch = max_pool_scratch


def max_pool_argmax_scratch(x_shape, out_shape, kernel: int, stride: int, pad: int) -> int:
    """max_pool_argmax: the padded input when windows leave it, the window maxima (output-sized) and a boolean
    'differs' mask (output-sized)."""
    out = _per_sample(out_shape)
    return max_pool_scratch(x_shape, out_shape, kernel, stride, pad) + out + bool_floats(out)


def max_pool_bwd_scratch(g_shape, out_shape, kernel: int, stride: int, pad: int) -> int:
    """max_pool_bwd (`out_shape` the input gradient's): the padded gradient target when windows leave the input, a
    boolean 'hit' mask (gradient-sized) and, when windows overlap, each window offset's share (gradient-sized)."""
    per_g = _per_sample(g_shape)
    padded = pool_padded_scratch(out_shape[2:], g_shape[2:], kernel, stride, pad, out_shape[1])
    return padded + bool_floats(per_g) + (per_g if stride < kernel else 0)


def avg_pool_bwd_scratch(g_shape, out_shape, kernel: int, stride: int, pad: int) -> int:
    """avg_pool_bwd (`out_shape` the input gradient's): the padded gradient target when windows leave the input and
    each window's share (gradient-sized)."""
    padded = pool_padded_scratch(out_shape[2:], g_shape[2:], kernel, stride, pad, out_shape[1])
    return padded + _per_sample(g_shape)


def lrn_scratch(shape) -> int:
    """lrn: the scale and the squares, each input-sized."""
    return 2 * _per_sample(shape)


def lrn_bwd_scratch(shape) -> int:
    """lrn_bwd: the scale, the inner term and its window sum, each input-sized."""
    return 3 * _per_sample(shape)


LAYER_NORM_PART_ROWS = 64     # rows of a part of layer_norm_param_grad's sums: fixed by the shape, one thread's


def layer_norm_rows(shape, axes: int) -> tuple[int, int]:
    """(rows, features) of a layer norm over the last `axes` axes of `shape`: each row is normalized on its own."""
    cut = len(shape) - axes
    return math.prod(shape[:cut]), math.prod(shape[cut:])


def layer_norm_parts(rows: int) -> int:
    """The parts of the rows whose sums layer_norm_param_grad's CPU kernel adds one after the other."""
    return max(1, -(-rows // LAYER_NORM_PART_ROWS))


def layer_norm_param_scratch(rows: int, features: int) -> int:
    """layer_norm_param_grad: each part's sums of g * xhat and of g, in double (two floats each), on the CPU; each
    row's mean and 1 / std on the CUDA device. The larger of the two."""
    return max(layer_norm_parts(rows) * 2 * features * 2, 2 * rows)


def log_softmax_scratch(shape) -> int:
    """log_softmax, per row: the exponentials."""
    return _per_sample(shape)


def bernoulli_scratch(shape) -> int:
    """bernoulli, per row (a scalar mask is one row): the float32 uniforms it draws."""
    shape = tuple(shape) or (1,)
    return _per_sample(shape)


def broadcast_steps(shape) -> list[int]:
    """The element strides of a C-contiguous array of `shape`, 0 along its axes of size 1: how it is read
    broadcast to a shape of as many axes (attention's bias, read by the CPU's and the CUDA kernels in place)."""
    steps, size = [], 1
    for extent in reversed(tuple(shape)):
        steps.append(0 if extent == 1 else size)
        size *= extent
    return steps[::-1]


ATTENTION_ROWS = 64     # queries the CPU's attention kernels weigh at a time (the CUDA ones: one per thread)


def attention_rows(t: int) -> int:
    """How many queries of a unit (one batch index and head) the CPU's attention kernels weigh at a time."""
    return min(t, ATTENTION_ROWS)


ATTENTION_UNIT = 64     # the most queries, keys and features of a unit the CPU's kernels weigh whole, on one thread


def attention_unit_shape(shape, heads: bool) -> tuple[int, ...]:
    """The (..., T, d) shape of the units' rows of an operand of attention: with `heads`, an operand stored (..., T,
    H, d) (a projection's output reshaped, `deepdsl.ops.attention`'s attribute) has the units (..., H) of (T, d):
    its last axes but one swapped; else the shape itself."""
    shape = tuple(shape)
    return (*shape[:-3], shape[-2], shape[-3], shape[-1]) if heads else shape


def attention_in_units(t: int, s: int, d: int, e: int) -> bool:
    """Whether the compiled CPU kernels weigh each unit of (t, d) queries against (s, d) keys and (s, e) values
    whole, on one thread, with no workspace (`deepdsl_attention_units`), with or without dropout: where each is at
    most ATTENTION_UNIT. (A character model's causal heads of 64 tokens with dropout, 32 x 4 units of 16 features,
    on a Zen 3: forward and gradient 1.03x as fast as the row passes between products of blocks of units on one
    thread, 1.36x on two (benchmarks/small_kernels.py), and the heads read in place of their transposes.)"""
    return max(t, s, d, e) <= ATTENTION_UNIT


def attention_scratch(t: int, s: int) -> int:
    """attention, per unit of (T, d) queries against (S, d) keys: the weights of a block of queries."""
    return attention_rows(t) * s


def attention_grad_scratch(t: int, s: int, d: int, e: int, dropout: bool = False) -> int:
    """attention_grad, per unit: a block's weights and their gradient (and, with dropout, the weights kept), and
    one block's share of the keys' and the values' gradients (added up over the blocks); a unit's row statistics
    (log-sum-exp and dO . O) beside them."""
    r = attention_rows(t)
    return (3 if dropout else 2) * r * s + (s * max(d, e) if r < t else 0) + 2 * t


EW_SUM_CHUNK_BYTES = 1 << 23      # an ew_sum's chunk of samples: cache-sized, so its two passes stay in the cache


def ew_sum_scratch(full_shape, out_shape) -> tuple[int, int, bool]:
    """ew_sum, the sum to `out_shape` of an elementwise expression of `full_shape`: (floats per sample, floats once
    when the batch runs in more than one chunk, whether it may run in chunks of samples). Per sample the
    expression's values; once the sum of a chunk (added to the output); chunks only where the sum adds up the
    leading axis (else the whole tensor at once, as one "sample")."""
    full, out = tuple(full_shape), tuple(out_shape)
    lead = len(full) - len(out)
    chunked = len(full) > 0 and full[0] > 1 and (lead > 0 or out[0] == 1)
    per_sample = math.prod(full[1:]) if chunked else math.prod(full)
    return per_sample, math.prod(out), chunked


def stage_floats(input_bytes: int, output_bytes: int, batch: int) -> int:
    """Elements a kernel whose output takes over its input's bytes stages one sample through, at the end of its
    workspace after the op's own scratch: one sample of the smaller of input and output."""
    return min(input_bytes // batch, output_bytes // batch) // FLOAT_BYTES


# ----------------------------------------------------------------------------------------------------------------
# compiled elementwise kernels

def operand_letter(shape, uint8: bool, out_shape) -> str | None:
    """How an operand of shape `shape` reaches a compiled elementwise kernel writing `out_shape` (the compiler
    picks the kernels to compile by it, the runtime the kernel to call): `f` a float32 tensor of the output's size
    (`u` a uint8 one), `s` one element, `c` one value per channel (axis 1 of an output of 3 or more axes: a (1, C,
    1, 1) batch-norm or bias operand), `r` one value per position of the last axis (a bias of a fully connected
    layer), `w` one value per row of the output's trailing axes, its leading axes the output's and its trailing
    ones 1 ((..., 1): a layer norm's statistics of each token; (N, C, 1, 1): squeeze-and-excitation's scale of each
    sample's channel); None for any other broadcast, and for a uint8 operand broadcast (the kernels read those as
    floats: stochastic depth's per-sample masks run numpy's kernels). A scalar (shape ()) is `s` whatever the output:
    a hyperparameter arrives as a number."""
    size, out_size_ = math.prod(shape), math.prod(out_shape)
    if tuple(shape) == ():
        return "s"
    if size == out_size_:
        return "u" if uint8 else "f"
    if size == 1:
        return "s"
    if uint8 or len(shape) > len(out_shape):
        return None
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    if len(out_shape) >= 3 and padded == (1, out_shape[1]) + (1,) * (len(out_shape) - 2):
        return "c"
    if len(out_shape) >= 2 and padded == (1,) * (len(out_shape) - 1) + (out_shape[-1],):
        return "r"
    lead = len(padded)
    while lead > 0 and padded[lead - 1] == 1:
        lead -= 1
    if 0 < lead < len(out_shape) and padded[:lead] == tuple(out_shape[:lead]):
        return "w"
    return None


def operand_pattern(shapes_and_uint8, out_shape) -> str | None:
    """The letters of a kernel call's operands (`operand_letter`), or None when one is broadcast otherwise or the
    operands run over different rows (`kernel_rows`): channel operands with last-axis ones, per-row operands of
    different sizes, or per-row operands beside channel or last-axis ones whose rows are not theirs."""
    letters = [operand_letter(shape, uint8, out_shape) for shape, uint8 in shapes_and_uint8]
    if None in letters or ("c" in letters and "r" in letters):
        return None
    pattern = "".join(letters)
    rows = {math.prod(shape) for (shape, _), letter in zip(shapes_and_uint8, letters) if letter == "w"}
    if len(rows) > 1 or rows and ("c" in pattern or "r" in pattern) and rows != {kernel_rows(pattern, out_shape)[0]}:
        return None
    return pattern


def pair_function(first: str, first_pattern: str, second: str, second_pattern: str,
                  summed: bool = False) -> str | None:
    """The compiled library's function computing elementwise kernel `first` over operands of `first_pattern` and
    then `second` (which reads the first's output) over `second_pattern`, in one pass over the elements. There is
    one for each pair of patterns the program calls: whole tensors and scalars (letters f, u and s) for two
    stored results; with `summed`, the second summed per channel (`channel_sum_pattern`, over rows of channels as
    `kernel_rows`), per-channel and per-row operands (c, w) allowed in both, and last-axis ones (r) where that
    pattern gives them.
    None for other patterns (the pair is two calls)."""
    letters = "fuscrw" if summed else "fsu"      # (summed: r only under a row view, `channel_sum_pattern`)
    if not set(first_pattern + second_pattern) <= set(letters):
        return None
    return f"deepdsl_{first}_{first_pattern}_then_{second}_{second_pattern}" + ("_csum" if summed else "")


def many_function(kernel: str, pattern: str) -> str | None:
    """The compiled library's function computing elementwise kernel `kernel` on several sets of operands of
    `pattern` at once (a batch of statements, `deepdsl.passes.fuse_horizontal`): whole tensors and scalars only
    (letters f, u and s); None for other patterns (one call each)."""
    if not pattern or not set(pattern) <= set("fsu"):
        return None
    return f"deepdsl_{kernel}_{pattern}_many"


def sum_view(values_shape, out_shape) -> tuple[int, ...] | None:
    """The shape under which a compiled kernel sums `values_shape` to `out_shape` per channel: (N, C, ...) of 3 or
    more axes to (1, C, 1, ...) as it is (batch norm's statistics); a sum over the last axis, (..., D) to (..., 1)
    (a layer norm's over each token's features), as (1, R, D) to (1, R, 1), each of the R rows a channel of its
    own; a sum over every axis but the last, (..., D) to (D,) (a bias's gradient, a layer norm weight's), as (R,
    D, 1) to (1, D, 1), each of the D columns a channel; None for other sums."""
    values, out = tuple(values_shape), tuple(out_shape)
    padded = (1,) * (len(values) - len(out)) + out
    if len(values) >= 3 and padded == (1, values[1]) + (1,) * (len(values) - 2):
        return values
    if len(values) >= 2 and out == values[:-1] + (1,) and values[-1] > 1:
        return (1, math.prod(values[:-1]), values[-1])
    if len(values) >= 2 and padded == (1,) * (len(values) - 1) + values[-1:] and values[-1] > 1 and \
            math.prod(values[:-1]) > 1:
        return (math.prod(values[:-1]), values[-1], 1)
    return None


def _viewed(shape, values_shape, view) -> tuple[int, ...] | None:
    """An operand of `shape` (broadcast to `values_shape`) as it reads under `view` (`sum_view`): itself when the
    view is the values' shape; else whole (f), one element (s), and under a view of rows one value per row (..., 1)
    (c) or one per position of the last axis, as a layer norm's weight (r), under a view of columns one per position
    of the last axis (c); None otherwise."""
    if tuple(view) == tuple(values_shape):
        return tuple(shape)
    size = math.prod(shape)
    if size in (1, math.prod(values_shape)):
        return (1,) * 3 if size == 1 else tuple(view)
    padded = (1,) * (len(values_shape) - len(shape)) + tuple(shape)
    if view[0] != 1:                           # columns (R, D, 1)
        return (1, view[1], 1) if padded == (1,) * (len(values_shape) - 1) + (values_shape[-1],) else None
    if padded == tuple(values_shape[:-1]) + (1,):
        return (1, view[1], 1)
    return (1, 1, view[2]) if padded == (1,) * (len(values_shape) - 1) + (values_shape[-1],) else None


def channel_sum_pattern(shapes_and_uint8, values_shape, out_shape) -> str | None:
    """The operand pattern (`operand_pattern`, under `sum_view`) of a kernel whose values a compiled kernel sums to
    `out_shape` per channel, never storing them (an ew_sum; the first kernel of a summed pair writes those values
    and is called under the same view), of operands that are whole tensors, scalars, per-channel values or one
    value per row of the sum (`channel_rows`: a sample's channel); None where numpy's chunks sum them."""
    view = sum_view(values_shape, out_shape)
    if view is None:
        return None
    viewed = [(_viewed(shape, values_shape, view), uint8) for shape, uint8 in shapes_and_uint8]
    if any(shape is None for shape, _ in viewed):
        return None
    pattern = operand_pattern(viewed, view)
    # last-axis operands (r) only where each row of the last axis is one channel's values: element i of the row
    # reads their element i
    rows_are_channels = len(view) == 3 and view[0] == 1 and view[2] == tuple(values_shape)[-1]
    letters = "fuscrw" if rows_are_channels else "fuscw"
    if pattern is None or not set(pattern) <= set(letters) or \
            any(letter == "w" and math.prod(shape) != view[0] * view[1] for (shape, _), letter in zip(viewed, pattern)):
        return None
    return pattern


def channel_rows(values_shape, out_shape) -> tuple[int, int, int]:
    """(rows, channels, inner) of a compiled per-channel sum of `values_shape` to `out_shape` (`sum_view`): samples
    times channels rows of `inner` values, row k of channel k % channels."""
    view = sum_view(values_shape, out_shape)
    return view[0] * view[1], view[1], math.prod(view[2:])


def kernel_rows(pattern: str, out_shape, rows: int | None = None) -> tuple[int, int, int]:
    """(rows, channels, inner) a compiled kernel of `pattern` runs over: the output as rows of `inner` elements,
    the channel of row k being k % channels (channel operands: a row for each sample's channel), or rows of the
    last axis (last-axis operands: row k's position i reads their element i), or else `rows` rows, the size of its
    per-row operands; row k reads element k of per-row ones (`operand_pattern`: all of them have as many
    elements as the rows)."""
    size = math.prod(out_shape)
    if "c" in pattern:
        inner = math.prod(out_shape[2:])
        return size // max(inner, 1), out_shape[1], inner
    if "r" in pattern:
        return size // max(out_shape[-1], 1), 1, out_shape[-1]
    if "w" in pattern:
        return rows, 1, size // rows
    return 1, 1, size
