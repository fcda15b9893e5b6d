"""The definitions of `deepdsl.dsl`, the language network files are written in, by concept: `core` (argument
checks, size overrides, tensors and inputs, tensor functions, parameters), `layers`, `training` (losses and metrics,
solvers, the Loop). Network files use them through `deepdsl.dsl`."""
