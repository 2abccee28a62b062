"""A next-byte MLP: the smallest model that still has an ``embed`` / ``blocks`` / ``head`` split.

It reads a fixed context of bytes and predicts the one that follows, so a pipeline stage's
activations are a plain ``(B, hidden)`` matrix: handy for fast tests of the pipeline runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bubbleguard.models.base import EmbedBlocksHead
from bubbleguard.models.gpt import _check_positive_int

__all__ = ["MLP", "MLPBlock", "MLPConfig", "MLPEmbed", "MLPHead"]

# Std of the output projection's normal init: small logits make the initial loss ~ln(vocab_size).
_HEAD_INIT_STD = 0.02


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of an :class:`MLP`.

    Attributes:
        vocab_size: Number of token ids; 256 for raw bytes.
        context: Number of preceding bytes the model reads.
        d_embed: Width of each byte's embedding.
        hidden: Width of every hidden layer.
        num_layers: Number of hidden blocks.
    """

    vocab_size: int = 256
    context: int = 16
    d_embed: int = 16
    hidden: int = 64
    num_layers: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_embed", "hidden", "num_layers"):
            _check_positive_int(name, getattr(self, name))


class MLPEmbed(nn.Module):
    """Embed each byte, concatenate, project: ids ``(B, context)`` -> ``(B, hidden)``."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.context = cfg.context
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_embed)
        self.proj = nn.Linear(cfg.context * cfg.d_embed, cfg.hidden)

    def forward(self, ids: Tensor) -> Tensor:
        """Embed ``ids`` of shape ``(B, context)``.

        Raises:
            ValueError: ``ids`` does not have shape ``(B, context)``.
        """
        if ids.dim() != 2 or ids.shape[1] != self.context:
            raise ValueError(
                f"ids must have shape (B, {self.context}) (B rows of context bytes), "
                f"got {tuple(ids.shape)}"
            )
        out: Tensor = self.proj(self.tok(ids).flatten(1))
        return out


class MLPBlock(nn.Module):
    """Residual hidden layer ``x + relu(linear(x))``: ``(B, hidden)`` -> ``(B, hidden)``.

    The skip connection keeps deeper stacks (more pipeline stages) trainable.
    """

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` of shape ``(B, hidden)``."""
        return x + torch.relu(self.fc(x))


class MLPHead(nn.Module):
    """Projection to the vocabulary: ``(B, hidden)`` -> logits ``(B, vocab_size)``."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        """Return next-byte logits for every row of ``x``."""
        out: Tensor = self.out(x)
        return out


class MLP(EmbedBlocksHead):
    """Next-byte predictor: ``head(blocks[L-1](... blocks[0](embed(ids))))``.

    Targets are ``(B,)``: the byte that follows each row's context. Deterministic: no dropout,
    and initialisation draws only from torch's global RNG.

    Structural contract (the pipeline splitter relies on it): the children are registered in the
    order ``embed``, ``blocks`` (an :class:`~torch.nn.ModuleList`), ``head``, no parameter lives
    on the MLP itself, and running the children in that order reproduces :meth:`forward` exactly.

    Args:
        cfg: The model sizes.
    """

    def __init__(self, cfg: MLPConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else MLPConfig()
        self.embed = MLPEmbed(self.cfg)
        self.blocks = nn.ModuleList(MLPBlock(self.cfg) for _ in range(self.cfg.num_layers))
        self.head = MLPHead(self.cfg)
        # PyTorch's default (Kaiming-uniform) init suits the ReLU layers; only the output is
        # shrunk so that the untrained model predicts a near-uniform distribution.
        nn.init.normal_(self.head.out.weight, mean=0.0, std=_HEAD_INIT_STD)
        nn.init.zeros_(self.head.out.bias)

