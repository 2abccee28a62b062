"""The small built-in models for the demo, tests and benchmarks (the engine never imports them).

Every model registers exactly three children, ``embed``, ``blocks`` (a ModuleList) and ``head``,
in that order, and its forward runs them in that order; the pipeline splitter relies on it.

Example:
    >>> cfg = model_config("gpt", num_layers=2)
    >>> model = build_model("gpt", seed=0, num_layers=2)
    >>> model_seq_len(cfg), model_target(cfg)
    (64, 'next_token')
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from bubbleguard.models.gpt import GPT, GPTConfig, lm_loss
from bubbleguard.models.mlp import MLP, MLPConfig

__all__ = [
    "GPT",
    "MLP",
    "MODEL_NAMES",
    "GPTConfig",
    "MLPConfig",
    "ModelConfig",
    "build_model",
    "lm_loss",
    "model_config",
    "model_seq_len",
    "model_target",
]

ModelConfig: TypeAlias = GPTConfig | MLPConfig

MODEL_NAMES: tuple[str, ...] = ("gpt", "mlp")

_CONFIGS: dict[str, type[GPTConfig] | type[MLPConfig]] = {"gpt": GPTConfig, "mlp": MLPConfig}


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """Return the default config of model ``name`` with ``overrides`` applied.

    Args:
        name: One of :data:`MODEL_NAMES`.
        **overrides: Config fields to change, e.g. ``num_layers=8``.

    Raises:
        ValueError: ``name`` is unknown, an override is not a field of that config, or a
            value is invalid (the config's own validation).
    """
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODEL_NAMES)}")
    cls = _CONFIGS[name]
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for model {name!r}; "
            f"accepted: {', '.join(accepted)}"
        )
    return cls(**overrides)


def build_model(name: str, *, seed: int, **overrides: Any) -> nn.Module:
    """Build model ``name`` with weights fixed by ``seed``.

    The weights are drawn from torch's CPU RNG seeded with ``seed`` inside
    :func:`torch.random.fork_rng`, so the caller's global RNG state is left as it was: building
    a model does not shift the random numbers the rest of the program sees.

    Args:
        name: One of :data:`MODEL_NAMES`.
        seed: Seed of the weight initialisation; the same seed gives identical weights.
        **overrides: Config fields to change (see :func:`model_config`).

    Raises:
        ValueError: as :func:`model_config`.
    """
    cfg = model_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg) if isinstance(cfg, GPTConfig) else MLP(cfg)


def model_seq_len(cfg: ModelConfig) -> int:
    """Number of input tokens per row the model reads: ``seq_len`` (GPT) or ``context`` (MLP).

    This is the ``window`` to give :class:`bubbleguard.data.TokenBatches`.
    """
    return cfg.seq_len if isinstance(cfg, GPTConfig) else cfg.context


def model_target(cfg: ModelConfig) -> Literal["next_token", "last_token"]:
    """The ``target`` kind of :class:`bubbleguard.data.TokenBatches` this model trains on.

    GPT predicts every next token (targets ``(B, T)``); the MLP predicts only the byte after its
    context (targets ``(B,)``).
    """
    return "next_token" if isinstance(cfg, GPTConfig) else "last_token"
