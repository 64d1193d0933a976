"""lucidrains' GateLoop transformer (``gateloop_transformer.Transformer``, pip ``gateloop-transformer``), its own
classes unchanged, on its pure-PyTorch path (``GateLoopedAttention``, not the JAX ``gateloop_transformer_jax`` nor
``SimpleGateLoopLayer``'s ``use_jax_associative_scan``): pre-RMSNorm blocks (lucidrains' ``F.normalize * sqrt(dim) *
gamma``) whose token mixer is data-controlled gated linear attention: one fused ``to_qkv`` projection chunked in
three and split into 4 heads folded into the batch (``'b n (h d) -> (b h) n d'``), a per-head complex state
transition from ``to_a`` (``Linear(dim, heads * 2)`` with a bias, ``view_as_complex``, ``abs``/``angle``, then
``torch.polar(magnitude.sigmoid(), phase)``, its gradient scaled by ``a * 0.9 + a.detach() * 0.1``), the outer
products ``k v^T`` made complex (``+ 0.j``) and scanned by ``associative_scan`` (a pure-PyTorch Blelloch-style scan,
a recursion over strided slices, ``torch.cat``, ``stack`` and ``flatten``), read out by ``q`` over the real part,
then a SiLU output gate (``to_gates``) and ``to_out``; a GELU MLP with biases, a final RMSNorm and an untied head;
dim 64, 4 gate-loop heads of 16, 2 layers, ff_mult 2, vocabulary 128.

The library's default ``checkpoint_gate_looped_attn=True``: the scan runs through ``torch.utils.checkpoint.checkpoint``
without ``use_reentrant`` (gateloop_transformer.py:284-286), the reentrant form, torch's ``CheckpointFunction``, whose
forward runs the scan under ``torch.no_grad()``. torch.export (2.13) then put the checkpointed scan and everything
after it under ``wrap_with_set_grad_enabled(False, ...)``, and the split was refused by name until 2026-12-03; it is
traced since with the function's forward recorded (``tracepp/custom_functions.py``). ``GATELOOP_CHECKPOINT=0``
builds it without.
"""
import os

import torch
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from gateloop_transformer import Transformer

LIBRARY, VERSION = "gateloop-transformer", version("gateloop-transformer")
SOURCE = "gateloop_transformer/gateloop_transformer.py (Transformer, GateLoopedAttention, gate_loop_operator, " \
         "PreNorm, RMSNorm), gateloop_transformer/associative_scan.py (associative_scan)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # gate-loop heads; no grouped-query form
CHECKPOINT = os.environ.get("GATELOOP_CHECKPOINT", "1") == "1"


def model():
    torch.manual_seed(0)
    return Transformer(dim=HIDDEN, num_tokens=VOCAB, depth=LAYERS, ff_mult=2, use_gate_looped_attn=True,
                       gate_loop_heads=HEADS, checkpoint_gate_looped_attn=CHECKPOINT)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
