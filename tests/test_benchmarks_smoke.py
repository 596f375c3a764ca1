"""The quick benchmarks run as their docstrings and results/README.md give them (`python -m benchmarks.X`;
its `main` in-process where it starts no process), with small arguments and their output in tmp_path,
never in results/; each check reads what was written."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from benchmarks import common, record_run, scaling, time_to_train
from tests.support import REPO


@pytest.mark.unit
def test_the_record_of_a_summary_from_another_machine(tmp_path):
    summary = {
        "run_name": "smoke", "git_sha": "abc", "date": "2026-12-01", "machine": "a CPU", "python": "3.11",
        "tensorflow": "2.21.0", "keras": "3.15.1", "horovod": "0.28.1", "world_size": 2,
        "global_batch_size": 4096, "per_rank_batch_size": 2048, "final_test_top1": 0.9244,
        "final_test_top5": 0.999, "images_per_second": 3000.4, "wall_time_s": 100.0,
        "plan": {"steps_per_epoch": 14, "total_steps": 14, "warmup_steps": 2, "peak_learning_rate": 20.0},
        "epochs": [{"epoch": 1, "loss": 0.5, "top1": 0.8, "test_top1": 0.9244, "test_top5": 0.999,
                    "learning_rate": 20.0, "images_per_second": 3000.4}],
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    record_run.write(tmp_path / "summary.json", tmp_path / "r.md", "make train")
    text = (tmp_path / "r.md").read_text()
    assert "- Command: `make train`" in text and "**Final test top-1 0.9244**" in text
    assert "| 1 | 0.5000 | 0.8000 | 0.9244 | 0.9990 | 20 | 3000 |" in text
    # Its CPU's identity and rate are not measured here, and the record says so.
    assert (f"- Machine: a CPU; CPU vendor, family and model {common.NOT_RECORDED}; tf.matmul rate "
            f"{common.NOT_RECORDED} (this record was written on another machine)") in text  # fmt: skip


@pytest.mark.horovod  # horovodrun
def test_record_run_trains_a_flagfile_afresh_and_measures_this_machine(tmp_path):
    # The committed records' way, on 1 rank: flags/smoke.flags (2 epochs of 3 updates) in a new run directory.
    args = ["--flagfile=flags/smoke.flags", "--np=1", f"--workdir={tmp_path}", f"--out={tmp_path / 's.md'}"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "benchmarks.record_run", *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = tmp_path.glob("smoke_reference_*")
    text = (tmp_path / "s.md").read_text()
    assert f"- Command: `python -m benchmarks.record_run {' '.join(args)}`" in text
    assert "- World size 1, global batch 32" in text and "\n| 2 | " in text and (run_dir / "run.png").exists()
    cpu = common.cpu()
    assert f"CPU: {cpu['vendor']} family {cpu['family']} model {cpu['model_number']} stepping " in text
    rate = re.search(r"tf\.matmul 4096\^2: (\d+) GFLOP/s float32, (\d+) bfloat16", text)
    assert rate and float(rate.group(1)) > 1 and float(rate.group(2)) > 1, text[:600]


@pytest.mark.horovod  # reads the committed results
def test_scaling_section_rewritten_and_the_reading_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "scaling.md"
    shutil.copy(os.path.join(REPO, "results", "scaling.md"), out)
    before = out.read_text()
    # A stale table inside the section goes; the hand-written text before its marker stays.
    out.write_text(before.replace("| none (float32) | 102 MB |", "| stale |", 1))
    scaling.main(["overlap_compression", "--report_only", f"--out={out}"])
    after = out.read_text()
    assert after == before and "| stale |" not in after
    reading, section = after.split("<!-- section: overlap_compression -->")
    assert re.search(r"\| fp16 \| 51 MB \| 0\.053 \| 967 MB/s \| 0\.75 \|", section)
    assert "Text outside the section markers is written by hand" in reading


@pytest.mark.horovod  # reads the committed results
def test_time_to_train_predicts_minutes(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    time_to_train.main([f"--out={tmp_path / 't.md'}"])
    text = (tmp_path / "t.md").read_text()
    assert "- Command (from the repository root): `python -m benchmarks.time_to_train --out=" in text
    minutes = [float(m) for m in re.findall(r"\| ([\d.]+) min \|", text)]
    assert minutes and all(m > 0 for m in minutes) and (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
