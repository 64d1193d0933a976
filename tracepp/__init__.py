"""tracepp: pipeline-parallel training from one traced PyTorch model."""
__version__ = "0.1.0"
