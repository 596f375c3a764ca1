"""results/models_throughput.md has one section per CPU, keyed by /proc/cpuinfo's identity
(benchmarks.common.cpu, benchmarks.benchmark_models.cpu_section / raw_name / report), never by the noisy
matmul rate."""

import hashlib
import json
import os

import pytest

from benchmarks import benchmark_models, common

FLAGS_ZEN4 = "fpu sse2 avx2 avx512f avx512_bf16 sha_ni"


def cpuinfo(model_name="AMD EPYC 9R14", vendor="AuthenticAMD", family="25", model="17", stepping="1",
            flags=FLAGS_ZEN4, mhz="2600.000"):  # fmt: skip
    """Two processors' blocks of a /proc/cpuinfo text, as Linux prints it (tab before the colon)."""
    block = (
        f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        f"model name\t: {model_name}\nstepping\t: {stepping}\ncpu MHz\t\t: {mhz}\nflags\t\t: {flags}\n"
        f"bogomips\t: {float(mhz) * 2:.2f}\n"
    )
    return block.format(n=0) + "\n" + block.format(n=1) + "\n"


def cpu_of(tmp_path, **fields):
    path = tmp_path / f"cpuinfo_{len(list(tmp_path.glob('cpuinfo_*')))}"
    path.write_text(cpuinfo(**fields))
    return common.cpu(str(path))


@pytest.mark.unit
def test_the_key_is_vendor_family_model_stepping_and_a_hash_of_the_flags(tmp_path):
    cpu = cpu_of(tmp_path)
    flag_hash = hashlib.sha256(" ".join(sorted(FLAGS_ZEN4.split())).encode()).hexdigest()[:8]
    assert cpu["key"] == f"AuthenticAMD family 25 model 17 stepping 1, flags {flag_hash}"
    identity = (cpu["vendor"], cpu["family"], cpu["model_number"], cpu["stepping"])
    assert identity == ("AuthenticAMD", "25", "17", "1")
    assert cpu["model"] == "AMD EPYC 9R14" and cpu["name"] == "AMD EPYC with AVX-512 BF16"
    assert cpu["flags"] == ["avx512f", "avx512_bf16"]
    assert benchmark_models.cpu_section(cpu) == f"AMD EPYC with AVX-512 BF16: AMD EPYC 9R14 ({cpu['key']})"
    # The order of the flags in the file and the clock (cpu MHz, bogomips) do not change the key.
    shuffled = cpu_of(tmp_path, flags=" ".join(reversed(FLAGS_ZEN4.split())), mhz="3700.000")
    assert shuffled["key"] == cpu["key"]


@pytest.mark.unit
def test_two_cpus_of_one_model_name_get_two_sections(tmp_path):
    base = cpu_of(tmp_path, model_name="AMD EPYC")
    others = [
        cpu_of(tmp_path, model_name="AMD EPYC", family="23", model="49"),  # a Zen 2 EPYC
        cpu_of(tmp_path, model_name="AMD EPYC", stepping="2"),
        cpu_of(tmp_path, model_name="AMD EPYC", flags=FLAGS_ZEN4.replace(" avx512_bf16", "")),
        cpu_of(tmp_path, model_name="AMD EPYC", flags=FLAGS_ZEN4 + " avx512_vnni"),  # not in CPU_FLAGS
    ]
    headings = {benchmark_models.cpu_section(c) for c in [base, *others]}
    files = {benchmark_models.raw_name(c, "resnet50") for c in [base, *others]}
    assert len(headings) == len(files) == 5


def record(cpu, model, images_per_second):
    """A benchmark_models record as `measure` writes it, with made-up figures: the baseline at
    `images_per_second` in float32 and twice that in mixed_bfloat16, ours 1.5x the baseline's."""
    runs = [{"kind": "matmul", "gflops": {"float32": 200.0, "bfloat16": 400.0, "size": 4096}}] * 2
    for kind, precision, rate in [
        ("keras", "float32", images_per_second),
        ("keras", "mixed_bfloat16", 2 * images_per_second),
        ("ours", "float32", 1.5 * images_per_second),
        ("ours", "mixed_bfloat16", 3 * images_per_second),
        ("keras", "float32", images_per_second),
        ("keras", "mixed_bfloat16", 2 * images_per_second),
    ]:
        runs.append({"kind": kind, "model": model, "precision": precision, "images_per_second": rate,
                     "step_s": [1.0, 1.1], "train_gflop_per_image": 24.5, "peak_rss_gib": 3.0})  # fmt: skip
    provenance = {"git_sha": "0" * 40, "date": "2026-12-01T00:00:00+00:00", "machine": "test",
                  "tensorflow": "2.21.0", "keras": "3.15.1"}  # fmt: skip
    return {"model": model, "command": "python -m benchmarks.benchmark_models", "provenance": provenance,
            "cpu": cpu, "wall_time_s": 1, "load_average": [0.5, 0.5, 0.5], "runs": runs}  # fmt: skip


def write(raw_dir, rec):
    """Where `measure` writes a record: one file per CPU and model."""
    (raw_dir / benchmark_models.raw_name(rec["cpu"], rec["model"])).write_text(json.dumps(rec))


@pytest.mark.unit
def test_a_rerun_on_one_cpu_replaces_only_its_own_section(tmp_path):
    raw, out = tmp_path / "throughput", tmp_path / "models_throughput.md"
    raw.mkdir()
    fast = cpu_of(tmp_path, model_name="AMD EPYC")
    slow = cpu_of(tmp_path, model_name="AMD EPYC", family="23", model="49")
    legacy = {"model": "AMD EPYC", "flags": ["avx512f"], "family": "AMD EPYC with AVX-512"}  # before the key
    write(raw, record(fast, "resnet50", 8.0))
    write(raw, record(slow, "resnet50", 4.0))
    (raw / "amd_epyc_with_avx_512_resnet50.json").write_text(json.dumps(record(legacy, "resnet50", 2.0)))
    benchmark_models.report(str(raw), str(out))
    before = benchmark_models.sections(out.read_text())
    fast_heading, slow_heading = benchmark_models.cpu_section(fast), benchmark_models.cpu_section(slow)
    legacy_heading = "AMD EPYC with AVX-512: AMD EPYC (identity not recorded)"
    assert sorted(before) == sorted([fast_heading, slow_heading, legacy_heading])
    assert "| 8.00 (8.00, 8.00) | 0.50x |" in before[fast_heading]  # float32 baseline / its bfloat16 16.00
    assert "| 4.00 (4.00, 4.00) | 0.50x |" in before[slow_heading]

    write(raw, record(fast, "resnet50", 10.0))  # the fast EPYC measured again
    benchmark_models.report(str(raw), str(out))
    after = benchmark_models.sections(out.read_text())
    assert sorted(after) == sorted(before)
    assert after[slow_heading] == before[slow_heading] and after[legacy_heading] == before[legacy_heading]
    assert "| 10.00 (10.00, 10.00) | 0.50x |" in after[fast_heading]
    assert "8.00" not in after[fast_heading]
    assert len(list(raw.glob("*.json"))) == 3


@pytest.mark.unit
def test_the_committed_file_has_one_section_per_cpu_of_the_raw_records():
    records = []
    for name in sorted(os.listdir(benchmark_models.RAW_DIR)):
        with open(os.path.join(benchmark_models.RAW_DIR, name)) as f:
            records.append(json.load(f))
    with open(benchmark_models.MARKDOWN) as f:
        headings = list(benchmark_models.sections(f.read()))
    assert sorted(headings) == sorted({benchmark_models.cpu_section(r["cpu"]) for r in records})
