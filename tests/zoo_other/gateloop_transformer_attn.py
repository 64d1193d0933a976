"""lucidrains' GateLoop transformer in its attention form (``gateloop_transformer.Transformer`` with
``use_gate_looped_attn=False``, pip ``gateloop-transformer``), its own classes unchanged: ``CausalFullAttention`` with
``data_dependent_rel_pos``, the paper's attention-form GateLoop: a fused ``to_qkv`` projection rearranged to
``qkv b h n d``, a per-head, per-feature-pair complex transition from ``to_a`` (``view_as_complex``, ``abs``/``angle``,
``torch.polar(magnitude.sigmoid(), phase)``, its gradient scaled by ``a * 0.9 + a.detach() * 0.1``), its ``cumprod``
over the sequence, whose real part (clamped) multiplies the queries and whose inverse multiplies the keys; ``einsum``
scores with a causal ``triu`` mask filled with 0 and no softmax (``softmax_normalize`` defaults to False with
``data_dependent_rel_pos``), a SiLU output gate (``add_swish_gating``) and a biased ``to_out``; pre-RMSNorm
blocks (``F.normalize * sqrt(dim) * gamma``), a GELU MLP with biases, a final RMSNorm and an untied head; dim 64,
4 heads of 16, 2 layers, ff_mult 2, vocabulary 128.
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, version
from gateloop_transformer import Transformer

LIBRARY, VERSION = "gateloop-transformer", version("gateloop-transformer")
SOURCE = "gateloop_transformer/gateloop_transformer.py (Transformer, CausalFullAttention, PreNorm, RMSNorm)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form


def model():
    torch.manual_seed(0)
    return Transformer(dim=HIDDEN, num_tokens=VOCAB, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS, ff_mult=2,
                       use_gate_looped_attn=False, data_dependent_rel_pos=True, attn_add_swish_gating=True)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss


def optimizer(params):  # SGD at 0.01: the keys are divided by a clamped cumulative product, and at the suite's 0.1
    return torch.optim.SGD(params, lr=0.01)  # eager fp32 on the batch and on two microbatches differ by 3.3e-5
