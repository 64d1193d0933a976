"""transformers (pip ``transformers``) ``LlamaForCausalLM`` at the tiny size with activation checkpointing
turned on as a training script does, ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
True})``: each ``LlamaDecoderLayer`` (a ``GradientCheckpointingLayer``) runs through torch's reentrant
``CheckpointFunction``, and ``enable_input_require_grads`` hooks the embedding's output to require gradients."""
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "transformers", version("transformers")
SOURCE = ("transformers/models/llama/modeling_llama.py (LlamaForCausalLM, gradient_checkpointing_enable), "
          "torch/utils/checkpoint.py (CheckpointFunction)")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    import torch

    torch.manual_seed(0)
    m = hf_llama()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    m.train()
    return m


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
