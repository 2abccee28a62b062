"""Configuration of a parameter-server run: frozen dataclasses, validated before Ray starts.

A :class:`RunConfig` describes one training run (one strategy, one seed). Its sections are the
concerns an engineer changes independently: the training itself, the consistency level, one
section per recovery strategy, the fault plan and the resources each actor asks Ray for.
``RunConfig.validate()`` raises ``ValueError`` naming the bad value and what would be accepted;
the CLI and :func:`bubbleguard.ps.run_training` call it before anything touches Ray.

Nothing here imports torch or Ray, so the CLI can build and check a configuration cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

StrategyName = Literal["baseline", "checkpoint", "chain", "stateless"]
ConsistencyLevel = Literal["strict", "bounded", "eventual"]
BacklogPolicy = Literal["sum-scaled", "mean", "staleness-weighted"]
OverflowPolicy = Literal["coalesce", "drop-oldest"]
KillTarget = Literal["server", "middle", "tail", "worker"]

STRATEGIES: tuple[str, ...] = get_args(StrategyName)
"""Every strategy name; ``baseline`` is the no-fault-tolerance reference run."""
RECOVERY_STRATEGIES: tuple[str, ...] = ("checkpoint", "chain", "stateless")
CONSISTENCY_LEVELS: tuple[str, ...] = get_args(ConsistencyLevel)
BACKLOG_POLICIES: tuple[str, ...] = get_args(BacklogPolicy)
OVERFLOW_POLICIES: tuple[str, ...] = get_args(OverflowPolicy)
KILL_TARGETS: tuple[str, ...] = get_args(KillTarget)


def _choice(kind: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(accepted)}")


@dataclass(frozen=True)
class TrainingConfig:
    """What is trained, by how many workers, with which optimizer.

    Attributes:
        dataset: ``"digits"`` (scikit-learn's handwritten digits, shipped with the package),
            ``"npz:PATH"`` (arrays ``x_train, y_train, x_test, y_test`` in a NumPy archive), or a
            name added with :func:`bubbleguard.ps.register_dataset`.
        model: a name from the model registry (``"cnn"``: a small two-layer CNN).
        num_workers: worker actors, each training on its own shard of the training split.
        batch_size: examples per gradient.
        lr: learning rate of the server's SGD step.
        momentum: SGD momentum (0 is the paper's plain SGD); the buffer is part of the server state.
        seed: fixes the model initialisation, the data split and shards, and every worker's
            minibatch order. The interleaving of asynchronous workers is not fixable.
        worker_delay_s: extra seconds per gradient for worker ``i`` (stragglers); missing
            entries mean no delay.
    """

    dataset: str = "digits"
    model: str = "cnn"
    num_workers: int = 4
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    seed: int = 0
    worker_delay_s: tuple[float, ...] = ()

    def validate(self) -> None:
        """Raise ``ValueError`` on a value no run could use."""
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if len(self.worker_delay_s) > self.num_workers:
            raise ValueError(
                f"worker_delay_s has {len(self.worker_delay_s)} entries for {self.num_workers} workers"
            )
        if any(d < 0 for d in self.worker_delay_s):
            raise ValueError(f"worker_delay_s must be >= 0, got {self.worker_delay_s}")

    def delay_of(self, worker: int) -> float:
        """Extra seconds per gradient for ``worker``."""
        return self.worker_delay_s[worker] if worker < len(self.worker_delay_s) else 0.0


@dataclass(frozen=True)
class ConsistencyConfig:
    """How far workers may drift apart, in clocks (one clock = one gradient pushed).

    ``strict`` is bulk-synchronous: a worker starts clock ``c`` only once every worker has
    finished ``c`` clocks, so every gradient is computed on weights holding every earlier clock's
    gradients. ``bounded`` is stale-synchronous parallel with bound ``staleness``: a worker at clock
    ``c`` waits until the slowest has finished ``c - staleness``. ``eventual`` never waits.
    """

    level: ConsistencyLevel = "eventual"
    staleness: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` on an unknown level or a staleness the level cannot use."""
        _choice("consistency", self.level, CONSISTENCY_LEVELS)
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.staleness and self.level != "bounded":
            raise ValueError(
                f"staleness {self.staleness} only applies to bounded consistency, not {self.level!r}"
            )

    @property
    def bound(self) -> int | None:
        """The clock lead a worker may have over the slowest one; ``None`` means unbounded."""
        if self.level == "strict":
            return 0
        if self.level == "bounded":
            return self.staleness
        return None


@dataclass(frozen=True)
class CheckpointConfig:
    """The ``checkpoint`` strategy: durable snapshots of every shard, reloaded on restart.

    Attributes:
        every: write a checkpoint after every ``every`` server steps (the paper used 100).
        directory: where checkpoints go; ``None`` puts them under the run's output directory.
        keep: committed checkpoints kept per shard (older ones are deleted only after a newer
            one has committed).
    """

    every: int = 100
    directory: str | None = None
    keep: int = 2

    def validate(self) -> None:
        """Raise ``ValueError`` on a non-positive interval or retention."""
        if self.every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {self.keep}")


@dataclass(frozen=True)
class ChainConfig:
    """The ``chain`` strategy: servers head -> ... -> tail per shard.

    Attributes:
        length: servers in each chain (>= 2; a middle node needs >= 3).
        replicate_every: ``None`` acknowledges an update only once the tail has applied it
            (per-update mode, loses nothing acknowledged); ``n`` acknowledges at the head and
            copies the head's state down the chain every ``n`` steps (the paper's mode).
    """

    length: int = 3
    replicate_every: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` on a chain that cannot survive a failure."""
        if self.length < 2:
            raise ValueError(f"chain length must be >= 2 to survive a failure, got {self.length}")
        if self.replicate_every is not None and self.replicate_every < 1:
            raise ValueError(f"replicate_every must be >= 1, got {self.replicate_every}")

    @property
    def per_update(self) -> bool:
        """Whether updates are acknowledged only once the tail holds them."""
        return self.replicate_every is None


@dataclass(frozen=True)
class StatelessConfig:
    """The ``stateless`` strategy: state outside the server, workers compute through outages.

    Attributes:
        policy: how a worker's backlog is applied when it hands it over, as one optimizer step
            (see :mod:`bubbleguard.ps.core.optim`): ``staleness-weighted`` (the default:
            gradient ``i`` of the backlog weighted by ``1 / (1 + staleness_i + i)``, about
            ``log N`` steps' worth), ``sum-scaled`` (the paper's: the sum with the learning rate
            times ``backlog_lr_scale``, ``N * backlog_lr_scale`` steps' worth, which wrecks the
            model once outages are long enough for ``N`` to reach the thousands), or ``mean``.
        backlog_lr_scale: learning-rate factor of ``sum-scaled`` (the paper: 1e-2 -> 1e-3).
        buffer_cap: most buffered entries a worker holds while the server is down.
        overflow: what a worker does with a gradient once the buffer holds ``buffer_cap``
            entries: ``coalesce`` adds it into the newest entry computed on the same weights (no
            gradient is lost; memory stays bounded) and ``drop-oldest`` discards the oldest entry
            (its gradients are counted as dropped, never applied).
        persist_every: the state store writes a durable copy every this many steps.
    """

    policy: BacklogPolicy = "staleness-weighted"
    backlog_lr_scale: float = 0.1
    buffer_cap: int = 1024
    overflow: OverflowPolicy = "coalesce"
    persist_every: int = 100

    def validate(self) -> None:
        """Raise ``ValueError`` on an unknown policy or a non-positive bound."""
        _choice("backlog policy", self.policy, BACKLOG_POLICIES)
        _choice("overflow policy", self.overflow, OVERFLOW_POLICIES)
        if not self.backlog_lr_scale > 0:
            raise ValueError(f"backlog_lr_scale must be > 0, got {self.backlog_lr_scale}")
        if self.buffer_cap < 1:
            raise ValueError(f"buffer_cap must be >= 1 entry, got {self.buffer_cap}")
        if self.persist_every < 1:
            raise ValueError(f"persist_every must be >= 1 step, got {self.persist_every}")


@dataclass(frozen=True)
class FaultPlan:
    """Which actor is killed (SIGKILL), when, and for how long it stays down.

    Kill ``i`` happens at ``kill_at_s[i]`` seconds into training, or, without explicit times,
    after ``(i + 1) * kill_after_updates`` applied updates of ``shard``, or otherwise at evenly
    spaced times ``duration * (i + 1) / (num_kills + 1)``. A killed server is replaced (or
    restarted, or left to the chain's successor) no earlier than ``downtime_s`` after the kill.

    Attributes:
        num_kills: how many kills; 0 disables fault injection.
        downtime_s: seconds a killed actor stays down.
        kill_at_s: explicit kill times (seconds from the start of training).
        kill_after_updates: trigger kills by progress instead of time.
        target: ``server`` (the serving node; a chain's head), ``middle`` or ``tail`` (chain
            only), or ``worker``.
        shard: which shard's server is killed.
        worker: which worker is killed when ``target == "worker"``.
        settle_s: time the system needs between the end of one outage and the next kill or the
            end of training; a schedule that leaves less is rejected.
    """

    num_kills: int = 0
    downtime_s: float = 5.0
    kill_at_s: tuple[float, ...] | None = None
    kill_after_updates: int | None = None
    target: KillTarget = "server"
    shard: int = 0
    worker: int = 0
    settle_s: float = 1.0

    def kill_times(self, duration_s: float) -> tuple[float, ...]:
        """Kill times in seconds from the start, or ``()`` when kills are progress-triggered."""
        if self.num_kills == 0 or self.kill_after_updates is not None:
            return ()
        if self.kill_at_s is not None:
            return tuple(self.kill_at_s)
        gap = duration_s / (self.num_kills + 1)
        return tuple(gap * (i + 1) for i in range(self.num_kills))

    def validate(self, duration_s: float) -> None:
        """Raise ``ValueError`` when the schedule does not fit ``duration_s``."""
        _choice("kill target", self.target, KILL_TARGETS)
        if self.num_kills < 0:
            raise ValueError(f"kills must be >= 0, got {self.num_kills}")
        if self.downtime_s < 0:
            raise ValueError(f"downtime must be >= 0 s, got {self.downtime_s}")
        if self.shard < 0 or self.worker < 0:
            raise ValueError(f"shard and worker must be >= 0, got {self.shard} and {self.worker}")
        if self.num_kills == 0:
            return
        if self.kill_at_s is not None and self.kill_after_updates is not None:
            raise ValueError("give kill times or kill_after_updates, not both")
        if self.kill_after_updates is not None:
            if self.kill_after_updates < 1:
                raise ValueError(f"kill_after_updates must be >= 1, got {self.kill_after_updates}")
            needed = self.num_kills * (self.downtime_s + self.settle_s)
            if needed > duration_s:
                raise ValueError(
                    f"{self.num_kills} kills with {self.downtime_s:g} s downtime need at least "
                    f"{needed:g} s of training, but the duration is {duration_s:g} s"
                )
            return
        if self.kill_at_s is not None and len(self.kill_at_s) != self.num_kills:
            raise ValueError(
                f"{len(self.kill_at_s)} kill times given for {self.num_kills} kills"
            )
        times = self.kill_times(duration_s)
        if any(t <= 0 for t in times) or list(times) != sorted(times):
            raise ValueError(f"kill times must be positive and increasing, got {times}")
        ends = [*times[1:], duration_s]
        for kill_s, next_s in zip(times, ends, strict=True):
            if kill_s + self.downtime_s + self.settle_s > next_s:
                spacing = self.downtime_s + self.settle_s
                raise ValueError(
                    f"{self.num_kills} kills with {self.downtime_s:g} s downtime do not fit in "
                    f"{duration_s:g} s: each outage needs {spacing:g} s before the next kill or "
                    f"the end (downtime + {self.settle_s:g} s to recover); evenly spaced kills "
                    f"need a duration of at least {(self.num_kills + 1) * spacing:g} s"
                )


@dataclass(frozen=True)
class ResourceConfig:
    """What each actor asks Ray for, and how workers share a machine with servers.

    Attributes:
        worker_cpus: Ray CPUs per worker (fractional lets a laptop hold workers and servers).
        server_cpus: Ray CPUs per server.
        worker_niceness: added to each worker process's nice value. When workers and servers
            share cores, busy workers would otherwise slow a restarting server (a stateless
            worker computes flat out during an outage); on separate machines it changes nothing.
    """

    worker_cpus: float = 0.25
    server_cpus: float = 0.1
    worker_niceness: int = 10

    def validate(self) -> None:
        """Raise ``ValueError`` on a negative request."""
        if self.worker_cpus < 0 or self.server_cpus < 0:
            raise ValueError(
                f"CPU requests must be >= 0, got worker {self.worker_cpus}, server {self.server_cpus}"
            )
        if not 0 <= self.worker_niceness <= 19:
            raise ValueError(f"worker_niceness must be in [0, 19], got {self.worker_niceness}")


@dataclass(frozen=True)
class RunConfig:
    """One training run: a strategy, a consistency level, a fault plan.

    Attributes:
        strategy: ``baseline`` (one server, no fault tolerance), ``checkpoint``, ``chain`` or
            ``stateless``.
        num_shards: servers (or chains) the parameters are split over, by contiguous key range.
        duration_s: seconds of training.
        eval_every_s: seconds between evaluations of the served model on the test split.
        target_accuracy: the accuracy ``time_to_target_s`` is measured against.
        label: how reports name the run (default: the strategy; see :meth:`with_variant`).
    """

    strategy: StrategyName = "checkpoint"
    training: TrainingConfig = field(default_factory=TrainingConfig)
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    chain: ChainConfig = field(default_factory=ChainConfig)
    stateless: StatelessConfig = field(default_factory=StatelessConfig)
    faults: FaultPlan = field(default_factory=FaultPlan)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    num_shards: int = 1
    duration_s: float = 30.0
    eval_every_s: float = 0.5
    target_accuracy: float = 0.9
    label: str = ""

    @property
    def name(self) -> str:
        """The run's name in reports: its label, or its strategy."""
        return self.label or self.strategy

    def validate(self) -> None:
        """Check every section and their combinations; raise ``ValueError`` naming the problem."""
        _choice("strategy", self.strategy, STRATEGIES)
        self.training.validate()
        self.consistency.validate()
        self.checkpoint.validate()
        self.chain.validate()
        self.stateless.validate()
        self.resources.validate()
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        if not self.eval_every_s > 0:
            raise ValueError(f"eval interval must be > 0 s, got {self.eval_every_s}")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        self.faults.validate(self.duration_s)
        self._validate_fault_target()

    def _validate_fault_target(self) -> None:
        plan = self.faults
        if plan.num_kills == 0:
            return
        if plan.target == "worker":
            if plan.worker >= self.training.num_workers:
                raise ValueError(
                    f"cannot kill worker {plan.worker}: there are {self.training.num_workers} workers"
                )
            return
        if plan.shard >= self.num_shards:
            raise ValueError(f"cannot kill shard {plan.shard}: there are {self.num_shards} shards")
        if self.strategy == "baseline":
            raise ValueError(
                "the baseline strategy has no recovery, so a server kill would end the run; "
                "use kills=0 or one of " + ", ".join(RECOVERY_STRATEGIES)
            )
        if plan.target in ("middle", "tail") and self.strategy != "chain":
            raise ValueError(f"kill target {plan.target!r} exists only with the chain strategy")
        if plan.target == "middle" and self.chain.length < 3:
            raise ValueError(f"a chain of length {self.chain.length} has no middle node to kill")

    def with_strategy(self, strategy: str) -> RunConfig:
        """This configuration with another strategy (the baseline runs without faults)."""
        faults = FaultPlan() if strategy == "baseline" else self.faults
        return replace(self, strategy=strategy, faults=faults, label="")  # type: ignore[arg-type]

    def with_variant(self, variant: str) -> RunConfig:
        """This configuration with a strategy variant, labelled ``variant``.

        ``STRATEGY`` alone, or with a setting after a colon: ``checkpoint:N`` (checkpoint every
        N steps), ``chain:N`` (replicate every N steps; ``chain:per-update`` is the default),
        ``stateless:POLICY`` (a backlog policy). Lets one experiment compare, say, the paper's
        ``chain:100`` and ``stateless:sum-scaled`` with the defaults.

        Raises:
            ValueError: unknown strategy or a setting it does not take.
        """
        strategy, _, setting = variant.partition(":")
        _choice("strategy", strategy, STRATEGIES)
        config = self.with_strategy(strategy)
        if not setting:
            return config
        try:
            if strategy == "checkpoint":
                config = replace(config, checkpoint=replace(config.checkpoint, every=int(setting)))
            elif strategy == "chain":
                every = None if setting == "per-update" else int(setting)
                config = replace(config, chain=replace(config.chain, replicate_every=every))
            elif strategy == "stateless":
                _choice("backlog policy", setting, BACKLOG_POLICIES)
                config = replace(config, stateless=replace(config.stateless, policy=setting))  # type: ignore[arg-type]
            else:
                raise ValueError(f"strategy {strategy!r} takes no setting")
        except ValueError as e:
            raise ValueError(f"bad strategy variant {variant!r}: {e}") from None
        return replace(config, label=variant)

    def with_seed(self, seed: int) -> RunConfig:
        """This configuration with another seed."""
        return replace(self, training=replace(self.training, seed=seed))


@dataclass(frozen=True)
class ExperimentConfig:
    """An experiment.

    Attributes:
        base: the run configuration every run starts from (its strategy is replaced).
        strategies: the recovery strategies to compare, or variants of them
            (``chain:100``, ``stateless:sum-scaled``; see :meth:`RunConfig.with_variant`).
        seeds: one run per strategy and seed.
        baseline: also run ``baseline`` (no faults) for every seed.
        out_dir: where results go.
    """

    base: RunConfig
    strategies: tuple[str, ...]
    seeds: tuple[int, ...]
    out_dir: str
    baseline: bool = True

    def run_configs(self) -> list[RunConfig]:
        """Every run, baseline first, validated."""
        if not self.strategies and not self.baseline:
            raise ValueError("an experiment needs at least one strategy")
        if not self.seeds:
            raise ValueError("an experiment needs at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        names = (["baseline"] if self.baseline else []) + [s for s in self.strategies if s != "baseline"]
        if len(set(names)) != len(names):
            raise ValueError(f"strategies must be distinct, got {names}")
        configs = [self.base.with_variant(name).with_seed(seed) for name in names for seed in self.seeds]
        for config in configs:
            config.validate()
        return configs
