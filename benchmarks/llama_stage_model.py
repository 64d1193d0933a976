"""A Llama-shaped pipeline *stage* as a tracepp model file: N Hugging Face decoder layers, nothing else.

    LLAMA_STAGE_LAYERS=8 LLAMA_STAGE_HIDDEN=4096 tracepp split benchmarks/llama_stage_model.py -o out --ranks 1 --stages 1

What one rank of a 4-stage Llama-7B pipeline holds in the middle of the model: ``LLAMA_STAGE_LAYERS``
``transformers`` ``LlamaDecoderLayer``s (default 8 of 7B's 32: hidden 4096, 32 heads, intermediate 11008) with
the rotary tables they read, taking and returning hidden states. The input is a hidden-state batch (what the
previous stage would send); the loss is the mean square of the output (a stand-in for the rest of the model:
it gives every parameter a gradient). Sizes come from environment variables so the same file serves the GPU
benchmark (``benchmarks/gpu_stage.py``) and a tiny CPU check.
"""
import os

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

LAYERS = int(os.environ.get("LLAMA_STAGE_LAYERS", "8"))
HIDDEN = int(os.environ.get("LLAMA_STAGE_HIDDEN", "4096"))
HEADS = int(os.environ.get("LLAMA_STAGE_HEADS", "32"))
KV_HEADS = int(os.environ.get("LLAMA_STAGE_KV_HEADS", str(HEADS)))
INTERMEDIATE = int(os.environ.get("LLAMA_STAGE_INTERMEDIATE", "11008"))
SEQ = int(os.environ.get("LLAMA_STAGE_SEQ", "4096"))
BATCH = int(os.environ.get("LLAMA_STAGE_BATCH", "4"))  # samples per step (the pipeline's microbatches chunk it)


def config() -> LlamaConfig:
    cfg = LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, max_position_embeddings=SEQ,
                      vocab_size=32000, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


class LlamaStage(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, index) for index in range(cfg.num_hidden_layers))

    def forward(self, hidden):
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary(hidden, positions)
        for layer in self.layers:
            out = layer(hidden, position_ids=positions, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def model():
    torch.manual_seed(0)
    return LlamaStage(config())


def _hidden(step: int):
    generator = torch.Generator().manual_seed(3000 + step)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=generator)


def example_inputs():
    return (_hidden(0),)


def example_target():
    return torch.zeros(BATCH)


def batch(step):
    return (_hidden(step),), {}, torch.zeros(BATCH)


def loss_fn(output, target):
    return output.float().pow(2).mean() + 0.0 * target.sum()


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-4)


def num_params() -> int:
    h, i, kv = HIDDEN, INTERMEDIATE, KV_HEADS * (HIDDEN // HEADS)
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h
    return LAYERS * per_layer


def flops_per_step(tokens: int) -> float:
    """Model FLOPs of one training step (forward + backward) over ``tokens`` tokens: 6 * params * tokens for
    the matmuls plus 12 * layers * hidden * seq * tokens for attention scores and values (as torchtitan and
    PaLM count them; causal masking not discounted)."""
    return 6.0 * num_params() * tokens + 12.0 * LAYERS * HIDDEN * SEQ * tokens
