"""The public API works in one process without torch.distributed initialised."""

from __future__ import annotations

import pytest
import torch

from bubbleguard.models import build_model, lm_loss
from bubbleguard.pipeline.layout import Layout
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.stage import split


def test_one_stage_job_equals_plain_training() -> None:
    x = torch.randint(0, 256, (8, 16))
    y = torch.randint(0, 256, (8,))
    ref = build_model("mlp", seed=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    stage = split(build_model("mlp", seed=3), 1, 0)
    job = PipelineJob(stage, torch.optim.SGD(stage.parameters(), lr=0.1), lm_loss,
                      schedule="gpipe", num_microbatches=4)
    for _ in range(3):
        loss = lm_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = job.step(x, y)
        assert got == pytest.approx(loss.item(), rel=1e-6)
    for (n, p), (n2, q) in zip(ref.named_parameters(), stage.named_parameters(), strict=True):
        assert n == n2
        torch.testing.assert_close(p, q)
    kinds = {e.kind for e in job.timeline.events}
    assert kinds == {"compute", "step"}


def test_multi_rank_layout_needs_torch_distributed() -> None:
    stage = split(build_model("mlp", seed=0), 2, 0)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        PipelineJob(stage, torch.optim.SGD(stage.parameters(), lr=0.1), lm_loss,
                    layout=Layout(2, 1), num_microbatches=2)


def test_indivisible_batch_is_named() -> None:
    stage = split(build_model("mlp", seed=0), 1, 0)
    job = PipelineJob(stage, torch.optim.SGD(stage.parameters(), lr=0.1), lm_loss,
                      num_microbatches=3)
    with pytest.raises(ValueError, match="batch of 8 rows does not split into 3 microbatches"):
        job.step(torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8,)))
