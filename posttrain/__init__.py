"""posttrain: PyTorch-native LLM post-training pipeline orchestrated by Snakemake."""

__version__ = "0.1.0"
