"""One module per ``epdctl`` subcommand; each exposes ``register(subparsers)``."""
