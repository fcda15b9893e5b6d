"""Optimization passes, one per module, each a pure function from a Graph (or Program) to a new one."""
