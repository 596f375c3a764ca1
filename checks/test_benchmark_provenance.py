"""What a benchmark's report says of its run (benchmarks.common): the CPU's identity and the tf.matmul rate
of that run, what an older record did not keep said to be not recorded, and where the raw data goes."""

import os

import pytest

from benchmarks import common

CPU = {"model": "AMD EPYC", "vendor": "AuthenticAMD", "family": "26", "model_number": "2", "stepping": "1",
       "flags": ["avx512f", "avx512_bf16"], "name": "AMD EPYC with AVX-512 BF16", "key": "k"}  # fmt: skip
MATMUL = {"float32": 404.4, "bfloat16": 725.9, "size": 4096}
HOST = "AMD EPYC, 2 logical cores, 24 GiB, Linux 6.18"
NOT = common.NOT_RECORDED


@pytest.mark.unit
def test_a_run_is_described_by_its_cpu_identity_and_matmul_rate():
    assert common.describe(CPU, MATMUL, HOST) == (
        f"{HOST}; CPU: AuthenticAMD family 26 model 2 stepping 1; CPU flags: avx512f, avx512_bf16; "
        "tf.matmul 4096^2: 404 GFLOP/s float32, 726 bfloat16"
    )
    assert common.describe(CPU, MATMUL).startswith("AMD EPYC; CPU: AuthenticAMD family 26 model 2 ")


@pytest.mark.unit
@pytest.mark.parametrize(
    "cpu, matmul, described",
    [
        # A throughput record made before the identity was kept: model name and flags only.
        ({"model": "AMD EPYC", "flags": ["avx512f"], "family": "AMD EPYC with AVX-512 BF16"}, None,
         f"AMD EPYC; CPU flags: avx512f; CPU vendor, family and model {NOT}; tf.matmul rate {NOT}"),
        # The string benchmarks kept before (common.cpu_line), and a rate without its size.
        ("AMD EPYC; bf16/AMX flags: avx512_bf16", {"float32": 217.2, "bfloat16": 390.1},
         f"AMD EPYC; bf16/AMX flags: avx512_bf16; CPU vendor, family and model {NOT}; tf.matmul: 217 GFLOP/s "
         "float32, 390 bfloat16"),
    ],
)  # fmt: skip
def test_what_an_older_record_did_not_keep_is_said_not_filled_in(cpu, matmul, described):
    assert common.describe(cpu, matmul) == described


@pytest.mark.unit
def test_this_machine_is_named_only_with_a_rate_measured_in_the_run():
    for missing in (None, {}):
        with pytest.raises(ValueError, match=r"machine: matmul=.*; pass this run's common.matmul_rate\(\)"):
            common.machine(missing)
    line = common.machine(MATMUL)
    c = common.cpu()
    assert (
        f"; CPU: {c['vendor']} family {c['family']} model {c['model_number']} stepping {c['stepping']};"
        in line
    )
    assert line.endswith("; tf.matmul 4096^2: 404 GFLOP/s float32, 726 bfloat16")


@pytest.mark.unit
def test_a_dirty_sha_says_its_source_is_not_recorded():
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert common.sha_text(sha) == f"`{sha}`"
    assert (
        common.sha_text(sha + "-dirty")
        == f"`{sha}-dirty` (uncommitted changes when it ran: its exact source {NOT})"
    )


@pytest.mark.unit
def test_raw_data_goes_to_the_question_folder_of_a_top_report_and_beside_any_other(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", str(tmp_path / "results"))
    top = common.data_path(str(tmp_path / "results" / "communication.md"))
    assert top == str(tmp_path / "results" / "communication" / "communication.json") and os.path.isdir(
        os.path.dirname(top)
    )
    run = common.data_path(str(tmp_path / "results" / "communication" / "amd_epyc.md"))
    assert run == str(tmp_path / "results" / "communication" / "amd_epyc.json")
    assert common.data_path(str(tmp_path / "x.md")) == str(tmp_path / "x.json")
    monkeypatch.setattr(common, "git_sha", lambda: "0123456789abcdef0123456789abcdef01234567")  # no git here
    lines = common.provenance_lines("python -m benchmarks.communication", MATMUL, top)
    assert lines[1].startswith("- Git SHA: `0123456789abcdef0123456789abcdef01234567`; date (UTC): 20")
    assert lines[-1] == f"- Raw data: `{os.path.relpath(top, common.REPO)}`"


class _Product:
    """A product whose n-th call takes `times[n]` seconds on the worker's clock (time.perf_counter)."""

    def __init__(self, monkeypatch, times):
        self.times, self.calls, self.now = list(times), 0, 100.0
        monkeypatch.setattr("time.perf_counter", lambda: self.now)

    def __call__(self):
        self.now += self.times[self.calls]
        self.calls += 1


@pytest.mark.unit
@pytest.mark.parametrize(
    "times, repeats, calls, best",
    [
        ([0.9, 0.5, 0.4, 0.45, 0.7, 0.3], 5, 5, 0.4),  # warm-up, then timed calls until 2 s are spent
        ([0.2, 0.3, 0.25, 0.2, 0.3, 0.28], 5, 6, 0.2),  # fast: all 5 repeats within the budget
        ([3.5, 1.0], 5, 1, 3.5),  # a warm-up over the budget is the measurement
        ([1.0, 2.5, 1.0], 5, 2, 2.5),  # one timed call at least, the budget spent by it
        ([0.1, 0.3, 0.2], 2, 3, 0.2),  # never more than `repeats` timed calls
    ],
)
def test_matmul_products_timed_within_the_budget(monkeypatch, times, repeats, calls, best):
    product = _Product(monkeypatch, times)
    assert common._best_product_seconds(product, repeats, budget_s=2.0) == pytest.approx(best)
    assert product.calls == calls
