"""A tiny Hugging Face Llama (``transformers.LlamaForCausalLM``) as a tracepp model file.

    pip install transformers
    tracepp split examples/hf_llama.py -o out --ranks 2 --schedule 1f1b --microbatches 4
    torchrun --nproc-per-node 2 out/run.py --steps 5 --save out/trained.pt

The model is built from a config (random weights, nothing downloaded) with the LM head tied to the token
embedding (``tie_word_embeddings=True``): stage 0 looks tokens up in the matrix and the last stage projects
onto it, and the pipeline sums the two copies' gradients so they stay identical. ``example_kwargs()`` passes
``use_cache=False``: with the cache on, the output holds a ``DynamicCache``, which torch.export cannot
return. ``loss_fn`` receives the same ``CausalLMOutputWithPast`` eager forward returns. ``split_points``
starts a new stage at ``model.layers.2`` (module FQNs as in ``model.named_modules()``); ``--split-points``
or ``--stages`` on the command line override it. The saved checkpoint loads with
``model().load_state_dict(torch.load("out/trained.pt"))``.
"""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, HIDDEN, N_LAYER, N_HEAD, SEQ, BATCH = 256, 64, 4, 4, 32, 8


def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                         num_hidden_layers=N_LAYER, num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD,
                         max_position_embeddings=SEQ, tie_word_embeddings=True, attention_dropout=0.0,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return LlamaForCausalLM(config)


def _tokens(step: int):
    generator = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def example_inputs():
    return (_tokens(0)[0],)


def example_kwargs():
    return {"use_cache": False}


def example_target():
    return _tokens(0)[1]


def batch(step):
    idx, target = _tokens(step)
    return (idx,), {"use_cache": False}, target


def loss_fn(output, target):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


split_points = ["model.layers.2"]
