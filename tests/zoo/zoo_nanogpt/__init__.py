"""A nanoGPT-style GPT in plain PyTorch, as a package beside the model file that imports it."""
