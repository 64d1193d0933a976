"""T5 encoder-decoder (tiny config, random weights, nothing downloaded); the split falls between them."""
import torch
from transformers import T5Config, T5ForConditionalGeneration
from zoo_common import causal_lm_loss, examples_of, sgd, token_batch

VOCAB = 64


def model():
    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def batch(step):
    source, _ = token_batch(step, VOCAB)
    decoder_ids, target = token_batch(step + 100, VOCAB)
    return (source,), {"decoder_input_ids": decoder_ids, "use_cache": False}, target


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["decoder"]
