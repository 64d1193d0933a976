"""transformers (pip ``transformers``) BitNet quantization-aware training: a tiny ``LlamaForCausalLM`` whose
linear layers (all but ``lm_head``) are replaced by ``replace_with_bitnet_linear`` with ``BitNetQuantConfig(
linear_class="autobitlinear", quantization_mode="online")``: ``AutoBitLinear`` quantizes its weight with
``WeightQuant`` (ternary) and its input with ``ActQuant`` (8-bit), both ``torch.autograd.Function``s with a
straight-through backward (identity) and a ``@torch.compile``d forward."""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version
from transformers import BitNetQuantConfig
from transformers.integrations.bitnet import replace_with_bitnet_linear

LIBRARY, VERSION = "transformers", version("transformers")
SOURCE = ("transformers/integrations/bitnet.py (replace_with_bitnet_linear, AutoBitLinear, WeightQuant, "
          "ActQuant), transformers/models/llama/modeling_llama.py")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    m = hf_llama()
    state = m.state_dict()
    config = BitNetQuantConfig(linear_class="autobitlinear", quantization_mode="online")
    replace_with_bitnet_linear(m, modules_to_not_convert=["lm_head"], quantization_config=config)
    m.to_empty(device="cpu")  # the replaced layers are made on the meta device; the weights are loaded back
    m.load_state_dict(state, strict=False)
    m.model.rotary_emb.__init__(m.config)  # its inv_freq buffer (non-persistent) was emptied by to_empty
    return m


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
