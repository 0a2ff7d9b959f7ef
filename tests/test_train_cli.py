"""model.train's command line on odd and bad input (issue 30 items 9, 10, 23-26; issue 24 item 14's
"--resume with nothing to resume starts fresh"): every bad value is refused before the run with a
message naming the flag or the field; none of them is silently accepted."""

from __future__ import annotations

import pytest
import torch

from model.train import CHECKPOINT_FILE, main, parse_args

COMMON = ["--config", "tiny", "--kernels", "fused", "--batch-size", "8", "--no-progress", "--eval-batches", "1",
          "--warmup", "0"]


def _refused(capsys, argv: list[str], *fragments: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("flag", ["--eval-every", "--warmup", "--checkpoint-every"])
def test_negative_counts_are_refused(capsys, flag):
    _refused(capsys, [flag, "-1"], f"{flag} must be >= 0, got -1")


@pytest.mark.parametrize("seed", ["-1", str(2**63), "99999999999999999999999"])
def test_seed_out_of_range_is_refused(capsys, seed):
    """Found by the front-door fuzz: --seed -1 failed after the model was built, and a seed past 64
    bits with "Overflow when unpacking long long", a message that names nothing."""
    _refused(capsys, ["--seed", seed], f"--seed must be an int in [0, 2**63), got {seed}")


@pytest.mark.parametrize("device,fragment", [("meta", "must be cpu or cuda"), ("nonsense", "is not a device")])
def test_unusable_device_is_refused(capsys, device, fragment):
    _refused(capsys, ["--device", device], f"--device", fragment)


def test_unwritable_outputs_are_refused_before_the_run(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _refused(capsys, ["--json", str(blocker / "out.json")], "--json", "cannot create the directory")
    _refused(capsys, ["--json", str(tmp_path)], "--json", "is a directory")
    _refused(capsys, ["--checkpoint", str(blocker)], "--checkpoint", "is a file")
    _refused(capsys, ["--checkpoint", str(blocker / "ckpt")], "--checkpoint", "cannot create the directory")


@pytest.mark.parametrize("flag,path", [("--json", "/proc/gk-out.json"), ("--checkpoint", "/proc"),
                                       ("--checkpoint", "/proc/gk-ckpt")])
def test_outputs_no_one_can_write_are_refused_before_the_run(capsys, flag, path):
    """Issue 30 item 26 as root (CI may run as root, and root passes every os.access check): /proc
    takes no new file from anyone. --json /proc/x and --checkpoint /proc passed parse_args and the run
    failed only at its end."""
    _refused(capsys, [flag, path], flag)


def test_read_only_directory_is_refused_before_the_run(capsys, tmp_path):
    """Issue 30 item 26 for a user without root: a read-only --json or --checkpoint directory."""
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        try:
            (locked / "probe").write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip("this user (root) can write into a read-only directory: the /proc test covers root")
        _refused(capsys, ["--json", str(locked / "out.json")], "--json", "is not writable")
        _refused(capsys, ["--checkpoint", str(locked)], "--checkpoint", "is not writable")
    finally:
        locked.chmod(0o700)
        assert os.access(locked, os.W_OK)


def test_checkpoint_file_that_is_a_directory_is_refused_before_the_run(capsys, tmp_path):
    """Found by the front-door fuzz: DIR/checkpoint.pt as a directory was taken for "nothing to resume",
    and the save at the end of the run failed with IsADirectoryError."""
    (tmp_path / CHECKPOINT_FILE).mkdir()
    _refused(capsys, ["--checkpoint", str(tmp_path), "--resume"], "--checkpoint", "is a directory")


def test_corrupt_checkpoint_via_the_command_line(tmp_path):
    """Issue 30 item 24 as a shell user sees it: python -m model.train --resume on a corrupt
    checkpoint.pt exits 1 with "cannot read checkpoint DIR/checkpoint.pt: ..." and trains nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"not a checkpoint")
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "model.train", *COMMON, "--steps", "1", "--checkpoint", str(tmp_path),
                           "--resume"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: cannot read checkpoint {tmp_path / CHECKPOINT_FILE}: "), last
    assert "loss" not in proc.stdout, proc.stdout  # no step ran


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A 2-step run that left a checkpoint, and its losses."""
    directory = tmp_path_factory.mktemp("ckpt")
    result = main(COMMON + ["--steps", "2", "--checkpoint", str(directory)])
    return directory, result["losses"]


def test_resume_with_nothing_to_resume_starts_fresh(checkpointed, tmp_path):
    """torchrun --max-restarts gives every launch the same command line, --resume included."""
    _, losses = checkpointed
    fresh = main(COMMON + ["--steps", "2", "--checkpoint", str(tmp_path / "new"), "--resume"])
    assert fresh["losses"] == losses
    assert (tmp_path / "new" / CHECKPOINT_FILE).is_file()


def test_resume_below_the_checkpoint_step_is_refused(checkpointed):
    directory, _ = checkpointed
    before = (directory / CHECKPOINT_FILE).read_bytes()
    with pytest.raises(ValueError, match=r"--steps 1 is below the checkpoint's step 2"):
        main(COMMON + ["--steps", "1", "--checkpoint", str(directory), "--resume"])
    assert (directory / CHECKPOINT_FILE).read_bytes() == before  # not rewound


def test_resume_with_another_batch_size_names_the_field(checkpointed):
    directory, _ = checkpointed
    argv = [a if a != "8" else "16" for a in COMMON]
    with pytest.raises(ValueError, match=r"batch_size: checkpoint 8, this run 16"):
        main(argv + ["--steps", "3", "--checkpoint", str(directory), "--resume"])


@pytest.mark.parametrize("content", [b"not a checkpoint", None])
def test_corrupt_checkpoint_says_which_file(tmp_path, content):
    path = tmp_path / CHECKPOINT_FILE
    if content is None:
        torch.save({"something": 1}, path)  # a readable file that is no model.train checkpoint
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"cannot read checkpoint {path}"):
        main(COMMON + ["--steps", "2", "--checkpoint", str(tmp_path), "--resume"])


def test_corrupt_distributed_checkpoint_says_which_file(tmp_path):
    """--distributed's DCP checkpoint: a .metadata that does not unpickle is named (read before
    any collective, so no process group is needed here)."""
    pytest.importorskip("torchrec")
    from model.distributed import load

    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=rf"cannot read checkpoint {tmp_path}/.metadata"):
        load(tmp_path, None, None)


def test_only_a_complete_distributed_checkpoint_is_resumed(tmp_path):
    """A checkpoint appears by rename once complete: a staging directory (a killed save) is never
    resumed; between the two renames of a publish, the previous complete one is."""
    pytest.importorskip("torchrec")
    from model.distributed import published

    directory = tmp_path / "ckpt"
    (tmp_path / ".ckpt.staging").mkdir()
    (tmp_path / ".ckpt.staging" / ".metadata").write_bytes(b"")
    assert published(directory) is None
    (tmp_path / ".ckpt.previous").mkdir()
    (tmp_path / ".ckpt.previous" / ".metadata").write_bytes(b"")
    assert published(directory) == tmp_path / ".ckpt.previous"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"")
    assert published(directory) == directory
