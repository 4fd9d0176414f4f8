"""raymt: distributed training of Transformer translation models on Ray."""

__version__ = "0.1.0"
