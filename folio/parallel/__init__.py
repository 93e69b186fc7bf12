"""Model parallelism applied to a loaded model: the rank group and its collectives, the tensor-parallel pass."""
