"""The --save folder: one owner at a time (the lock), one lineage (moved aside, pruned by lineage), room for a
checkpoint (the estimate and the start-of-run warning) and a full disk (one line, the partial folder removed, the
previous checkpoint intact), in-process; the agreement of two ranks on a failure, under torchrun."""
import errno
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

import trainer_parts
from trainer_parts import NoData

from megatron.training.checkpointing import lineage, lock, space
from omnibal_ext.errors import RunStopped, UserError

HERE = os.path.dirname(os.path.abspath(__file__))
HOST = socket.gethostname()


def dead_pid() -> int:
    """The PID of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(folder, holder: lock.Holder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lock.LOCK).write_text(holder.to_text())


def test_a_live_holder_is_refused_naming_it_and_a_dead_one_is_taken_over(tmp_path):
    folder = tmp_path / "ckpt"
    me, warning = lock.acquire(str(folder))  # created with the folder
    assert warning is None and lock.Holder.from_text((folder / lock.LOCK).read_text()) == me
    other = lock.Holder(HOST, os.getpid(), "2026-12-03T10:00:00", me.proc_start)  # a second run: this process
    with pytest.raises(lock.SaveLockError, match=re.escape(f"--save {folder} is in use by another run (PID "
                                                           f"{os.getpid()} on host {HOST}, started {me.started}")):
        lock.acquire(str(folder), me=other)
    with pytest.raises(lock.SaveLockError):  # --force-save-lock does not take a live lock of this host
        lock.acquire(str(folder), force=True, me=other)
    lock.release(str(folder), other)  # not its lock: left alone
    assert (folder / lock.LOCK).exists()
    lock.release(str(folder), me)
    assert not (folder / lock.LOCK).exists()

    gone = lock.Holder(HOST, dead_pid(), "2026-12-01T08:00:00")
    write_lock(folder, gone)
    mine, warning = lock.acquire(str(folder))
    assert warning == (f"> warning: --save {folder}: took over the lock of a run that is gone (PID {gone.pid} on host "
                       f"{HOST}, started 2026-12-01T08:00:00)")
    assert lock.Holder.from_text((folder / lock.LOCK).read_text()) == mine
    assert sorted(p.name for p in folder.iterdir()) == [lock.LOCK]  # nothing left aside


def test_a_reused_pid_is_dead_and_another_hosts_lock_needs_the_flag(tmp_path):
    folder = tmp_path / "ckpt"
    reused = lock.Holder(HOST, os.getpid(), "2026-12-01T08:00:00", proc_start=1)  # this PID, another start time
    assert lock.holder_alive(reused, HOST) is False
    far = lock.Holder("another-host", os.getpid(), "2026-12-01T08:00:00")
    assert lock.holder_alive(far, HOST) is None
    write_lock(folder, far)
    with pytest.raises(lock.SaveLockError, match="locked by a run on another host .*give --force-save-lock"):
        lock.acquire(str(folder))
    _, warning = lock.acquire(str(folder), force=True)
    assert "took over the lock of a run on another host (PID" in warning and "by --force-save-lock" in warning


def test_an_unreadable_lock_needs_the_flag(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / lock.LOCK).write_text("")
    with pytest.raises(lock.SaveLockError, match="unreadable"):
        lock.acquire(str(folder))
    assert lock.acquire(str(folder), force=True)[1] == f"> warning: --save {folder}: took over an unreadable lock"


def test_a_take_over_that_lost_the_race_puts_the_winner_back(tmp_path):
    """Of two runs taking over one dead lock, the one that finds another's fresh lock in its hands restores it."""
    path = str(tmp_path / lock.LOCK)
    winner = lock.Holder(HOST, os.getpid(), "now")
    (tmp_path / lock.LOCK).write_text(winner.to_text())
    assert not lock._take_over(path, "the dead holder's text", lock.Holder(HOST, 1, "later"))
    assert (tmp_path / lock.LOCK).read_text() == winner.to_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock.LOCK]


def test_a_save_path_that_cannot_be_a_folder_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=f"--save {blocker / 'ckpt'}: cannot be a folder"):
        lock.acquire(str(blocker / "ckpt"))
    with pytest.raises(UserError, match=f"--save {blocker}: cannot be a folder"):
        lock.acquire(str(blocker))


def make_checkpoints(root, iterations, tracker):
    for i in iterations:
        (root / f"iter_{i:07d}").mkdir(parents=True)
        (root / f"iter_{i:07d}" / "common.pt").write_text(str(i))
    (root / "latest_checkpointed_iteration.txt").write_text(str(tracker))


def test_a_rollback_moves_the_newer_lineage_aside_and_prunes_its_own(tmp_path):
    """The issue's sequence: a run saved 2..30; --load DIR --ckpt-step 10 --save DIR --keep-checkpoints 2 saves 12
    and 14: the folder then holds 12 and 14 with the tracker at 14, and 16..30 wait in superseded/."""
    root = tmp_path / "ckpt"
    make_checkpoints(root, range(2, 31, 2), 30)
    line = lineage.set_aside(str(root), 10, stamp="t")
    aside = root / "superseded" / "t"
    assert line == (f"> --save {root}: this run continues from its iteration 10, so its checkpoints of iterations "
                    f"12, 14, 16, 18, 20, 22, ..., 30 (10 checkpoints) are another lineage: moved with the tracker to "
                    f"{aside} (nothing deleted; move them back to return to that lineage)")
    assert sorted(p.name for p in aside.iterdir()) == [f"iter_{i:07d}" for i in range(12, 31, 2)] + [
        "latest_checkpointed_iteration.txt"]
    assert (aside / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "10"
    lineage_now = [2, 4, 6, 8, 10]
    for saved in (12, 14):  # what save.py's pruning removes after each save of the rolled-back run
        lineage_now.append(saved)
        for old in lineage.to_prune(lineage_now, saved, 2):
            lineage_now.remove(old)
    assert lineage_now == [12, 14]
    assert lineage.to_prune([10, 12, 14, 30], 14, 2) == [10]  # a newer checkpoint is never pruned
    assert lineage.to_prune([2, 4], 4, None) == []
    assert lineage.set_aside(str(root), 10) is None  # nothing newer left


def test_a_fresh_run_in_a_used_folder_moves_all_of_it_aside(tmp_path):
    root = tmp_path / "ckpt"
    make_checkpoints(root, [0, 2, 4], 4)
    assert "this run does not continue from a checkpoint of this folder, so its checkpoints of iterations 0, 2, 4" \
        in lineage.set_aside(str(root), None, stamp="t")
    assert sorted(p.name for p in root.iterdir()) == ["superseded"]


def test_space_warning_and_write_failures(tmp_path, monkeypatch):
    gib = 2**30
    assert space.space_warning("d", gib, 2 * gib) is None
    assert space.space_warning("d", gib, gib) == ("> warning: --save d: 1.00 GiB free, only one checkpoint of about "
                                                  "1.00 GiB fits (a save needs room for the new checkpoint before "
                                                  "--keep-checkpoints removes old ones)")
    assert "not even one checkpoint" in space.space_warning("d", gib, gib // 2)
    full = OSError(errno.ENOSPC, "No space left on device")
    assert space.write_failure(full, str(tmp_path)) == "no space left on device"
    from torch.distributed.checkpoint.api import CheckpointException

    assert space.write_failure(CheckpointException("write", {1: (full, None)}), str(tmp_path)) == \
        "no space left on device"
    torch_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert space.write_failure(torch_writer, str(tmp_path)) is None  # room left: not a full disk
    monkeypatch.setattr(space, "free_bytes", lambda folder: 4096)
    assert space.write_failure(torch_writer, str(tmp_path)) == "no space left on device"
    assert space.write_failure(PermissionError(errno.EACCES, "Permission denied"), "d") == \
        "Permission denied (PermissionError)"
    assert space.write_failure(KeyError("a bug"), "d") is None


@pytest.mark.usefixtures("megatron_world")
def test_the_estimate_is_a_saved_checkpoints_size(tmp_path):
    """checkpoint_bytes (from the model's parameter counts) against the bytes a save of the same model writes, with
    all units trained and with the ViT frozen (no optimizer state for it): at least those, at most 10% more."""
    from megatron.training.checkpointing import checkpoint_bytes, save_checkpoint

    for flags in ([], ["--freeze-vit"]):
        folder = tmp_path / f"c{len(flags)}"
        plan, model, optimizer, scheduler = trainer_parts.build(flags + ["--save", str(folder)])
        for p in model[0].parameters():
            if p.requires_grad:
                p.main_grad.fill_(1e-3)
        optimizer.step()  # Adam's moments exist
        save_checkpoint(plan, 1, 16, model, optimizer, scheduler, NoData())
        written = sum(f.stat().st_size for f in (folder / "iter_0000001").iterdir())
        trains = plan.config.model.trainable.trains
        estimate = checkpoint_bytes(plan.model_spec, trains, bf16=False)
        assert 1.0 <= estimate / written < 1.1, (flags, estimate, written)  # never below: the warning comes early


FAULTS = {  # where a full disk strikes in a world of one: (the function replaced, what it raises)
    "common.pt": ("megatron.core.dist_checkpointing.strategies.common.TorchCommonSaveStrategy.save_common",
                  RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")),
    "shards": ("torch.distributed.checkpoint.FileSystemWriter.write_data",
               OSError(errno.ENOSPC, "No space left on device")),
    "metadata.json": ("megatron.core.dist_checkpointing.serialization.save_config",
                      OSError(errno.ENOSPC, "No space left on device")),
    "manifest": ("megatron.training.checkpointing.save.write_json", OSError(errno.ENOSPC, "No space left on device")),
}


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("where", list(FAULTS))
def test_a_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    from megatron.training.checkpointing import find_checkpoint, save_checkpoint

    folder = tmp_path / "ckpt"
    plan, model, optimizer, scheduler = trainer_parts.build(["--save", str(folder)])
    save_checkpoint(plan, 1, 16, model, optimizer, scheduler, NoData())
    target, error = FAULTS[where]

    def full(*a, **k):
        raise error

    monkeypatch.setattr(target, full)
    monkeypatch.setattr(space, "free_bytes", lambda folder: 0)  # the disk is full
    with pytest.raises(RunStopped) as e:
        save_checkpoint(plan, 2, 32, model, optimizer, scheduler, NoData())
    assert str(e.value) == (f"no space left on device: the checkpoint of iteration 2 could not be written to --save "
                            f"{folder} (rank 0; 0.0 MiB free there now); its partial folder {folder}/iter_0000002.tmp "
                            f"was removed; the checkpoint of iteration 1 (the tracker's) is intact: make room, or give "
                            f"another --save, and resume with --load {folder}")
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert find_checkpoint(str(folder)).iteration == 1  # checksums and all


@pytest.mark.usefixtures("megatron_world")
def test_a_bug_in_a_save_keeps_its_traceback(tmp_path, monkeypatch):
    from megatron.training.checkpointing import save_checkpoint

    plan, model, optimizer, scheduler = trainer_parts.build(["--save", str(tmp_path / "ckpt")])

    def bug(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr("torch.distributed.checkpoint.FileSystemWriter.write_data", bug)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="KeyError: 'a bug'"):  # PyTorch DCP's, raised on every rank
        save_checkpoint(plan, 1, 16, model, optimizer, scheduler, NoData())
    assert not (tmp_path / "ckpt" / "iter_0000001.tmp").exists()


@pytest.mark.slow
def test_two_ranks_agree_on_a_failed_save_a_held_lock_and_a_nan(tmp_path):
    """Under torchrun (2 ranks, DP 2): a full disk striking one rank at each step of a save (rank 0's common.pt,
    rank 1's shards, rank 0's metadata.json and manifest) stops both ranks with the same line, the previous
    checkpoint intact; a lock held by a live process stops both before any work; a NaN seen by rank 1 alone stops
    both at the same iteration."""
    from launch import benchlib

    env = benchlib.trainer_env()
    env["PYTHONPATH"] = HERE + os.pathsep + env["PYTHONPATH"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(benchlib.free_port()), os.path.join(HERE, "save_faults_worker.py"), str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    folder = tmp_path / "ckpt"
    for case, rank in (("common.pt", 0), ("shards", 1), ("metadata.json", 0), ("manifest", 0)):
        messages = [g[case] for g in got]
        assert messages[0] == messages[1], case
        assert messages[0].startswith("no space left on device: the checkpoint of iteration 2 could not be written to "
                                      f"--save {folder} (rank {rank}"), (case, messages[0])
        assert messages[0].endswith("the checkpoint of iteration 1 (the tracker's) is intact: make room, or give "
                                    f"another --save, and resume with --load {folder}"), (case, messages[0])
    assert [g["after"] for g in got] == [["iter_0000001", "latest_checkpointed_iteration.txt"]] * 2
    assert got[0]["lock"] == got[1]["lock"] and got[0]["lock"].startswith(f"SaveLockError: --save {tmp_path / 'held'} "
                                                                          "is in use by another run (PID")
    assert [g["nan"] for g in got] == ["NonFiniteError: iteration 7: NaN or Inf in the gradients: the run stops "
                                       "before this iteration's optimizer step"] * 2
