"""nanoGPT (github.com/karpathy/nanoGPT), vendored: ``model.py`` unchanged, with its MIT license."""
