"""Tests for bubbleguard.ps.config: every bad input is rejected with an actionable message."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bubbleguard.ps.config import (
    ChainConfig,
    ConsistencyConfig,
    FaultPlan,
    RunConfig,
    StatelessConfig,
    TrainingConfig,
)


def test_defaults_are_valid() -> None:
    RunConfig().validate()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (RunConfig(strategy="raft"), "unknown strategy 'raft'"),  # type: ignore[arg-type]
        (RunConfig(consistency=ConsistencyConfig("causal")), "unknown consistency 'causal'"),  # type: ignore[arg-type]
        (RunConfig(consistency=ConsistencyConfig("bounded", -1)), "staleness must be >= 0"),
        (RunConfig(consistency=ConsistencyConfig("eventual", 2)), "only applies to bounded"),
        (RunConfig(training=TrainingConfig(num_workers=0)), "num_workers"),
        (RunConfig(training=TrainingConfig(lr=0)), "lr must be > 0"),
        (RunConfig(training=TrainingConfig(worker_delay_s=(0.1,) * 5)), "5 entries for 4 workers"),
        (RunConfig(chain=ChainConfig(length=1)), "chain length"),
        (RunConfig(stateless=StatelessConfig(policy="median")), "unknown backlog policy"),  # type: ignore[arg-type]
        (RunConfig(stateless=StatelessConfig(buffer_cap=0)), "buffer_cap"),
        (RunConfig(duration_s=0), "duration"),
        (RunConfig(strategy="baseline", faults=FaultPlan(num_kills=1)), "baseline strategy has no recovery"),
        (RunConfig(strategy="checkpoint", faults=FaultPlan(num_kills=1, target="middle")), "only with the chain"),
        (
            RunConfig(strategy="chain", chain=ChainConfig(length=2), faults=FaultPlan(num_kills=1, target="middle")),
            "no middle node",
        ),
        (RunConfig(faults=FaultPlan(num_kills=1, target="worker", worker=4)), "cannot kill worker 4"),
        (RunConfig(faults=FaultPlan(num_kills=1, shard=1)), "cannot kill shard 1"),
    ],
)
def test_invalid_configurations_name_the_problem(config: RunConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_too_many_kills_for_the_duration() -> None:
    plan = FaultPlan(num_kills=3, downtime_s=10.0)
    with pytest.raises(ValueError, match="need a duration of at least 44 s"):
        plan.validate(30.0)
    plan.validate(44.0)
    assert plan.kill_times(44.0) == (11.0, 22.0, 33.0)


def test_explicit_kill_times_must_leave_room_to_recover() -> None:
    FaultPlan(num_kills=2, downtime_s=2.0, kill_at_s=(3.0, 7.0)).validate(10.0)
    with pytest.raises(ValueError, match="do not fit"):
        FaultPlan(num_kills=2, downtime_s=2.0, kill_at_s=(3.0, 5.0)).validate(10.0)
    with pytest.raises(ValueError, match="2 kill times given for 1 kills"):
        FaultPlan(num_kills=1, kill_at_s=(1.0, 2.0)).validate(10.0)
    with pytest.raises(ValueError, match="positive and increasing"):
        FaultPlan(num_kills=2, downtime_s=0.1, kill_at_s=(5.0, 2.0)).validate(10.0)


def test_update_triggered_kills_check_only_the_total_downtime() -> None:
    FaultPlan(num_kills=2, downtime_s=3.0, kill_after_updates=100).validate(8.0)
    with pytest.raises(ValueError, match="need at least 8 s"):
        FaultPlan(num_kills=2, downtime_s=3.0, kill_after_updates=100).validate(7.0)
    assert FaultPlan(num_kills=2, kill_after_updates=100).kill_times(60.0) == ()


def test_bounds_per_level_and_the_baseline_drops_faults() -> None:
    assert ConsistencyConfig("strict").bound == 0
    assert ConsistencyConfig("bounded", 3).bound == 3
    assert ConsistencyConfig("eventual").bound is None
    config = RunConfig(strategy="chain", faults=FaultPlan(num_kills=1))
    assert config.with_strategy("baseline").faults == FaultPlan()
    assert config.with_seed(7).training.seed == 7
    assert replace(config, strategy="stateless").with_strategy("checkpoint").faults.num_kills == 1


def test_strategy_variants_set_one_setting_and_label_the_run() -> None:
    base = RunConfig(faults=FaultPlan(num_kills=1))
    paper_chain = base.with_variant("chain:100")
    assert (paper_chain.strategy, paper_chain.chain.replicate_every, paper_chain.name) == ("chain", 100, "chain:100")
    assert base.with_variant("chain:per-update").chain.per_update
    assert base.with_variant("stateless:sum-scaled").stateless.policy == "sum-scaled"
    assert base.with_variant("checkpoint:20").checkpoint.every == 20
    assert base.with_variant("stateless").name == "stateless"
    for bad, message in [("stateless:median", "unknown backlog policy"), ("chain:x", "bad strategy variant"),
                         ("baseline:3", "takes no setting"), ("raft:1", "unknown strategy")]:
        with pytest.raises(ValueError, match=message):
            base.with_variant(bad)

