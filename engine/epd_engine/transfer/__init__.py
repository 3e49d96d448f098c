"""Cache migration between instances (DESIGN.md §4): control messages + byte-moving backends."""
