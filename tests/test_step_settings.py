"""benchmarks/step_settings.py: its table from a made-up record (hand-computed ratios, fractions and page
faults), its settings list and its report, without training anything."""

import pytest

from benchmarks import step_settings


def _run(setting, rate, faults, round_=0):
    return {"setting": setting, "round": round_, "images_per_second": rate, "minor_faults_per_step": faults,
            "train_gflop_per_image": 24.5}  # fmt: skip


def _record():
    return {
        "command": "python -m benchmarks.step_settings",
        "rounds": 2,
        "provenance": ["- Command (from the repository root): `python -m benchmarks.step_settings`"],
        "matmul": [{"float32": 350.0, "bfloat16": 700.0}, {"float32": 392.0, "bfloat16": 680.0}],
        "missing": {"tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
        "runs": [
            _run("default", 10.0, 80000), _run("jemalloc", 9.0, 120000), _run("xla", 2.5, 1000),
            _run("default", 12.0, 60000, 1), _run("jemalloc", 13.0, 100000, 1), _run("xla", 3.5, 3000, 1),
        ],
    }  # fmt: skip


@pytest.mark.unit
def test_rows_are_means_over_rounds_against_the_default():
    rows = {r["setting"]: r for r in step_settings.rows(_record())}
    assert list(rows) == ["default", "jemalloc", "xla"]  # SETTINGS' order, only what ran
    assert rows["default"]["mean"] == 11.0 and rows["default"]["ratio"] == 1.0
    assert rows["jemalloc"]["rates"] == [9.0, 13.0] and rows["jemalloc"]["ratio"] == pytest.approx(1.0)
    assert rows["xla"]["ratio"] == pytest.approx(3.0 / 11.0)
    # 11 images/s x 24.5 GFLOP / the best float32 matmul (392 GFLOP/s) = 0.6875.
    assert rows["default"]["fraction"] == pytest.approx(0.6875)
    assert rows["default"]["faults"] == 70000 and rows["xla"]["faults"] == 2000


@pytest.mark.unit
def test_report_names_each_setting_and_what_was_not_run(tmp_path):
    out = tmp_path / "step_settings.md"
    out.write_text(
        "old\n\n<!-- written by hand from here on: kept when the file is regenerated -->\nmy reading\n"
    )
    step_settings.report(_record(), str(out))
    text = out.read_text()
    assert "| default | nothing set | 11.00 (10.00, 12.00) | 1.00x | 0.69 | 70,000 |" in text
    assert "| xla | model.compile(jit_compile=True) | 3.00 (2.50, 3.50) | 0.27x | 0.19 | 2,000 |" in text
    assert "| tcmalloc | LD_PRELOAD=libtcmalloc_minimal.so.4 | not run: /usr/lib/x86_64-linux-gnu/" in text
    assert text.rstrip().endswith("my reading") and "old" not in text.split("|")[0]


@pytest.mark.unit
def test_settings_are_parsed_and_an_unknown_one_is_named():
    assert step_settings.parse_settings("xla,default") == ["xla", "default"]
    with pytest.raises(ValueError, match=r"\['mimalloc'\]: expected some of default, jemalloc"):
        step_settings.parse_settings("default,mimalloc")
    with pytest.raises(ValueError, match="expected some of"):
        step_settings.parse_settings("")
