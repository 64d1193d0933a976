"""llama2.c (github.com/karpathy/llama2.c), vendored: ``model.py`` unchanged, with its MIT license."""
