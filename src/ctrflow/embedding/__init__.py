"""Embedding tables as data, the plain and sharded collections, sparse optimizers, fast kernels."""
