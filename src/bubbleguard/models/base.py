"""The structure both built-in models share, which the pipeline splitter relies on."""

from __future__ import annotations

from torch import Tensor, nn


class EmbedBlocksHead(nn.Module):
    """A model whose children are ``embed``, ``blocks`` (a ModuleList) and ``head``, in that order.

    Subclasses register exactly those three children; forward runs them in registration order,
    so cutting the model at block boundaries and chaining the pieces reproduces it.
    """

    embed: nn.Module
    blocks: nn.ModuleList
    head: nn.Module

    def forward(self, ids: Tensor) -> Tensor:
        """``head(blocks[L-1](...blocks[0](embed(ids))))``."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(x)
        return out
