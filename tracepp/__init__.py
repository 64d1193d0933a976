"""tracepp: pipeline-parallel training from one traced PyTorch model."""
__version__ = "0.1.0"

from tracepp.runtime.markers import pipe_split

__all__ = ["pipe_split", "__version__"]
