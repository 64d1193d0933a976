"""Meta's reference Llama 3 (``llama_models.llama3.model.Transformer``), as ``llama_models_llama3.py`` builds it,
called through ``Transformer.forward`` without its ``@torch.inference_mode()`` decorator (model.py:280;
``LLAMA_MODELS_FORWARD=train``): the same function, ``Transformer.forward.__wrapped__``, bound to the instance, so
that the loss has gradients (``start_pos=0``: the whole sequence written into the key/value cache and read back).
"""
import os

os.environ["LLAMA_MODELS_FORWARD"] = "train"
from llama_models_llama3 import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                                 example_kwargs, example_target, loss_fn, model, optimizer)
