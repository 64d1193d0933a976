"""minGPT (github.com/karpathy/minGPT), vendored: ``mingpt/model.py`` and ``mingpt/utils.py`` unchanged, with its MIT
license."""
