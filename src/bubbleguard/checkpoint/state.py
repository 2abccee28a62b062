"""What a checkpoint holds for one pipeline stage, keyed by whole-model parameter names.

A stage module holds a subset of the whole model's modules under their original names, so its
``state_dict()`` keys (``blocks.3.attn.qkv.weight``) are whole-model fully qualified names (FQNs).
A :class:`StageState` keeps three kinds of content:

* ``tensors`` -- shareable between ranks and stages, keyed by whole-model FQN: the module's
  ``state_dict()`` entries under their own names and the optimizer state under
  ``optim.<fqn>.<key>`` (``optim.blocks.3.attn.qkv.weight.exp_avg``, Adam's ``...step`` too).
* ``local_tensors`` -- this rank's own: ``rng.torch`` (the CPU generator) and ``rng.cuda.<i>``.
* ``metadata`` -- small JSON: step, optimizer param groups with params replaced by FQNs, LR
  scheduler ``state_dict()``, Python and NumPy RNG states, the caller's data cursor.

Call order for the runtime (snapshot of step k, copied during iteration k+1)::

    optimizer.step(); scheduler.step()                 # end of iteration k
    state = capture_state(stage, optimizer, scheduler, step=k, data_cursor=cursor)
    ...                                                 # copy state (tiers) during iteration k+1
    optimizer.step()                                    # only after every chunk of k is copied

or, to keep the step boundary short, ``pending = begin_capture(...)`` at the boundary and
``state = pending.complete()`` later (in a bubble of iteration k+1, before the next step).

``capture_state`` is cheap: parameters and optimizer state are *referenced*, not copied, because
they do not change until the next ``optimizer.step()``. What may change before that (buffers such
as BatchNorm statistics, which a forward pass updates, and the RNG states) is cloned. Use
:meth:`StageState.clone` for an independent copy.

Restore: ``restore_state(state, stage, optimizer, scheduler)`` puts everything back in place so
training continues bit-identically. It is strict about what this stage needs and tolerant of
entries that belong to other stages (reshard: a stage of a different split loads only its FQNs).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from bubbleguard.checkpoint.errors import StateMismatchError

OPTIM_PREFIX = "optim."
RNG_PREFIX = "rng."
FORMAT_VERSION = 1
_MAX_NAMES_IN_ERROR = 10


@dataclass(frozen=True, eq=False)
class StageState:
    """One stage's checkpoint content (see the module docstring for the three parts).

    Attributes:
        step: the optimizer step this state follows (the state *after* ``optimizer.step()`` k).
        tensors: whole-model FQN -> tensor (model state and ``optim.<fqn>.<key>``).
        local_tensors: per-rank tensors (``rng.torch``, ``rng.cuda.<i>``).
        metadata: JSON-able dict (see :func:`capture_state`).
    """

    step: int
    tensors: Mapping[str, torch.Tensor]
    local_tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def all_tensors(self) -> dict[str, torch.Tensor]:
        """Shareable and local tensors in one dict (their names never collide)."""
        return {**self.tensors, **self.local_tensors}

    @property
    def num_bytes(self) -> int:
        """Bytes of all tensors (shareable and local)."""
        return sum(t.numel() * t.element_size() for t in self.all_tensors().values())

    def clone(self) -> StageState:
        """A copy on the CPU that shares no memory with the live model or optimizer."""

        def cp(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True)

        return StageState(
            step=self.step,
            tensors={k: cp(v) for k, v in self.tensors.items()},
            local_tensors={k: cp(v) for k, v in self.local_tensors.items()},
            metadata=json.loads(json.dumps(self.metadata)),
        )


@dataclass(frozen=True)
class RestoreResult:
    """What :func:`restore_state` hands back to the training loop.

    Attributes:
        step: the step the restored state follows; training resumes with step + 1.
        data_cursor: the data position saved with it (the dict given to :func:`capture_state`).
        unexpected: tensors in the checkpoint this stage did not need (other stages' keys).
    """

    step: int
    data_cursor: dict[str, Any]
    unexpected: tuple[str, ...] = ()


def optim_key(fqn: str, key: str) -> str:
    """The tensor name of optimizer state ``key`` (``exp_avg``) of parameter ``fqn``."""
    return f"{OPTIM_PREFIX}{fqn}.{key}"


def capture_state(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    step: int,
    data_cursor: Mapping[str, Any] | None = None,
) -> StageState:
    """Capture a stage's state right after ``optimizer.step()`` number ``step``.

    Args:
        module: the stage module; its ``state_dict()`` keys are whole-model FQNs.
        optimizer: the optimizer over (a subset of) ``module``'s parameters, or None.
        scheduler: an LR scheduler whose ``state_dict()`` is JSON-able, or None.
        step: number of optimizer steps taken so far.
        data_cursor: JSON-able data position (epoch, batch index, sampler seed...), or None.

    Returns:
        The state. Parameter and optimizer tensors alias the live ones: copy them (a tier does)
        before the next ``optimizer.step()``.

    Raises:
        ValueError: a state entry is not a tensor, a name collides with the reserved ``optim.`` /
            ``rng.`` prefixes, an optimizer parameter is not in ``module``, or some metadata is
            not JSON-able (the message names the entry).
    """
    return begin_capture(
        module, optimizer, scheduler, step=step, data_cursor=data_cursor
    ).complete()


@dataclass(frozen=True, eq=False)
class PendingCapture:
    """A capture split in two: what must be taken at the step boundary, and the rest.

    :func:`begin_capture` takes, right after ``optimizer.step()`` k, only what may change before
    the next optimizer step: buffers (a forward pass updates BatchNorm statistics) are cloned,
    RNG states, the data cursor, the scheduler state and the param groups' hyperparameters are
    copied. :meth:`complete` does the rest -- walking the optimizer state, naming it by FQN,
    turning the RNG states into JSON -- and may run any time before the next
    ``optimizer.step()``, e.g. in the first bubble of iteration k+1, off the critical path.
    ``begin_capture(...).complete()`` equals :func:`capture_state`.
    """

    step: int
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    module_tensors: dict[str, torch.Tensor]
    param_groups: tuple[tuple[list[torch.Tensor], dict[str, Any]], ...]
    local_tensors: dict[str, torch.Tensor]
    data_cursor: Any
    scheduler: Any
    python_random: tuple[Any, ...]
    numpy_random: tuple[Any, ...]

    def complete(self) -> StageState:
        """The :class:`StageState` (parameters and optimizer state by reference).

        Raises:
            ValueError: an optimizer parameter is not in the module, or optimizer state is not
                JSON-able (names the entry).
        """
        tensors = dict(self.module_tensors)
        optim_meta: dict[str, Any] | None = None
        if self.optimizer is not None:
            fqn_of = _fqn_by_param(self.module)
            groups: list[dict[str, Any]] = []
            non_tensor: dict[str, dict[str, Any]] = {}
            for g_index, (params, hyper) in enumerate(self.param_groups):
                fqns = []
                for p_index, p in enumerate(params):
                    fqn = fqn_of.get(id(p))
                    if fqn is None:
                        raise ValueError(
                            f"optimizer param group {g_index} parameter {p_index} (shape "
                            f"{tuple(p.shape)}) is not a parameter of the stage module"
                        )
                    fqns.append(fqn)
                    for key, value in self.optimizer.state.get(p, {}).items():
                        if isinstance(value, torch.Tensor):
                            tensors[optim_key(fqn, key)] = value.detach()
                        else:
                            non_tensor.setdefault(fqn, {})[key] = _jsonable(
                                value, f"optimizer state {fqn}.{key}"
                            )
                groups.append({**hyper, "params": fqns})
            optim_meta = {"param_groups": groups, "non_tensor_state": non_tensor}
        py_state, np_state = self.python_random, self.numpy_random
        metadata: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "data_cursor": self.data_cursor,
            "optimizer": optim_meta,
            "scheduler": self.scheduler,
            "python_random": [py_state[0], list(py_state[1]), py_state[2]],
            "numpy_random": [
                np_state[0],
                np_state[1].tolist(),
                int(np_state[2]),
                int(np_state[3]),
                float(np_state[4]),
            ],
        }
        return StageState(
            step=self.step, tensors=tensors, local_tensors=self.local_tensors, metadata=metadata
        )


def begin_capture(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    step: int,
    data_cursor: Mapping[str, Any] | None = None,
) -> PendingCapture:
    """The step-boundary half of :func:`capture_state` (arguments and errors as there).

    Call right after ``optimizer.step()`` number ``step``; call ``complete()`` on the result
    before the next ``optimizer.step()``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    tensors: dict[str, torch.Tensor] = {}
    # keep_vars: parameters come as Parameter objects, which tells them apart from buffers.
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"state_dict entry {name!r} of the stage module is a {type(value).__name__}, "
                "not a tensor; only tensors can be checkpointed"
            )
        if name.startswith((OPTIM_PREFIX, RNG_PREFIX)):
            raise ValueError(f"state_dict entry {name!r} uses a reserved prefix (optim./rng.)")
        # Buffers (e.g. BatchNorm statistics) change during forward passes: clone them now.
        is_param = isinstance(value, torch.nn.Parameter)
        tensors[name] = value.detach() if is_param else value.detach().clone()

    groups: list[tuple[list[torch.Tensor], dict[str, Any]]] = []
    if optimizer is not None:
        for g_index, group in enumerate(optimizer.param_groups):
            # A scheduler may change the hyperparameters before complete() runs: copy them now.
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append(
                (list(group["params"]), _jsonable(hyper, f"optimizer param group {g_index}"))
            )

    local: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            local[f"rng.cuda.{i}"] = s

    return PendingCapture(
        step=step,
        module=module,
        optimizer=optimizer,
        module_tensors=tensors,
        param_groups=tuple(groups),
        local_tensors=local,
        data_cursor=_jsonable(dict(data_cursor or {}), "data_cursor"),
        scheduler=None
        if scheduler is None
        else _jsonable(scheduler.state_dict(), "scheduler state_dict"),
        # getstate() returns fresh immutable tuples; NumPy's holds a fresh copy of its keys.
        python_random=random.getstate(),
        numpy_random=cast(tuple[Any, ...], np.random.get_state()),
    )


def stage_selector(module: torch.nn.Module) -> Callable[[str], bool]:
    """A predicate: does checkpoint tensor ``name`` belong to this stage?

    Used when reading a whole-model checkpoint so that a stage loads only its own FQNs.
    """
    model_keys = set(module.state_dict().keys())
    prefixes = {f"{OPTIM_PREFIX}{fqn}." for fqn, _ in module.named_parameters()}

    def select(name: str) -> bool:
        # rpartition: optimizer state keys (exp_avg, step) carry no dots, FQNs do.
        return name in model_keys or name.rpartition(".")[0] + "." in prefixes

    return select


def restore_state(
    state: StageState,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    allow_unexpected: bool = True,
    restore_rng: bool = True,
) -> RestoreResult:
    """Put ``state`` back into a stage so that training continues bit-identically.

    Args:
        state: from :func:`capture_state` or a tier's ``read``; may hold more tensors than this
            stage needs (a whole-model checkpoint read by one stage of another split).
        module: the stage module (whole-model FQNs).
        optimizer: restored from ``optim.<fqn>.*`` tensors and the saved param-group
            hyperparameters, matched by FQN; None to skip.
        scheduler: restored from the saved ``state_dict``; None to skip.
        allow_unexpected: tolerate model tensors this stage does not hold (other stages' keys).
        restore_rng: restore torch (CPU, CUDA), Python and NumPy RNG states.

    Returns:
        The step and the data cursor to resume from.

    Raises:
        StateMismatchError: a tensor this stage needs is missing (names them, and the unexpected
            ones -- a checkpoint of a different model), has another shape or dtype, or (with
            ``allow_unexpected=False``) the checkpoint holds tensors this stage does not.
    """
    meta = state.metadata
    target = module.state_dict()
    available = set(state.tensors)
    missing = sorted(k for k in target if k not in available)
    unexpected = sorted(k for k in available if not k.startswith(OPTIM_PREFIX) and k not in target)
    if missing or (unexpected and not allow_unexpected):
        raise StateMismatchError(
            f"checkpoint of step {state.step} does not match this stage: "
            f"{len(missing)} missing tensor(s) {_names(missing)}; "
            f"{len(unexpected)} unexpected tensor(s) {_names(unexpected)}"
            + ("" if missing else " (pass allow_unexpected=True to load a stage of a split)")
        )
    for name, dst in target.items():
        src = state.tensors[name]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise StateMismatchError(
                f"tensor {name!r}: checkpoint has {src.dtype} {tuple(src.shape)}, "
                f"this stage has {dst.dtype} {tuple(dst.shape)}"
            )
    with torch.no_grad():
        for name, dst in target.items():
            dst.copy_(state.tensors[name])

    if optimizer is not None and meta.get("optimizer") is not None:
        optimizer.load_state_dict(_optimizer_state_dict(state, module, optimizer))
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(json.loads(json.dumps(meta["scheduler"])))
    if restore_rng:
        _restore_rng(state)
    return RestoreResult(
        step=state.step,
        data_cursor=dict(meta.get("data_cursor", {})),
        unexpected=tuple(unexpected),
    )


def _optimizer_state_dict(
    state: StageState, module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Build ``optimizer.state_dict()``-shaped input from FQN-keyed tensors and metadata."""
    meta = state.metadata["optimizer"]
    saved_hyper: dict[str, dict[str, Any]] = {}
    for group in meta["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for fqn in group["params"]:
            saved_hyper[fqn] = hyper
    non_tensor: Mapping[str, Mapping[str, Any]] = meta.get("non_tensor_state", {})
    fqn_of = _fqn_by_param(module)

    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.tensors.items():
        if name.startswith(OPTIM_PREFIX):
            fqn, _, key = name[len(OPTIM_PREFIX) :].rpartition(".")
            per_param.setdefault(fqn, {})[key] = t

    opt_state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for g_index, group in enumerate(optimizer.param_groups):
        fqns = [fqn_of[id(p)] for p in group["params"]]
        missing = [f for f in fqns if f not in saved_hyper]
        if missing:
            raise StateMismatchError(
                f"optimizer param group {g_index}: no saved hyperparameters for "
                f"{len(missing)} parameter(s) {_names(missing)}"
            )
        hyper = dict(saved_hyper[fqns[0]]) if fqns else {}
        for f in fqns[1:]:
            if saved_hyper[f] != hyper:
                raise StateMismatchError(
                    f"optimizer param group {g_index} mixes parameters saved with different "
                    f"hyperparameters ({fqns[0]!r} and {f!r}); group them as when saved"
                )
        merged = {k: v for k, v in group.items() if k != "params"}
        for k, v in hyper.items():
            # JSON turns tuples (Adam's betas) into lists; give back the type the group uses.
            current = merged.get(k)
            if isinstance(current, tuple):
                merged[k] = tuple(v)
            elif isinstance(current, torch.Tensor):  # e.g. a tensor lr (capturable optimizers)
                merged[k] = torch.as_tensor(v, dtype=current.dtype, device=current.device)
            else:
                merged[k] = v
        ids = []
        for fqn in fqns:
            entry: dict[str, Any] = {k: t.clone() for k, t in per_param.get(fqn, {}).items()}
            entry.update(non_tensor.get(fqn, {}))
            if entry:
                opt_state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**merged, "params": ids})
    return {"state": opt_state, "param_groups": groups}


def _restore_rng(state: StageState) -> None:
    meta = state.metadata
    # clone(): set_rng_state reads from the start of the storage, so a view at an offset (a
    # tensor read from a snapshot region) would crash it (seen with torch 2.13).
    if "rng.torch" in state.local_tensors:
        torch.set_rng_state(state.local_tensors["rng.torch"].to("cpu", torch.uint8).clone())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            t = state.local_tensors.get(f"rng.cuda.{i}")
            if t is not None:
                torch.cuda.set_rng_state(t.to("cpu", torch.uint8).clone(), i)
    if meta.get("python_random") is not None:
        version, internal, gauss = meta["python_random"]
        random.setstate((version, tuple(internal), gauss))
    if meta.get("numpy_random") is not None:
        name, keys, pos, has_gauss, cached = meta["numpy_random"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _fqn_by_param(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _names(names: Iterable[str]) -> str:
    items = list(names)
    shown = ", ".join(repr(n) for n in items[:_MAX_NAMES_IN_ERROR])
    more = (
        f", ... ({len(items) - _MAX_NAMES_IN_ERROR} more)"
        if len(items) > _MAX_NAMES_IN_ERROR
        else ""
    )
    return f"[{shown}{more}]"


def _jsonable(value: Any, where: str) -> Any:
    """``value`` as plain JSON types (tuples become lists); ValueError naming ``where`` if not."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise ValueError(f"{where}: key {k!r} is not a string or int; cannot store as JSON")
            out[str(k) if isinstance(k, str) else k] = _jsonable(v, f"{where}.{k}")
        return out
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise ValueError(
        f"{where} holds a {type(value).__name__} ({value!r:.80}); checkpoint metadata must be "
        "JSON-able (None, bool, int, float, str, lists and dicts of them)"
    )
