"""Tensor parallelism: one instance's language model over several ranks (issue 34)."""
