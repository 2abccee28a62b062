"""Helpers for the checkpoint tests: a tiny whole-model split into stages, a deterministic
training loop, and a launcher for real gloo process groups on CPU."""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bubbleguard.checkpoint.state import StageState
from bubbleguard.elastic.forking import process_target

NUM_BLOCKS = 4
DIM = 16


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.norm(self.lin(x)))) * self.scale


class Net(nn.Module):
    """Blocks under whole-model names ``blocks.<i>``; a stage holds a subset of them."""

    def __init__(self, blocks: Iterable[int] = range(NUM_BLOCKS), dim: int = DIM) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block(dim) for i in blocks})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks.values():
            x = b(x)
        return x


def make_training(
    blocks: Iterable[int] = range(NUM_BLOCKS), seed: int = 0, dim: int = DIM
) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A stage with AdamW (two param groups) and a StepLR scheduler, seeded."""
    torch.manual_seed(seed)
    model = Net(blocks, dim)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and ".lin." in n]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and ".lin." in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=1e-2
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def train_step(
    model: Net, opt: torch.optim.Optimizer, sched: Any, step: int, dim: int = DIM
) -> float:
    """One step whose result depends on the data cursor (step) and on all three RNGs."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, dim, generator=g)
    x = x + float(np.random.rand()) + random.random()  # Python and NumPy RNG matter too
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def assert_same_state(a: StageState, b: StageState) -> None:
    assert a.step == b.step
    assert_same_tensors(dict(a.tensors), dict(b.tensors))
    assert_same_tensors(dict(a.local_tensors), dict(b.local_tensors))
    assert a.metadata == b.metadata


def _entry(
    rank: int, fn: Callable[..., None], world: int, store: str, args: tuple[Any, ...]
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # Tear down together: a rank whose peer already exited can abort inside gloo's
        # teardown ("terminate called without an active exception", SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., None], world: int, tmp: str, *args: Any, timeout_s: float = 180
) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes on one gloo group."""
    store = os.path.join(tmp, f"store-{time.monotonic_ns()}")
    method, target = process_target(_entry)
    ctx = mp.start_processes(
        target, args=(fn, world, store, args), nprocs=world, join=False, start_method=method
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout_s} s")


def trained_state(
    steps: int, blocks: Iterable[int] = range(NUM_BLOCKS), seed: int = 0
) -> tuple[Any, ...]:
    """(model, opt, sched, state after ``steps`` steps); deterministic given the arguments."""
    from bubbleguard.checkpoint.state import capture_state

    seed_all(seed)
    model, opt, sched = make_training(blocks, seed)
    for s in range(1, steps + 1):
        train_step(model, opt, sched, s)
    return (
        model,
        opt,
        sched,
        capture_state(model, opt, sched, step=steps, data_cursor={"batch": steps}),
    )


def write_then_die(root: str, job_id: str, chunk_bytes: int) -> None:
    """Child process: snapshot step 2 completely, start step 3, copy half of it, SIGKILL itself."""
    import signal

    from bubbleguard.checkpoint.state import capture_state
    from bubbleguard.checkpoint.tiers.shm import MemoryTier

    model, opt, sched, state = trained_state(2)
    tier = MemoryTier(job_id, 0, root=root, chunk_bytes=chunk_bytes)
    tier.write(state)
    train_step(model, opt, sched, 3)
    layout = tier.begin(capture_state(model, opt, sched, step=3))
    for cid in range(layout.num_chunks // 2):
        tier.copy_chunk(cid)
    os.kill(os.getpid(), signal.SIGKILL)


STAGES_OF_2 = {0: [0, 1], 1: [2, 3]}


def save_two_stages(rank: int, world: int, root: str) -> None:
    """Rank r trains its stage of the whole model and saves step 2 to a DurableTier at root."""
    from bubbleguard.checkpoint.tiers.durable import DurableTier

    *_, state = trained_state(2, blocks=STAGES_OF_2[rank], seed=rank)
    DurableTier(root, keep_last=2).save(state)


def agree_worker(rank: int, world: int, out: str) -> None:
    from bubbleguard.checkpoint.manifest import agree_newest_step

    steps = {0: [5, 4, 1], 1: [4, 3, 1]}[rank]
    result = agree_newest_step(steps)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(str(result))


def persist_worker(rank: int, world: int, tmp: str) -> None:
    """Two stages: snapshot to the memory tier every step, persist every 2nd step in the
    background on a gloo group of its own while the training thread keeps all-reducing."""
    from bubbleguard.checkpoint.persist import BackgroundPersister
    from bubbleguard.checkpoint.state import capture_state
    from bubbleguard.checkpoint.tiers.durable import DurableTier
    from bubbleguard.checkpoint.tiers.shm import MemoryTier

    persist_group = dist.new_group(backend="gloo")
    os.makedirs(f"{tmp}/shm", exist_ok=True)
    memory = MemoryTier("persist", rank, num_ranks=world, root=f"{tmp}/shm", chunk_bytes=1024)
    durable = DurableTier(f"{tmp}/durable", process_group=persist_group, keep_last=2,
                          reuse_layout=True)
    persister = BackgroundPersister(memory, durable)
    seed_all(rank)
    model, opt, sched = make_training(STAGES_OF_2[rank], seed=rank)
    for step in range(1, 7):
        train_step(model, opt, sched, step)
        flag = torch.ones(1)
        dist.all_reduce(flag)  # the training thread's own communication, on the default group
        memory.write(capture_state(model, opt, sched, step=step, data_cursor={"batch": step}))
        dist.barrier()  # stands in for the runtime's piggybacked "every rank finished" signal
        if rank == 0:
            memory.commit(step)
        if step % 2 == 0:
            persister.submit(step)
    results = persister.close(timeout_s=60)
    # The first persist is a dcp.save; the helpers replay its files for the later ones.
    assert [(r.step, r.persisted, r.replayed) for r in results] == [
        (2, True, False), (4, True, True), (6, True, True)], results
    memory.close()


def train_with_snapshots_then_die(root: str, kill_at: int) -> None:
    """Child: train, snapshot every step chunk by chunk "inside the next iteration", and SIGKILL
    itself in iteration ``kill_at`` after copying part of the previous step's chunks."""
    import signal

    from bubbleguard.checkpoint.state import capture_state
    from bubbleguard.checkpoint.tiers.shm import MemoryTier

    tier = MemoryTier("resume", 0, root=root, chunk_bytes=1024)
    seed_all(0)
    model, opt, sched = make_training()
    for step in range(1, kill_at + 1):
        if step > 1:
            pending = tier.pending_chunks()
            for cid in pending[: len(pending) // 2]:  # what the bubbles of this iteration hold
                tier.copy_chunk(cid)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            tier.finish()  # the rest, just before optimizer.step()
        train_step(model, opt, sched, step)
        tier.begin(capture_state(model, opt, sched, step=step, data_cursor={"batch": step}))


def save_until_the_disk_is_full(tier: Any, model: Net, opt: torch.optim.Optimizer,
                                 sched: Any) -> list[int]:
    """Train (dim 64, ~400 KB of state) and save steps 1, 2, ... to ``tier`` on a small disk
    until a save fails; check that it failed for want of space, that the error names the
    checkpoint kept, and that the half-written step is gone. Returns the committed steps."""
    import errno

    import pytest

    from bubbleguard.checkpoint.state import capture_state

    committed: list[int] = []
    with pytest.raises(OSError) as e:
        for step in range(1, 10):
            train_step(model, opt, sched, step, dim=64)
            tier.save(capture_state(model, opt, sched, step=step))
            committed.append(step)
    assert e.value.errno == errno.ENOSPC
    assert committed and f"previous checkpoint (step {committed[-1]}) is kept" in str(e.value)
    assert tier.latest() == committed[-1]
    assert [i.step for i in tier.checkpoints()] == committed  # the partial one was removed
    assert tier.read().step == committed[-1]
    return committed


def mount_tmpfs(path: Path, options: str) -> bool:
    """Create ``path`` and, as root, mount a tmpfs with ``options`` on it; False if not mounted."""
    path.mkdir()
    if os.geteuid() != 0:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


@contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """A directory at ``path`` that this process cannot write to, for the ``with`` block.

    As root (who ignores permission bits) a read-only tmpfs is mounted; otherwise the mode is
    0555. Skips the test where neither works.
    """
    import pytest

    mounted = mount_tmpfs(path, "ro,size=1m")
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits and cannot mount a read-only tmpfs here")
        path.chmod(0o555)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)
        else:
            path.chmod(0o755)


class Cursor:
    """A minimal data cursor for a one-stage MLP job: the index of the next batch.

    Batches are drawn on the CPU from a generator seeded by the index (so a restored cursor
    gives the same batches) and moved to ``device``.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.index = 0
        self.device = device

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = state["index"]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.index)
        self.index += 1
        return (torch.randint(0, 256, (4, 16), generator=g).to(self.device),
                torch.randint(0, 256, (4,), generator=g).to(self.device))


def train_job(job: Any, cursor: Cursor, start: int, stop: int,
              stats: list[dict[str, float]] | None = None) -> list[float]:
    """Steps ``start + 1`` .. ``stop`` of a one-stage ``PipelineJob``; their losses (and, if
    given, each step's ``job.last_stats`` appended to ``stats``)."""
    losses = []
    for _ in range(start, stop):
        loss = job.step(*cursor.next_batch())
        assert loss is not None
        losses.append(loss)
        if stats is not None:
            stats.append(dict(job.last_stats))
    return losses
