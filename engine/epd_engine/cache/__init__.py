"""Paged block bookkeeping (pure Python). The tensors that hold the pages live in the runner."""
