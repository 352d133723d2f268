"""warmspec: keep a language model warm and make it write faster by exact speculative decoding."""

__version__ = "0.1.0"
