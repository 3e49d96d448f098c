"""EPD stage-role engine: one process that can play any of the E, P, D roles."""

__version__ = "0.1.0"
