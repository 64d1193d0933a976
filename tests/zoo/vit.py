"""ViT image classifier (tiny config, random weights, nothing downloaded)."""
import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTForImageClassification
from zoo_common import examples_of, sgd

CLASSES = 3


def model():
    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_labels=CLASSES,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


def batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    return (torch.randn(4, 3, 16, 16, generator=g),), {}, torch.randint(0, CLASSES, (4,), generator=g)


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    return F.cross_entropy(output.logits, target)


optimizer = sgd
split_points = ["vit.layers.1"]
