"""BERT encoder with a sequence-classification head (tiny config, random weights, nothing downloaded)."""
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification
from zoo_common import examples_of, sgd, token_batch

VOCAB, CLASSES = 64, 3


def model():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=32, num_labels=CLASSES,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def batch(step):
    ids, _ = token_batch(step, VOCAB)
    labels = torch.randint(0, CLASSES, (ids.shape[0],), generator=torch.Generator().manual_seed(step))
    return (ids,), {"attention_mask": torch.ones_like(ids)}, labels


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    return F.cross_entropy(output.logits, target)


optimizer = sgd
split_points = ["bert.encoder.layer.1"]
