"""`bubbleguard inspect` lists durable and memory-tier checkpoints with their validity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bubbleguard.checkpoint.checkpointer import job_id_for
from bubbleguard.checkpoint.tiers.shm import shm_job_dir
from bubbleguard.cli.main import main


@pytest.mark.timeout(180)
def test_inspect_lists_both_tiers_and_flags_a_half_written_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    # Killed before step 5: steps 2 (durable, maybe) and 3 or 4 (memory) exist, nothing is
    # cleaned up, so both tiers have something to show.
    rc = main(["train", "--model", "mlp", "--steps", "6", "--microbatches", "2", "--batch-size",
               "8", "--ckpt", "bubble", "--ckpt-dir", str(ckpt), "--persist-every", "2",
               "--fault", "1:5:before", "--no-progress"])
    assert rc == 1
    # Rank 1's SIGKILL is named when torchrun noticed it; when it noticed rank 0's broken
    # connection first, the message says that a peer may have been killed.
    err = capsys.readouterr().err
    assert ("training failed: rank 1: Signal 9 (SIGKILL)" in err
            or "no rank recorded an error of its own: a peer may have been killed" in err), err
    # A half-written durable checkpoint: a step directory without its commit marker.
    (ckpt / "step-00000099").mkdir(parents=True, exist_ok=True)
    try:
        assert main(["inspect", str(ckpt), "--json"]) == 0
        records = json.loads(capsys.readouterr().out)
        memory = [r for r in records if r["tier"] == "memory"]
        valid = [r["step"] for r in memory if r["valid"]]
        # Snapshot 3 is complete everywhere and 4 was unfinished. Step 2 survives where its slot
        # was still pinned for the persist helper (which reads it once it has started up).
        assert 3 in valid and 4 not in valid and set(valid) <= {2, 3}, valid
        assert all(r["num_ranks"] == 2 for r in memory)
        bad = [r for r in records if r["step"] == 99]
        assert bad and not bad[0]["valid"] and "no commit marker" in bad[0]["reason"]
        assert main(["inspect", str(ckpt)]) == 0
        table = capsys.readouterr().out
        assert "memory" in table and "INVALID" in table
    finally:
        shutil.rmtree(shm_job_dir(job_id_for(str(ckpt))), ignore_errors=True)


def test_inspect_of_a_missing_directory_is_an_error(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
