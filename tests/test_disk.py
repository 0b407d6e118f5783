"""forgetrain.disk: the estimate of a run's outputs against a real run's files, the refusal before anything is
written, and the one-line error when the final weights cannot be written after the last step (a full disk)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from forgetrain import disk
from forgetrain.config import TrainConfig
from forgetrain.errors import ConfigError, ForgeTrainError


def _t(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": 10, "save_interval": 4, **kw})


def test_saves_follow_the_loop_rule():
    assert disk.saves(_t()) == 3  # steps 4, 8 and the last (10)
    assert disk.saves(_t(steps=8)) == 2  # 4, 8: the last step is one of them
    assert disk.saves(_t(save_interval=0)) == 1  # only at the end
    assert disk.saves(_t(save=False)) == 0
    assert disk.saves(_t(stop_after=5)) == 2  # 4 and the stop step 5
    assert disk.saves(_t(), done=8) == 1  # a resume from step 8: the last one only
    assert disk.saves(_t(), done=10) == 0


def _cfg(tmp_path, **train):
    from tests.helpers import ladder_cfg

    c = ladder_cfg()
    return dataclasses.replace(c, train=dataclasses.replace(
        c.train, **{"sample_tokens": 0, "eval_interval": 0, "lr_warmup_steps": 1, "out_dir": str(tmp_path / "run"), **train}))


def test_estimate_matches_a_real_run(tmp_path):
    """The formulas against the files a run writes: final.safetensors is 4 bytes per parameter plus its header,
    each checkpoint 12 bytes per parameter plus DCP's metadata (112 KB here, under
    1 MiB; the 256 MiB reserve covers it); steps 2 with a save every step keeps
    both checkpoints, so the peak is 2 of them."""
    from forgetrain.train import train

    c = _cfg(tmp_path, steps=2, save_interval=1)
    need = disk.estimate_bytes(c)
    out = train(c, progress=False)
    final = (out / "trace" / "final.safetensors").stat().st_size
    assert need["final_weights"] <= final <= need["final_weights"] * 1.01
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert len(ckpts) == 2
    sizes = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in ckpts]
    per = need["checkpoints"] / 2
    assert all(per <= s <= per + (1 << 20) for s in sizes), (sizes, per)  # DCP's metadata: well inside the reserve


def test_refused_before_anything_is_written(tmp_path, monkeypatch):
    from forgetrain.train import train

    c = _cfg(tmp_path, steps=2, save=False)
    need = disk.estimate_bytes(c)["final_weights"]
    monkeypatch.setattr(disk, "free_bytes", lambda p: disk.RESERVE_BYTES + need - 1)
    with pytest.raises(ConfigError) as e:
        train(c, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "final weights" in msg and "train.final_params=false" in msg, msg
    assert not (tmp_path / "run").exists()
    # the remedy the line names works: no final weights, nothing to refuse
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, final_params=False))
    out = train(c, progress=False)
    assert (out / "trace" / "trace.jsonl").is_file() and not (out / "trace" / "final.safetensors").exists()


def test_free_space_counts_a_resumes_existing_checkpoints(tmp_path):
    c = _cfg(tmp_path, steps=10, save_interval=2, final_params=False)
    fresh = disk.estimate_bytes(c)["checkpoints"]
    per = fresh // 3  # KEEP + 1 = 3 at once
    assert disk.estimate_bytes(c, existing_checkpoints=2, done=4)["checkpoints"] == per  # 3 at once, 2 there


def test_full_disk_at_the_final_weights_is_one_line(tmp_path, monkeypatch):
    """The disk fills after the last step: one line naming the file and the last checkpoint, no temp file, no
    partial final.safetensors, the trace and the checkpoint intact."""
    import safetensors.torch

    from forgetrain.train import train

    def full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)  # part of it landed
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    c = _cfg(tmp_path, steps=2, save_interval=2)
    with pytest.raises(ForgeTrainError) as e:
        train(c, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and "step_000002" in msg, msg
    trace = tmp_path / "run" / "trace"
    assert sorted(os.listdir(trace)) == ["meta.json", "trace.jsonl"]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_overwrite_counts_the_space_it_frees(tmp_path, monkeypatch):
    """train.overwrite clears the previous run's checkpoints and export first: a disk that holds the old run and
    has room for the new one only once the old one is gone is not refused."""
    from forgetrain.train import train

    c = _cfg(tmp_path, steps=2, save_interval=2)
    out = train(c, progress=False)
    old = sum(f.stat().st_size for d in (out / "checkpoints", out / "trace") for f in d.rglob("*") if f.is_file())
    need = sum(disk.estimate_bytes(c).values())
    assert old >= need  # the same run again: the old files are as large as the new ones
    monkeypatch.setattr(disk, "free_bytes", lambda p: disk.RESERVE_BYTES + need - old + 1)
    train(dataclasses.replace(c, train=dataclasses.replace(c.train, overwrite=True)), progress=False)
    with pytest.raises(ConfigError, match="checkpoints"):  # without overwrite's freed bytes it would not fit
        disk.check(c, out)


def test_the_hint_names_only_remedies_that_help(tmp_path, monkeypatch):
    """One save (at the end): a larger save_interval cannot help, so the line does not suggest it."""
    monkeypatch.setattr(disk, "free_bytes", lambda p: 0)
    with pytest.raises(ConfigError) as e:
        disk.check(_cfg(tmp_path, steps=2, save_interval=0), tmp_path)
    assert "train.save=false)" in str(e.value) and "save_interval" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        disk.check(_cfg(tmp_path, steps=4, save_interval=1), tmp_path)
    assert "a larger train.save_interval" in str(e.value)


def test_resume_counts_the_save_that_lands_before_the_prune(tmp_path):
    """Two checkpoints on disk and one save to come: the directory holds three before the oldest is pruned, so the
    resume adds one checkpoint's bytes (it counted none, and with no export it skipped the check)."""
    c = _cfg(tmp_path, steps=10, save_interval=2, final_params=False)
    per = disk.estimate_bytes(c)["checkpoints"] // 3
    assert disk.estimate_bytes(c, existing_checkpoints=2, done=8)["checkpoints"] == per  # one save left
    assert disk.estimate_bytes(c, existing_checkpoints=2, done=4)["checkpoints"] == per  # three left: still 3 at once
    assert disk.estimate_bytes(c, existing_checkpoints=1, done=8)["checkpoints"] == per
    assert disk.estimate_bytes(c, existing_checkpoints=0, done=4)["checkpoints"] == 3 * per
    assert disk.estimate_bytes(c, existing_checkpoints=2, done=10)["checkpoints"] == 0  # nothing left to save


def test_a_killed_writes_temp_file_is_counted_and_removed(tmp_path, monkeypatch):
    """A run killed while it wrote the export leaves trace/.final.safetensors.*.tmp (32 GB for an 8B model): the
    resume counts it as space it frees and the trace writer deletes it."""
    from forgetrain.train import train

    c = _cfg(tmp_path, steps=4, save_interval=2, stop_after=2)
    out = train(c, progress=False)
    stale = out / "trace" / ".final.safetensors.abc123.tmp"
    stale.write_bytes(b"\0" * 3_000_000)
    r = dataclasses.replace(c, train=dataclasses.replace(c.train, stop_after=None, resume=True))
    need = sum(disk.estimate_bytes(r, existing_checkpoints=1, done=2).values())
    monkeypatch.setattr(disk, "free_bytes", lambda p: disk.RESERVE_BYTES + need - stale.stat().st_size + 1)
    train(r, progress=False)
    assert not stale.exists() and (out / "trace" / "final.safetensors").is_file()


def test_a_full_disk_anywhere_is_one_line(tmp_path):
    """ENOSPC outside the export and the checkpoints (a trace flush, Hydra's record) ends in one line, exit 1, no
    traceback (a stand-in task raises it); another OSError is not disguised as a full disk."""
    from tests.helpers import stand_in_task

    p = stand_in_task("raise OSError(errno.ENOSPC, 'No space left on device', '/x/trace/.trace.jsonl.ab.tmp')",
                      tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errs = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert errs == ["error: No space left on device writing /x/trace/.trace.jsonl.ab.tmp; the files written before "
                    "it and the last checkpoint (if any) are intact: free space, then run the same command with "
                    "train.resume=true"], p.stderr
    from forgetrain.errors import full_disk_line
    import errno

    assert full_disk_line(OSError(errno.EACCES, "Permission denied", "/x")) is None
