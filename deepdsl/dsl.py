"""The DSL network files are written in: tensors, layers as tensor functions composed with `@`, a solver, a Loop.

    network = fc2 @ D.relu @ fc1 @ D.flatten @ mp @ cv2 @ mp @ cv1     # `@` composes, right to left
    loss = (D.log_loss(y) @ D.softmax @ network)(x)

Every argument of a layer, input, initializer and solver is checked where it is given, and applying a layer builds
graph nodes right away, so shapes are checked while the network file runs: a bad argument is an `ArgumentError` and
a shape mismatch a `ShapeError`, each one line naming the layer and the network-file line that defined it.

This module is the language's one name space (`from deepdsl import dsl as D`); the definitions live in
`deepdsl/frontend/` by concept: `core` (argument checks, size overrides, tensors and inputs, tensor functions,
parameters), `layers` and `training` (losses and metrics, solvers, the Loop).
"""
from __future__ import annotations

from deepdsl.frontend.core import (Fn, Layer, Overrides, Param, Tensor, constant, fn, gaussian, images, labels, param,
                                   scalar, targets, tokens, v, where, xavier)
# what the loader sets while a network file runs (deepdsl/loader.py)
from deepdsl.frontend.core import _dropout_keys as _dropout_keys, _leaf_makers as _leaf_makers
from deepdsl.frontend.core import _overrides as _overrides
from deepdsl.frontend.layers import (ELEMENTWISE_FUNCTIONS, ELEMENTWISE_HELPERS, adaptive_avg_pool, adaptive_max_pool,
                                     add, attention, avg_pool, batch_norm, causal_softmax, clipped_relu, concat, conv,
                                     conv_transpose, drop_path, dropout, elementwise, embedding, flatten, full,
                                     layer_norm,
                                     log_softmax, lrn, max_pool, pad_channels, relu, sigmoid, softmax, tanh, upsample)
from deepdsl.frontend.training import (Adam, AdamW, Loop, Train, check_names, cross_entropy, log_loss, mse_loss,
                                       nll_loss, precision)

__all__ = [
    # inputs, tensors, tensor functions, parameters
    "Tensor", "Fn", "Layer", "fn", "images", "tokens", "labels", "targets", "scalar", "param", "Param", "xavier",
    "gaussian", "constant", "Overrides", "v", "where",
    # layers
    "conv", "conv_transpose", "full", "embedding", "upsample", "max_pool", "avg_pool", "adaptive_avg_pool",
    "adaptive_max_pool", "relu", "tanh", "sigmoid", "clipped_relu", "elementwise", "lrn", "dropout", "drop_path",
    "batch_norm",
    "layer_norm", "pad_channels", "concat", "add", "flatten", "softmax", "causal_softmax", "log_softmax", "attention",
    "ELEMENTWISE_FUNCTIONS", "ELEMENTWISE_HELPERS",
    # losses, metrics, training
    "log_loss", "cross_entropy", "nll_loss", "mse_loss", "precision", "Train", "Adam", "AdamW", "Loop", "check_names",
]
