"""The pipeline runtime against a single-process reference: same losses, same gradients.

All configurations run in one set of processes (starting a process with torch costs more than a
configuration), each configuration in a fresh gloo group made of the first P*D processes.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bubbleguard.elastic.forking import process_target
from bubbleguard.models import build_model, lm_loss
from bubbleguard.pipeline.layout import Layout
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.stage import split

NUM_STEPS = 2


@dataclass(frozen=True)
class Case:
    model: str
    schedule: str
    num_stages: int
    num_microbatches: int
    num_replicas: int = 1

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas


CASES = [
    Case("mlp", sched, p, m, d)
    for sched in ("gpipe", "1f1b")
    for p in (2, 3, 4)
    for m, d in ((1, 1), (4, 1), (3, 2))
] + [Case("gpt", "1f1b", 2, 2, 2), Case("gpt", "gpipe", 3, 3), Case("gpt", "1f1b", 4, 6)]

ROWS_PER_MICROBATCH = 2


def _model(case: Case) -> torch.nn.Module:
    overrides = {"seq_len": 8, "d_model": 16, "num_heads": 2} if case.model == "gpt" else {}
    return build_model(case.model, seed=7, **overrides)


def _batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (all replicas), fixed by the case."""
    g = torch.Generator().manual_seed(11)
    rows = ROWS_PER_MICROBATCH * case.num_microbatches * case.num_replicas
    out = []
    for _ in range(NUM_STEPS):
        if case.model == "gpt":
            x = torch.randint(0, 256, (rows, 8), generator=g)
            y = torch.randint(0, 256, (rows, 8), generator=g)
        else:
            x = torch.randint(0, 256, (rows, 16), generator=g)
            y = torch.randint(0, 256, (rows,), generator=g)
        out.append((x, y))
    return out


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it stepped with."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__([p for _, p in named], lr=0.1, momentum=0.9)
        self.names = [n for n, _ in named]
        self.seen: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        params = self.param_groups[0]["params"]
        self.seen.append({n: p.grad.detach().clone() for n, p in zip(self.names, params, strict=True)})
        return super().step(closure)


def _worker(rank: int, cases: list[Case], store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for i, case in enumerate(cases):
        if rank >= case.world_size:
            continue
        store = dist.PrefixStore(f"case{i}", dist.FileStore(store_path, -1))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=case.world_size)
        layout = Layout(case.num_stages, case.num_replicas)
        stage = split(_model(case), case.num_stages, layout.stage_of(rank))
        opt = RecordingSGD(list(stage.named_parameters()))
        job = PipelineJob(stage, opt, lm_loss, layout=layout, schedule=case.schedule,
                          num_microbatches=case.num_microbatches)
        losses = []
        replica = layout.replica_of(rank)
        for x, y in _batches(case):
            x, y = x.chunk(case.num_replicas)[replica], y.chunk(case.num_replicas)[replica]
            losses.append(job.step(x, y))
        job.close()
        dist.destroy_process_group()
        results[i] = {"losses": losses, "grads": opt.seen,
                      "params": {n: p.detach() for n, p in stage.named_parameters()}}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _reference(case: Case) -> dict[str, object]:
    model = _model(case)
    named = list(model.named_parameters())
    opt = RecordingSGD(named)
    losses = []
    for x, y in _batches(case):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": opt.seen,
            "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def pipeline_results() -> dict[int, list[dict]]:
    world = max(c.world_size for c in CASES)
    with tempfile.TemporaryDirectory() as tmp:
        method, target = process_target(_worker)
        mp.start_processes(target, args=(CASES, os.path.join(tmp, "store"), tmp), nprocs=world,
                           start_method=method)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True)
                    for r in range(world)]
    return {i: [per_rank[r][i] for r in range(c.world_size)] for i, c in enumerate(CASES)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    f"{c.model}-{c.schedule}-P{c.num_stages}-M{c.num_microbatches}-D{c.num_replicas}" for c in CASES])
def test_matches_single_process_reference(pipeline_results: dict[int, list[dict]],
                                          index: int) -> None:
    case = CASES[index]
    ref = _reference(case)
    layout = Layout(case.num_stages, case.num_replicas)
    seen_params: set[str] = set()
    for rank, res in enumerate(pipeline_results[index]):
        if layout.stage_of(rank) == case.num_stages - 1:
            assert res["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
        else:
            assert res["losses"] == [None] * NUM_STEPS
        for got, want in zip(res["grads"], ref["grads"], strict=True):
            assert got.keys() <= want.keys()
            for name, g in got.items():
                torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6)
        for name, p in res["params"].items():
            torch.testing.assert_close(p, ref["params"][name], rtol=1e-5, atol=1e-6)
            seen_params.add(name)
    # The stages together hold every parameter of the model exactly as the reference names it.
    assert seen_params == set(ref["params"])
