"""fusectl: re-lay out model checkpoints with declarative rules and prove they compute the same."""

__version__ = "0.1.0"
