"""Placeholder being replaced."""
def fuse_elementwise(graph):
    return graph
