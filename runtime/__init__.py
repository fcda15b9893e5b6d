"""deepdsl_runtime: what generated deepdsl programs import."""
