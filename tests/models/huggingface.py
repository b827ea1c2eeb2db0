"""Hugging Face models from their configs (nothing downloaded), returned as users return them."""

from __future__ import annotations

import torch
from torch import nn


class Logits(nn.Module):
    """A Hugging Face model's ``logits`` as the forward's one tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs).logits


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _tokens(batch: int = 2, length: int = 12, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(3))


def gpt2_logits() -> dict:
    """GPT-2 returning its logits, with the default loss (cross-entropy per token)."""
    return {"module": Logits(tiny_gpt2()), "inputs": _tokens()}


def gpt2_as_is() -> dict:
    """GPT-2 returned as is: its forward returns a ``ModelOutput``."""
    return {"module": tiny_gpt2(), "inputs": _tokens()}


def gpt2_lora() -> dict:
    """LoRA adapters from ``peft`` on GPT-2's attention; the base model frozen."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                                   fan_in_fan_out=True))
    return {"module": model, "inputs": _tokens()}


def distilbert() -> dict:
    """DistilBERT classifying sequences, returned as is (a ModelOutput)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(vocab_size=64, max_position_embeddings=16, dim=32, hidden_dim=64, n_layers=2,
                              n_heads=2, num_labels=3, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
    return {"module": DistilBertForSequenceClassification(config), "inputs": _tokens()}


def vit() -> dict:
    """A small ViT classifying 32x32 images."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, num_labels=4, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    return {"module": ViTForImageClassification(config), "inputs": images}


def mobilenet_v2() -> dict:
    """MobileNetV2 (depthwise convolutions, BatchNorm, ReLU6) on 8 images of 64x64."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    config = MobileNetV2Config(image_size=64, num_labels=10, depth_multiplier=0.35, classifier_dropout_prob=0.0)
    images = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    return {"module": MobileNetV2ForImageClassification(config), "inputs": images}
