"""A small decoder-only transformer (GPT) over bytes, for demos, tests and benchmarks.

The module is built so that the pipeline splitter can cut it without knowing it: :class:`GPT`
registers exactly three children, ``embed``, ``blocks`` and ``head``, in that order, and its
``forward`` is nothing but running them one after another. A stage is then a contiguous run of
``embed``, some blocks, and ``head``; parameter names stay those of the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bubbleguard.models.base import EmbedBlocksHead

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "GPTEmbed", "GPTHead", "lm_loss"]

# Standard deviation of the normal init of every Linear and Embedding weight (GPT-2 style).
_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`.

    Attributes:
        vocab_size: Number of token ids; 256 for raw bytes.
        seq_len: Longest sequence the model accepts (size of the position embedding).
        d_model: Width of the residual stream.
        num_layers: Number of transformer blocks.
        num_heads: Attention heads per block; must divide ``d_model``.
        d_ff: Hidden width of each block's MLP; ``None`` means ``4 * d_model``.
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads"):
            _check_positive_int(name, getattr(self, name))
        if self.d_ff is not None:
            _check_positive_int("d_ff", self.d_ff)
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads among the divisors of d_model"
            )

    @property
    def ff_dim(self) -> int:
        """The MLP hidden width actually used: ``d_ff``, or ``4 * d_model`` when it is ``None``."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a layer count is almost certainly a mistake.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class GPTEmbed(nn.Module):
    """Token plus learned position embeddings: int64 ids ``(B, T)`` -> ``(B, T, d_model)``.

    Any ``T`` from 1 to ``seq_len`` is accepted; positions always start at 0.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, ids: Tensor) -> Tensor:
        """Embed ``ids`` of shape ``(B, T)``.

        Raises:
            ValueError: ``ids`` is not 2-D or ``T`` exceeds ``seq_len``.
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape (B, T), got {tuple(ids.shape)}")
        t = ids.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        positions = torch.arange(t, device=ids.device)
        out: Tensor = self.tok(ids) + self.pos(positions)
        return out


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position ``t`` only sees positions ``<= t``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` of shape ``(B, T, d_model)``; returns the same shape."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (B, T, d) -> (B, heads, T, d_head): SDPA attends over the second-to-last axis.
        q, k, v = (
            z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.ff_dim),
            nn.GELU(),
            nn.Linear(cfg.ff_dim, cfg.d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Map ``(B, T, d_model)`` to ``(B, T, d_model)``."""
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class GPTHead(nn.Module):
    """Final LayerNorm and projection to the vocabulary: ``(B, T, d_model)`` -> ``(B, T, V)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        # Not tied to the token embedding: a shared parameter would live on two pipeline stages.
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits for every position of ``x``."""
        out: Tensor = self.out(self.ln(x))
        return out


class GPT(EmbedBlocksHead):
    """Decoder-only transformer: ``head(blocks[L-1](... blocks[0](embed(ids))))``.

    Deterministic: no dropout, and the initialisation draws only from torch's global RNG, so
    ``torch.manual_seed(s)`` before construction fixes every weight.

    Structural contract (the pipeline splitter relies on it): the children are registered in the
    order ``embed``, ``blocks`` (an :class:`~torch.nn.ModuleList`), ``head``, no parameter lives
    on the GPT itself, and running the children in that order reproduces :meth:`forward` exactly.

    Args:
        cfg: The model sizes; the default config gives a 237k-parameter model.
    """

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg if cfg is not None else GPTConfig()
        self.embed = GPTEmbed(self.cfg)
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg.num_layers))
        self.head = GPTHead(self.cfg)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        # Each block adds two projections to the residual stream; scaling them keeps its variance
        # independent of depth at init (GPT-2).
        residual_std = _INIT_STD / math.sqrt(2 * self.cfg.num_layers)
        for block in self.blocks:
            assert isinstance(block, Block)
            last_mlp = block.mlp[-1]
            assert isinstance(last_mlp, nn.Linear)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(last_mlp.weight, mean=0.0, std=residual_std)



def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over every predicted position.

    Works for per-position logits ``(B, T, V)`` with targets ``(B, T)`` (GPT) and for one
    prediction per row, ``(B, V)`` with ``(B,)`` (MLP); in general ``logits.shape[:-1]`` must
    equal ``targets.shape``.

    Raises:
        ValueError: the shapes do not match.
    """
    if logits.dim() < 2 or tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}: "
            f"expected logits of shape targets.shape + (vocab_size,)"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
