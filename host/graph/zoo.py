"""The model zoo: the POET paper's networks as plain ``torch.nn.Module`` code, plus small test models.

Every model is written here from ``torch.nn`` building blocks (there is no torchvision dependency) so
the graph extractor sees ordinary ops. A :class:`ModelSpec` records one sample's input and output
shape, so a :class:`ModelBundle` (module, example batch, labels, loss) can be made without running
the model. Nothing is downloaded: all weights are randomly initialised from a seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from device_agent.errors import UserError

__all__ = [
    "ZOO",
    "ModelBundle",
    "ModelSpec",
    "UnknownModelError",
    "default_loss",
    "output_tensor",
    "get_model_spec",
    "list_models",
    "seeded_labels",
]


# ----------------------------------------------------------------------------- bundle and loss
@dataclass
class ModelBundle:
    """A model ready to profile or train: the module, one example batch, its labels and the loss."""

    name: str
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]  # positional args of module.forward, batch dim first
    labels: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, labels) -> scalar

    def training_loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        """``loss_fn`` on the model's output as returned: a tensor, or a Hugging Face ``ModelOutput``'s ``logits``.

        A loss the model computed itself is returned as is, so plain training uses it; the trace then refuses
        the model, naming the fix (its loss must be a node of its own, computed by ``loss_fn``)."""
        if isinstance(output, Mapping) and output.get("loss") is not None:
            return output["loss"]
        return self.loss_fn(output_tensor(output), labels)


def output_tensor(output):
    """The tensor a loss reads from a model's output: the output itself, or a Hugging Face ``ModelOutput``'s
    ``logits`` (a ModelOutput is a Mapping whose unset fields are absent or None)."""
    if not isinstance(output, Mapping):
        return output
    logits = output.get("logits")
    if logits is None:
        raise TypeError(
            f"the model returned a {type(output).__name__} with {sorted(k for k, v in output.items() if v is not None)} "
            "but no 'logits' (or 'loss'): return the tensor to train on, or give a loss_fn that reads the output"
        )
    return logits


def default_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the output's last dimension (labels have shape output.shape[:-1])."""
    num_classes = output.shape[-1]
    return F.cross_entropy(output.reshape(-1, num_classes), labels.reshape(-1))


def seeded_labels(output_shape: Sequence[int], seed: int) -> torch.Tensor:
    """Random int64 class labels for an output of ``output_shape`` (classes on the last dimension)."""
    shape = tuple(int(d) for d in output_shape)
    if not shape:
        raise ValueError("output_shape needs at least one dimension (the classes)")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape[-1], shape[:-1], generator=generator, dtype=torch.int64)


# ----------------------------------------------------------------------------- MLPs
def _mlp() -> nn.Module:
    """Tiny deterministic classifier for quick tests: 64 features -> 128 -> 128 -> 10 classes."""
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


DIGITS_HIDDEN = 512
DIGITS_HIDDEN_LAYERS = 6


def _digits_mlp() -> nn.Module:
    """The fleet demo's classifier for scikit-learn's 8x8 digits: 64 -> 512 x 6 hidden layers -> 10 classes.

    Deep and narrow on purpose: the hard floor (one layer's activations) is far below the no-remat peak
    (all of them), so a board with little memory gets a real schedule instead of does_not_fit.
    """
    layers: list[nn.Module] = [nn.Linear(64, DIGITS_HIDDEN), nn.ReLU()]
    for _ in range(DIGITS_HIDDEN_LAYERS - 1):
        layers += [nn.Linear(DIGITS_HIDDEN, DIGITS_HIDDEN), nn.ReLU()]
    layers.append(nn.Linear(DIGITS_HIDDEN, 10))
    return nn.Sequential(*layers)


LINEAR_NUM_LAYERS = 10


def _linear() -> nn.Module:
    """The paper's "linear" chain: 10 Linear layers (784 -> 1024 x 9 -> 10) with ReLU in between."""
    widths = [784] + [1024] * (LINEAR_NUM_LAYERS - 1) + [10]
    layers: list[nn.Module] = []
    for index, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(width_in, width_out))
        if index < LINEAR_NUM_LAYERS - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- VGG-16
VGG16_LAYOUT: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")  # fmt: skip


def _vgg16_features() -> nn.Sequential:
    """VGG-16's 13 conv3x3+ReLU layers and 5 max-pools (no BatchNorm, as in the original)."""
    layers: list[nn.Module] = []
    channels_in = 3
    for entry in VGG16_LAYOUT:
        if entry == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers.append(nn.Conv2d(channels_in, int(entry), kernel_size=3, padding=1))
            layers.append(nn.ReLU())
            channels_in = int(entry)
    return nn.Sequential(*layers)


def _vgg16() -> nn.Module:
    """ImageNet VGG-16 (3x224x224 -> 1000): conv stack, then 25088 -> 4096 -> 4096 -> 1000 with dropout."""
    return nn.Sequential(
        _vgg16_features(),
        nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(4096, 1000),
    )


def _vgg16_cifar() -> nn.Module:
    """CIFAR VGG-16 (3x32x32 -> 10): the same conv stack ends at 512x1x1; small 512 -> 512 -> 10 head."""
    return nn.Sequential(
        _vgg16_features(),
        nn.Flatten(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


# ----------------------------------------------------------------------------- ResNets
def _conv_bn(channels_in: int, channels_out: int, kernel_size: int, stride: int = 1) -> nn.Sequential:
    """Bias-free convolution followed by BatchNorm ("same" padding for odd kernels)."""
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, kernel_size, stride=stride, padding=kernel_size // 2, bias=False),
        nn.BatchNorm2d(channels_out),
    )


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity or 1x1-projection shortcut (ResNet-18/34 block)."""

    expansion = 1

    def __init__(self, channels_in: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        channels_out = channels * self.expansion
        self.conv1 = _conv_bn(channels_in, channels, 3, stride)
        self.relu1 = nn.ReLU()
        self.conv2 = _conv_bn(channels, channels_out, 3)
        self.shortcut = (
            _conv_bn(channels_in, channels_out, 1, stride)
            if (stride != 1 or channels_in != channels_out)
            else nn.Identity()
        )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.relu1(self.conv1(x)))
        return self.relu2(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, "ResNet v1.5"), 1x1 expand x4, with a shortcut (ResNet-50 block)."""

    expansion = 4

    def __init__(self, channels_in: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        channels_out = channels * self.expansion
        self.conv1 = _conv_bn(channels_in, channels, 1)
        self.relu1 = nn.ReLU()
        self.conv2 = _conv_bn(channels, channels, 3, stride)
        self.relu2 = nn.ReLU()
        self.conv3 = _conv_bn(channels, channels_out, 1)
        self.shortcut = (
            _conv_bn(channels_in, channels_out, 1, stride)
            if (stride != 1 or channels_in != channels_out)
            else nn.Identity()
        )
        self.relu3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.conv1(x))
        out = self.relu2(self.conv2(out))
        out = self.conv3(out)
        return self.relu3(out + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet: a stem, stages of residual blocks (the first block of a stage carries its stride), avg-pool, fc.

    ``stages`` lists ``(channels, num_blocks, stride)``; ``stem`` maps the image to ``stem_channels``.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        stages: Sequence[tuple[int, int, int]],
        stem: nn.Module,
        stem_channels: int,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.stem = stem
        blocks: list[nn.Module] = []
        channels_in = stem_channels
        for channels, num_blocks, stride in stages:
            for block_index in range(num_blocks):
                blocks.append(block(channels_in, channels, stride if block_index == 0 else 1))
                channels_in = channels * block.expansion
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.blocks(self.stem(x)))))


def _imagenet_stem() -> nn.Sequential:
    """ImageNet ResNet stem: conv7x7/2 (64) + BN + ReLU + max-pool 3x3/2 (224 -> 56 pixels)."""
    return nn.Sequential(_conv_bn(3, 64, 7, stride=2), nn.ReLU(), nn.MaxPool2d(kernel_size=3, stride=2, padding=1))


def _resnet18() -> nn.Module:
    """ImageNet ResNet-18 (3x224x224 -> 1000), BasicBlocks [2, 2, 2, 2]; 11,689,512 parameters."""
    stages = [(64, 2, 1), (128, 2, 2), (256, 2, 2), (512, 2, 2)]
    return ResNet(BasicBlock, stages, _imagenet_stem(), 64, 1000)


def _resnet50() -> nn.Module:
    """ImageNet ResNet-50 (3x224x224 -> 1000), Bottlenecks [3, 4, 6, 3]; 25,557,032 parameters."""
    stages = [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]
    return ResNet(Bottleneck, stages, _imagenet_stem(), 64, 1000)


def _resnet18_cifar() -> nn.Module:
    """The POET paper's CIFAR ResNet (3x32x32 -> 10): conv3x3 stem (16), stages 16/32/64 x 2 BasicBlocks."""
    stem = nn.Sequential(_conv_bn(3, 16, 3), nn.ReLU())
    stages = [(16, 2, 1), (32, 2, 2), (64, 2, 2)]
    return ResNet(BasicBlock, stages, stem, 16, 10)


# ----------------------------------------------------------------------------- BERT-style encoder
BERT_VOCAB_SIZE = 30522
BERT_SEQ_LEN = 512
BERT_HIDDEN = 768
BERT_HEADS = 12
BERT_INTERMEDIATE = 3072
BERT_LAYERS = 12
BERT_DROPOUT = 0.1


class SelfAttention(nn.Module):
    """Multi-head self-attention written out as matmul/softmax so every step is a visible graph op."""

    def __init__(self, hidden: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_dropout = nn.Dropout(dropout)
        self.output = nn.Linear(hidden, hidden)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        return x.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, hidden = x.shape
        query = self._split_heads(self.query(x))
        key = self._split_heads(self.key(x))
        value = self._split_heads(self.value(x))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        weights = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(weights, value).transpose(1, 2).reshape(batch, seq_len, hidden)
        return self.output(context)


class EncoderLayer(nn.Module):
    """A post-LayerNorm BERT layer: attention + residual + LN, then GELU feed-forward + residual + LN."""

    def __init__(self, hidden: int, num_heads: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, num_heads, dropout)
        self.attention_dropout = nn.Dropout(dropout)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn_in = nn.Linear(hidden, intermediate)
        self.ffn_act = nn.GELU()
        self.ffn_out = nn.Linear(intermediate, hidden)
        self.ffn_dropout = nn.Dropout(dropout)
        self.ffn_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention_dropout(self.attention(x)))
        return self.ffn_norm(x + self.ffn_dropout(self.ffn_out(self.ffn_act(self.ffn_in(x)))))


def _init_bert_weights(module: nn.Module) -> None:
    """BERT's initialisation: N(0, 0.02) weights, zero biases; keeps the tied decoder's logits near zero."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class BertMaskedLM(nn.Module):
    """BERT encoder with a masked-LM head: token ids [B, S] -> logits [B, S, vocab].

    Embeddings are word + learned position + token type (always type 0), as in BERT. The decoder's
    weight is tied to the word embedding, as in BERT, so BERT-base has about 110M parameters.
    """

    def __init__(
        self,
        num_layers: int,
        vocab_size: int = BERT_VOCAB_SIZE,
        max_seq_len: int = BERT_SEQ_LEN,
        hidden: int = BERT_HIDDEN,
        num_heads: int = BERT_HEADS,
        intermediate: int = BERT_INTERMEDIATE,
        dropout: float = BERT_DROPOUT,
    ) -> None:
        super().__init__()
        self.word_embedding = nn.Embedding(vocab_size, hidden)
        self.position_embedding = nn.Embedding(max_seq_len, hidden)
        self.token_type_embedding = nn.Embedding(2, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.embedding_dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(
            *(EncoderLayer(hidden, num_heads, intermediate, dropout) for _ in range(num_layers))
        )
        self.head_transform = nn.Linear(hidden, hidden)
        self.head_act = nn.GELU()
        self.head_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab_size)
        self.decoder.weight = self.word_embedding.weight
        self.register_buffer("position_ids", torch.arange(max_seq_len), persistent=False)
        self.apply(_init_bert_weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        positions = self.position_ids[:seq_len]
        embedded = (
            self.word_embedding(input_ids)
            + self.position_embedding(positions)
            + self.token_type_embedding(torch.zeros_like(input_ids))
        )
        hidden = self.layers(self.embedding_dropout(self.embedding_norm(embedded)))
        return self.decoder(self.head_norm(self.head_act(self.head_transform(hidden))))


def _bert() -> nn.Module:
    """BERT-base with a masked-LM head: 12 layers, hidden 768, 12 heads, FFN 3072, seq 512, vocab 30522."""
    return BertMaskedLM(num_layers=BERT_LAYERS)


def _transformer() -> nn.Module:
    """A single BERT-base layer with embeddings and masked-LM head (seq 512, vocab 30522)."""
    return BertMaskedLM(num_layers=1)


# ----------------------------------------------------------------------------- Hugging Face BERT
HF_BERT_VOCAB_SIZE = 512
HF_BERT_SEQ_LEN = 32


class HFLogits(nn.Module):
    """Wraps a Hugging Face model so ``forward(input_ids)`` returns the logits tensor (traceable by torch.export)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, return_dict=True).logits


def _hf_bert() -> nn.Module:
    """A tiny, randomly initialised ``transformers`` BertForMaskedLM (hidden 64, 2 layers, 2 heads, vocab 512).

    Eager attention keeps every step an ordinary op. transformers is imported here, not at module
    import, so the zoo works without it.
    """
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError as error:
        raise ImportError(
            "the 'hf_bert' model needs the Hugging Face transformers package: pip install poet-edge[hf]"
        ) from error
    config = BertConfig(
        vocab_size=HF_BERT_VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    return HFLogits(BertForMaskedLM(config))


# ----------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ModelSpec:
    """How to build one zoo model and an example batch for it.

    ``input_shape`` and ``output_shape`` describe one sample (no batch dimension), so labels can be
    made for any batch size without running the model. ``output_shape[-1]`` is the number of classes.
    """

    name: str
    description: str
    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    input_kind: str  # "float" or "tokens"
    vocab_size: int | None  # for tokens: ids are drawn from [0, vocab_size)
    default_batch_size: int
    builder: Callable[[], nn.Module]
    output_shape: tuple[int, ...]  # one sample's output, without the batch dimension; last dim = classes

    def __post_init__(self) -> None:
        if self.input_kind not in ("float", "tokens"):
            raise ValueError(f"model {self.name!r}: input_kind must be 'float' or 'tokens', got {self.input_kind!r}")
        if self.input_kind == "tokens" and not self.vocab_size:
            raise ValueError(f"model {self.name!r}: token inputs need a vocab_size")

    def build(self, seed: int = 0) -> nn.Module:
        """The module with weights drawn from ``seed``, in train() mode; the global RNG state is left untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.builder()
        return module.train()

    def make_inputs(self, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """One seeded example batch: float32 randn, or int64 token ids in [0, vocab_size)."""
        shape = (batch_size, *self.input_shape)
        generator = torch.Generator().manual_seed(seed)
        if self.input_kind == "tokens":
            assert self.vocab_size is not None  # checked in __post_init__
            return (torch.randint(0, self.vocab_size, shape, generator=generator, dtype=torch.int64),)
        return (torch.randn(shape, generator=generator, dtype=torch.float32),)

    def bundle(self, batch_size: int | None = None, seed: int = 0) -> ModelBundle:
        """Module, seeded inputs and labels at ``batch_size`` (default: ``default_batch_size``), with cross-entropy loss."""
        batch_size = self.default_batch_size if batch_size is None else batch_size
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        return ModelBundle(
            name=self.name,
            module=self.build(seed),
            inputs=self.make_inputs(batch_size, seed),
            labels=seeded_labels((batch_size, *self.output_shape), seed),
            loss_fn=default_loss,
        )


# Default batch sizes: 1 for the ImageNet / BERT models (the paper's edge setting, and what fits a
# board's RAM); 8 for the small CIFAR / MLP models so batch statistics are meaningful yet cheap.
_SPECS: tuple[ModelSpec, ...] = (
    ModelSpec("mlp", "tiny MLP 64 -> 128 -> 128 -> 10 for quick tests", (64,), "float", None, 8, _mlp, (10,)),
    ModelSpec("digits_mlp", "MLP for the 8x8 digits, 64 -> 512 x 6 -> 10 (the fleet demo's model)", (64,), "float", None, 512, _digits_mlp, (10,)),
    ModelSpec("linear", "chain of 10 Linear layers, 784 -> 1024 x 9 -> 10", (784,), "float", None, 8, _linear, (10,)),
    ModelSpec("vgg16", "VGG-16 on ImageNet (3x224x224, 1000 classes)", (3, 224, 224), "float", None, 1, _vgg16, (1000,)),
    ModelSpec("vgg16_cifar", "VGG-16 on CIFAR-10 (3x32x32, 10 classes)", (3, 32, 32), "float", None, 8, _vgg16_cifar, (10,)),
    ModelSpec("resnet18", "ResNet-18 on ImageNet (3x224x224, 1000 classes)", (3, 224, 224), "float", None, 1, _resnet18, (1000,)),
    ModelSpec("resnet50", "ResNet-50 on ImageNet (3x224x224, 1000 classes)", (3, 224, 224), "float", None, 1, _resnet50, (1000,)),
    ModelSpec("resnet18_cifar", "POET's CIFAR ResNet, 16/32/64 channels (3x32x32, 10 classes)", (3, 32, 32), "float", None, 8, _resnet18_cifar, (10,)),
    ModelSpec("bert", "BERT-base masked LM (12 layers, seq 512, vocab 30522)", (BERT_SEQ_LEN,), "tokens", BERT_VOCAB_SIZE, 1, _bert, (BERT_SEQ_LEN, BERT_VOCAB_SIZE)),
    ModelSpec("transformer", "one BERT-base layer with masked-LM head (seq 512, vocab 30522)", (BERT_SEQ_LEN,), "tokens", BERT_VOCAB_SIZE, 1, _transformer, (BERT_SEQ_LEN, BERT_VOCAB_SIZE)),
    ModelSpec("hf_bert", "tiny Hugging Face BertForMaskedLM (needs transformers; seq 32, vocab 512)", (HF_BERT_SEQ_LEN,), "tokens", HF_BERT_VOCAB_SIZE, 2, _hf_bert, (HF_BERT_SEQ_LEN, HF_BERT_VOCAB_SIZE)),
)  # fmt: skip

ZOO: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}


class UnknownModelError(UserError, KeyError):
    """A model name that is not in the zoo; the message lists the valid names."""

    def __init__(self, name: str, valid_names: Sequence[str]) -> None:
        super().__init__(name)
        self.name = name
        self.valid_names = tuple(valid_names)

    def __str__(self) -> str:
        return f"unknown model {self.name!r}; valid zoo models: {', '.join(self.valid_names)}"


def get_model_spec(name: str) -> ModelSpec:
    """The zoo entry called ``name``; raises :class:`UnknownModelError` listing the valid names."""
    try:
        return ZOO[name]
    except KeyError:
        raise UnknownModelError(name, list(ZOO)) from None


def list_models() -> list[ModelSpec]:
    """All zoo entries, in the zoo's fixed order (small test models first)."""
    return list(ZOO.values())
