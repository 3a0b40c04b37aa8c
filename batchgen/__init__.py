"""batchgen: offline batch generation for Hugging Face-format causal LMs."""

__version__ = "0.1.0"
