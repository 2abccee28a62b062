"""The GPU path: snapshot copies on a side stream into registered shared memory, and resume of a
CUDA stage. Skipped without a CUDA device (CI has none): run ``pytest tests/checkpoint/test_cuda.py``
on a machine with one."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bubbleguard.checkpoint.checkpointer import BubbleStrategy, CheckpointConfig, Checkpointer
from bubbleguard.checkpoint.layout import DEVICE_CHUNK_BYTES
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.shm import MemoryTier
from bubbleguard.models import build_model, lm_loss
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.stage import split
from tests.checkpoint.ckpt_testlib import Cursor, train_job

# cuBLAS is deterministic only with a fixed workspace; it must be set before its first use.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_SLEEP_CYCLES = 2_000_000_000  # about 1 s of one GPU thread at 2 GHz


@pytest.fixture
def shm_root(tmp_path: Path) -> Iterator[Path]:
    """A directory in /dev/shm (as in production) when it has room, else one on disk."""
    usage = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    if usage is None or usage.free < 1 << 30:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        yield Path(d)


@pytest.fixture
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_device_copies_are_queued_after_the_step_and_land_checksummed(shm_root: Path) -> None:
    dev = torch.device("cuda")
    tensors = {
        "w": torch.zeros(3_000_000, device=dev),  # 12 MB
        "half": torch.randn(1001, device=dev, dtype=torch.bfloat16),  # 2002 bytes
        "ids": torch.arange(7, device=dev),
    }
    cpu_rng = torch.get_rng_state()  # a CPU tensor in the same snapshot, as in a real one
    tier = MemoryTier("cuda-order", root=shm_root)
    with warnings.catch_warnings():
        # A failed cudaHostRegister warns (copies would block): fail instead.
        warnings.filterwarnings("error", message="cudaHostRegister")
        # The first snapshot into a slot registers it with the driver, which waits for the
        # whole device (seen on an H200): fill both slots first, as a job's first steps do.
        for step in (1, 2):
            tier.write(StageState(step=step, tensors=tensors, local_tensors={"rng.torch": cpu_rng}))
        torch.cuda.synchronize()
        torch.cuda._sleep(GPU_SLEEP_CYCLES)  # the GPU is busy for a while ...
        tensors["w"].fill_(7.0)  # ... then the "optimizer step" writes the state
        ready = torch.cuda.Event()
        ready.record()
        torch.cuda._sleep(GPU_SLEEP_CYCLES)  # the next iteration's work, queued after the step
        layout = tier.begin(StageState(step=3, tensors=tensors,
                                       local_tensors={"rng.torch": cpu_rng}), after=ready)
        assert tier.copies_async and layout.num_chunks == 3  # 12,007,168 bytes: 3 chunks
        for chunk_id in range(layout.num_chunks):
            tier.copy_chunk(chunk_id)
        # Queued, not copied: the GPU is still in the first sleep, so none of the device copies
        # can have landed (a copy into memory that is not registered would have blocked).
        assert not ready.query()
        assert tier.copies_in_flight == layout.num_chunks
        assert not tier.checksum_landed(wait=False)
        record = tier.finish()
        # The copies waited for the step, not for the work queued after it: that is still on.
        assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert tier.copies_in_flight == 0 and len(record.checksums) == layout.num_chunks
    snap = tier.read(3)  # verifies every chunk against its checksum
    assert torch.equal(snap.tensors["w"], torch.full((3_000_000,), 7.0))
    assert torch.equal(snap.tensors["half"], tensors["half"].cpu())
    assert torch.equal(snap.tensors["ids"], torch.arange(7))
    assert torch.equal(snap.local_tensors["rng.torch"], cpu_rng)
    tier.cleanup()


def test_a_snapshot_mixes_device_sums_with_host_checksums_of_misaligned_pieces(
        shm_root: Path) -> None:
    dev = torch.device("cuda")
    base = torch.arange(2003, device=dev).to(torch.uint8)
    tensors = {
        "w": torch.randn(3_000_000, device=dev),  # chunks 0-2, summed on the device
        "odd": base[1:],  # starts one byte into its storage: no device sum, checksummed on host
        "v": torch.randn(5000, device=dev),
    }
    tier = MemoryTier("cuda-mixed", root=shm_root)
    layout = tier.begin(StageState(step=1, tensors=tensors,
                                   local_tensors={"rng.torch": torch.get_rng_state()}))
    for chunk_id in range(layout.num_chunks):
        tier.copy_chunk(chunk_id)
    assert tier.copies_in_flight == layout.num_chunks
    tier.finish()
    snap = tier.read(1)  # every chunk's checksum recomputed from the bytes that landed
    for name, t in tensors.items():
        assert torch.equal(snap.tensors[name], t.cpu()), name
    tier.cleanup()


def test_a_gpu_stage_gets_large_chunks_unless_asked(tmp_path: Path, shm_root: Path) -> None:
    for chunk_bytes, expected in ((None, DEVICE_CHUNK_BYTES), (1 << 20, 1 << 20)):
        job = _job()
        ckpt = Checkpointer(job, CheckpointConfig(ckpt_dir=str(tmp_path / f"c{expected}"),
                                                  shm_root=str(shm_root),
                                                  chunk_bytes=chunk_bytes))
        assert ckpt.memory is not None and ckpt.memory.chunk_bytes == expected
        ckpt.close()
        job.close()


def test_a_non_contiguous_device_tensor_is_copied_after_its_flattening(shm_root: Path) -> None:
    dev = torch.device("cuda")
    base = torch.zeros(512, 257, device=dev)
    ready = torch.cuda.Event()
    ready.record()
    torch.cuda._sleep(GPU_SLEEP_CYCLES // 4)
    base.copy_(torch.arange(512 * 257, dtype=torch.float32, device=dev).view(512, 257))
    tier = MemoryTier("cuda-noncontig", root=shm_root)
    # The transpose is flattened by a copy queued on the current stream after the event (and
    # after the sleep and the fill): the side stream must wait for that, not only the event.
    layout = tier.begin(StageState(step=1, tensors={"t": base.t()}), after=ready)
    for chunk_id in range(layout.num_chunks):
        tier.copy_chunk(chunk_id)
    tier.finish()
    snap = tier.read(1)
    assert torch.equal(snap.tensors["t"], base.t().cpu())
    assert snap.tensors["t"].is_contiguous() and snap.tensors["t"].shape == (257, 512)
    tier.cleanup()


def _dropout_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Draws from the CUDA generator every microbatch: a resume must restore it too.
    return lm_loss(F.dropout(logits, 0.2, training=True), targets)


def _job() -> PipelineJob:
    stage = split(build_model("mlp", seed=1), 1, 0).cuda()
    return PipelineJob(stage, torch.optim.AdamW(stage.parameters(), lr=1e-2), _dropout_loss,
                       num_microbatches=2)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@pytest.mark.timeout(90)
def test_a_gpu_stage_resumes_bit_identically_from_memory_then_durable(
        tmp_path: Path, shm_root: Path, deterministic: None) -> None:
    _seed(0)
    reference = train_job(_job(), Cursor("cuda"), 0, 10)
    config = CheckpointConfig(mode="bubble", ckpt_dir=str(tmp_path / "ckpt"), persist_every=2,
                              shm_root=str(shm_root))

    _seed(0)
    job, cursor = _job(), Cursor("cuda")
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    assert ckpt.resume(cursor.load_state_dict).step == 0
    stats: list[dict[str, float]] = []
    first = train_job(job, cursor, 0, 5, stats)
    ckpt.flush()  # the snapshot of step 5 is complete in shared memory
    # The copies ran in the helper thread alongside compute, not all at the step boundary.
    assert sum(s["ckpt_bubble_s"] for s in stats) > 0
    # A crash: the process goes without the final persist (the helper is stopped, the
    # shared memory stays).
    assert isinstance(ckpt.strategy, BubbleStrategy)
    ckpt.strategy.persister.close()
    assert ckpt.memory is not None
    ckpt.memory.close()
    job.close()

    _seed(123)  # the resume must bring back every generator, the CUDA one included
    job, cursor = _job(), Cursor("cuda")
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    info = ckpt.resume(cursor.load_state_dict)
    assert (info.step, info.tier, cursor.index) == (5, "memory", 5)
    second = train_job(job, cursor, 5, 8)
    ckpt.close()  # persists step 8 and drops the shared memory
    job.close()

    _seed(321)
    job, cursor = _job(), Cursor("cuda")
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    info = ckpt.resume(cursor.load_state_dict)
    assert (info.step, info.tier, cursor.index) == (8, "durable", 8)
    third = train_job(job, cursor, 8, 10)
    ckpt.close()
    job.close()
    assert first + second + third == reference


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("mode", "tier"), [("sync", "torchsave"), ("background", "durable"),
                                            ("dcp-async", "durable")])
def test_baselines_checkpoint_a_gpu_stage_and_resume_it(
        tmp_path: Path, shm_root: Path, deterministic: None, mode: str, tier: str) -> None:
    _seed(0)
    reference = train_job(_job(), Cursor("cuda"), 0, 6)
    config = CheckpointConfig(mode=mode, ckpt_dir=str(tmp_path / "ckpt"), persist_every=2,
                              shm_root=str(shm_root))
    _seed(0)
    job, cursor = _job(), Cursor("cuda")
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    first = train_job(job, cursor, 0, 4)
    ckpt.close()
    job.close()

    _seed(7)
    job, cursor = _job(), Cursor("cuda")
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    info = ckpt.resume(cursor.load_state_dict)
    assert (info.step, info.tier) == (4, tier)
    second = train_job(job, cursor, 4, 6)
    ckpt.close()
    job.close()
    assert first + second == reference
