"""The quick benchmarks run as their docstrings and results/README.md give them (`python -m benchmarks.X`),
with small arguments and their output in tmp_path, never in results/; each check reads what was written."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from benchmarks import common
from hvd_lars.training import epoch_logs
from tests.support import REPO

pytestmark = pytest.mark.horovod  # subprocesses; record_run starts 2 Horovod ranks


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _machine(text):
    """The machine line names this CPU's identity and a tf.matmul rate measured in the run."""
    cpu = common.cpu()
    assert f"CPU: {cpu['vendor']} family {cpu['family']} model {cpu['model_number']} stepping " in text
    rate = re.search(r"tf\.matmul 4096\^2: (\d+) GFLOP/s float32, (\d+) bfloat16", text)
    assert rate and float(rate.group(1)) > 1 and float(rate.group(2)) > 1, text[:600]


@pytest.mark.horovod
def test_record_run_writes_the_runs_table(tmp_path):
    epoch = {"epoch": 1, "loss": 0.5, "top1": 0.8, "test_top1": 0.9244, "test_top5": 0.999}
    summary = {
        "run_name": "smoke", "git_sha": "abc", "date": "2026-12-01", "machine": "a CPU", "python": "3.11",
        "tensorflow": "2.21.0", "keras": "3.15.1", "horovod": "0.28.1", "world_size": 2,
        "global_batch_size": 4096, "per_rank_batch_size": 2048, "final_test_top1": 0.9244,
        "final_test_top5": 0.999, "images_per_second": 3000.4, "wall_time_s": 100.0,
        "plan": {"steps_per_epoch": 14, "total_steps": 14, "warmup_steps": 2, "peak_learning_rate": 20.0},
        "epochs": [{**epoch, "learning_rate": 20.0, "images_per_second": 3000.4}],
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "record.md"

    def record():
        _run(
            "benchmarks.record_run",
            f"--summary={tmp_path / 'summary.json'}",
            f"--out={out}",
            "--command=make train",
        )
        return out.read_text()

    text = record()
    assert "- Command: `make train`" in text and "**Final test top-1 0.9244**" in text
    assert "| 1 | 0.5000 | 0.8000 | 0.9244 | 0.9990 | 20 | 3000 |" in text
    # A summary from another machine: its CPU's identity and rate are not measured here, and the record
    # says so.
    assert (
        f"- Machine: a CPU; CPU vendor, family and model {common.NOT_RECORDED}; tf.matmul rate "
        f"{common.NOT_RECORDED} (this record was written on another machine)"
    ) in text
    # A summary of this machine (make train runs record_run where it trained): both, measured here.
    summary["machine"] = epoch_logs.machine()
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text = record()
    assert f"- Machine: {epoch_logs.machine()}; CPU: " in text
    _machine(text)


@pytest.mark.horovod
def test_record_run_trains_a_flagfile_afresh_for_its_reference_record(tmp_path):
    # The committed records' way: 2 ranks of flags/smoke.flags (6 updates) in a new run directory.
    out = tmp_path / "smoke.md"
    args = ["--flagfile=flags/smoke.flags", f"--workdir={tmp_path}", f"--out={out}"]
    _run("benchmarks.record_run", *args)
    (run_dir,) = tmp_path.glob("smoke_reference_*")
    text = out.read_text()
    assert f"- Command: `python -m benchmarks.record_run {' '.join(args)}`" in text
    assert "| 2 | " in text and (run_dir / "run.png").exists()
    _machine(text)


@pytest.mark.horovod
def test_benchmark_models_report_has_a_section_per_cpu(tmp_path):
    out = tmp_path / "models_throughput.md"
    _run("benchmarks.benchmark_models", "--report_only", f"--out={out}")
    text = out.read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections and all(":" in s for s in sections), sections  # "<name>: <model> (<identity>)"
    ratios = [float(r) for r in re.findall(r"\| (\d+\.\d\d)x \|", text)]
    # Each table's baseline in its best precision is 1.00x by definition; the others are measured.
    assert ratios.count(1.0) >= len(sections) and all(r > 0 for r in ratios)


@pytest.mark.horovod
def test_scaling_section_rewritten_and_the_reading_kept(tmp_path):
    out = tmp_path / "scaling.md"
    shutil.copy(os.path.join(REPO, "results", "scaling.md"), out)
    before = out.read_text()
    # A stale table inside the section goes; the hand-written text before its marker stays.
    out.write_text(before.replace("| none (float32) | 102 MB |", "| stale |", 1))
    _run("benchmarks.scaling", "overlap_compression", "--report_only", f"--out={out}")
    after = out.read_text()
    assert after == before and "| stale |" not in after
    reading, section = after.split("<!-- section: overlap_compression -->")
    assert re.search(r"\| fp16 \| 51 MB \| 0\.053 \| 967 MB/s \| 0\.75 \|", section)
    assert "Text outside the section markers is written by hand" in reading


@pytest.mark.horovod
def test_time_to_train_predicts_minutes(tmp_path):
    out = tmp_path / "time_to_train.md"
    _run("benchmarks.time_to_train", f"--out={out}")
    text = out.read_text()
    assert "- Command (from the repository root): `python -m benchmarks.time_to_train --out=" in text
    minutes = [float(m) for m in re.findall(r"\| ([\d.]+) min \|", text)]
    assert minutes and all(m > 0 for m in minutes)
    assert (tmp_path / "time_to_train.png").read_bytes()[:4] == b"\x89PNG"
