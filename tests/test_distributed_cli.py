"""``python -m model.train --distributed`` through torchrun, as users launch it (gloo, CPU):
one global batch split by rank (1 rank and 2 ranks give the same losses), global throughput
figures, and the elastic pattern: ``torchrun --max-restarts 1`` with ``--resume`` on every launch,
a rank SIGKILLed while a checkpoint is being written, resumed from the last complete checkpoint,
ending with the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchrec")

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
ARGS = ["--config", "tiny", "--distributed", "--plan", "table_wise", "--steps", "6", "--batch-size", "8",
        "--no-progress", "--eval-batches", "1", "--warmup", "0"]
TIMEOUT_S = 300


def _torchrun(world: int, json_path: Path, *extra: str, script: str | None = None, env_extra=None,
              restarts: int = 0) -> tuple[dict, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env_extra or {}))
    target = [str(REPO / script)] if script else ["-m", "model.train"]
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", str(world), "--max-restarts", str(restarts),
                           *target, *ARGS, "--json", str(json_path), *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(json_path.read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_cli")
    return {world: _torchrun(world, root / f"w{world}.json")[0] for world in (1, 2)}


def test_global_batch_is_the_same_on_any_world_size(uninterrupted):
    """Step i trains global batch i, split by rank: the losses of 1 and 2 ranks agree (fp32 sums in
    another order: 1e-5), and they are the global batch's, not rank 0's."""
    one, two = uninterrupted[1], uninterrupted[2]
    assert len(one["losses"]) == len(two["losses"]) == 6
    for a, b in zip(one["losses"], two["losses"]):
        assert abs(a - b) <= 1e-5, (one["losses"], two["losses"])


def test_throughput_is_global_with_per_rank_figures_labelled(uninterrupted):
    two = uninterrupted[2]
    assert two["world_size"] == 2 and two["global_batch_size"] == two["batch_size"] == 8
    assert two["examples_per_s"] == pytest.approx(8 / (two["step_ms"] / 1e3))
    assert two["examples_per_s_per_rank"] == pytest.approx(two["examples_per_s"] / 2)
    assert two["tflops"] > two["tflops_per_rank"] > 0
    assert two["mfu"] == pytest.approx(two["tflops"] / two["peak_tflops"])


def test_sigkill_while_checkpointing_resumes_from_the_last_complete_checkpoint(uninterrupted, tmp_path):
    """Every launch carries --resume (the first has nothing to resume: it starts fresh). Rank 1 dies
    as the step-4 checkpoint is being written (rank 0's part written, rank 1's not); torchrun
    restarts both; they resume from the complete step-2 checkpoint and end with the uninterrupted
    run's losses, and the final checkpoint is complete."""
    checkpoint = tmp_path / "ckpt"
    result, log = _torchrun(2, tmp_path / "faulted.json", "--checkpoint", str(checkpoint), "--checkpoint-every", "2",
                            "--resume", script="tests/kill_rank_train.py", restarts=1,
                            env_extra={"KILL_RANK": "1", "KILL_AT_SAVE": "2"})
    assert f"resumed from {checkpoint} at step 2" in log, log[-4000:]
    for a, b in zip(result["losses"], uninterrupted[2]["losses"]):
        assert abs(a - b) <= 1e-6, (result["losses"], uninterrupted[2]["losses"])
    assert len(result["losses"]) == 6
    assert (checkpoint / ".metadata").is_file()
    assert not (tmp_path / ".ckpt.staging").exists() and not (tmp_path / ".ckpt.previous").exists()


def test_the_run_ends_the_process_group_it_made_and_keeps_the_callers(tmp_path, monkeypatch):
    """model.train --distributed ends the gloo group it made (after the last barrier), so no group is
    alive at the interpreter's exit (where gloo's threads can abort the rank); a group the caller made
    before calling main is left to the caller. In process, 1 rank, torchrun's environment variables."""
    import socket

    import torch.distributed as dist

    from model.train import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    args = list(ARGS)
    args[args.index("--steps") + 1] = "2"
    assert not dist.is_initialized()
    result = main(args + ["--json", str(tmp_path / "own.json")])
    assert result["world_size"] == 1 and len(result["losses"]) == 2
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        main(args + ["--json", str(tmp_path / "callers.json")])
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
