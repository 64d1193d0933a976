"""lucidrains' PaLM from PaLM-rlhf-pytorch (``palm_rlhf_pytorch.PaLM``, pip ``PaLM-rlhf-pytorch``) with a LoRA
fine-tune scope, its own classes unchanged, trained as its RLHF trainer fine-tunes the actor: ``PaLM(...,
finetune_scopes = ('actor',))`` adds a ``ModuleDict`` ``finetune_modules['actor']`` beside the blocks, holding per
layer four ``LoRA`` modules (q, the one key, the one value, the output; ``x @ (A @ B) * scale``, ``A`` drawn from a
normal, ``B`` zero), which the forward zips with the blocks and passes into each (``finetune_scope='actor'``); the
pretrained weights are frozen (``palm_parameters()`` off), the LoRA weights trained (``finetune_parameters('actor')``),
on ``model(seq, return_loss = True)`` (the model splits inputs and labels itself). The PaLM: parallel attention and
SwiGLU feed-forward from one fused projection, multi-query attention, xPos rotary positions, LayerNorm without a
bias, a tied head; dim 64, 4 heads of 16, 2 layers, ff_mult 2, vocabulary 128, LoRA rank 8.
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, returned_loss, sgd, shifted_batch, version
from palm_rlhf_pytorch import PaLM

LIBRARY, VERSION = "PaLM-rlhf-pytorch", version("PaLM-rlhf-pytorch")
SOURCE = "palm_rlhf_pytorch/{palm,lora}.py (PaLM.add_finetune_params, ParallelTransformerBlock, LoRA)"
HEADS_, KV_HEADS_ = HEADS, 1  # multi-query


def model():
    torch.manual_seed(0)
    palm = PaLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS, ff_mult=2,
                finetune_scopes=("actor",))
    for p in palm.palm_parameters():
        p.requires_grad_(False)
    return palm


batch = shifted_batch(finetune_scope="actor")  # the model cuts inputs and labels from L + 1 tokens itself
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = returned_loss  # the model's own loss (return_loss=True returns the cross-entropy alone)


optimizer = sgd
