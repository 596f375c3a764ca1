"""Time to train at the paper's scale: a step-time model built from this project's measurements.

    step time     = compute + max(0, allreduce - hidden)                                         (1)
    compute       = per-socket batch / per-socket images/s                                       (2)
    images/s of a target socket = images/s measured here x published peak of the target /
                    tf.matmul float32 GFLOP/s measured here                                      (3)
    allreduce     = m (alpha + 2 (p - 1) lambda) + 2 (p - 1) / p x n / B      (ring over p ranks)  (4)
    hidden        = overlap x backward time, backward time = 2/3 x compute                       (5)
    time to train = epochs x ceil(1,281,167 / global batch) x step time                          (6)

Inputs, all committed: (2)-(3) results/models_throughput/*.json; (4) n the float32 gradient bytes in
m = ceil(n / 128 MiB) fused messages, alpha and B fitted by `hosts_fit` to results/allreduce_hosts/
allreduce_hosts.json, lambda = LINK_LATENCY_S; (5) the overlapped runs of results/scaling/; (6) the paper's
updates per epoch. Why each input is taken as it is: docs/design.md, "The time-to-train model".

Usage (from the repository root; arithmetic on committed measurements, seconds):
    python -m benchmarks.time_to_train                      # results/time_to_train.md and .png
    python -m benchmarks.time_to_train --update_flagfiles   # and the paper flagfiles' Predicted:
"""

import dataclasses
import glob
import json
import math
import os
import re
import statistics
import textwrap

from benchmarks import common

REPO = common.REPO
RESULTS = common.RESULTS
MARKDOWN = os.path.join(RESULTS, "time_to_train.md")
PNG = os.path.join(RESULTS, "time_to_train.png")

IMAGENET_TRAIN_IMAGES = 1281167  # ILSVRC-2012 training set
# backward = input gradients + weight gradients, 2 of 3 passes (hvd_lars.models.flops)
BACKWARD_SHARE = 2.0 / 3.0
FUSION_BYTES = 128 * 2**20  # Horovod 0.28.1's default HOROVOD_FUSION_THRESHOLD (horovodrun --help)
SMALL_MESSAGES = (2**10, 2**16)  # alpha: the median time of these allreduce sizes
LARGE_MESSAGES = 2**20  # B: fitted to allreduces of at least this many bytes
HOSTS_JSON = "allreduce_hosts/allreduce_hosts.json"
COMMUNICATION_JSON = "communication/communication.json"
THROUGHPUT_GLOB = "models_throughput/*.json"
SCALING_GLOB = "scaling/overlap_compression_*.json"
HOSTS_VARIANT = "main"  # allreduce_hosts' variant with the settings hvd_lars.main runs with
# The CPU of the committed emulated-cluster runs (results/scaling/overlap_compression_*.json), on which
# the model is validated; its throughput records are the model's compute rates unless --cpu names another.
DEFAULT_CPU = "AMD EPYC"


@dataclasses.dataclass(frozen=True)
class Socket:
    """A CPU socket: its float32 peak is cores x GHz x FLOPs per cycle per core."""

    name: str
    cores: int
    ghz: float
    flops_per_cycle: int  # float32 FLOPs per cycle per core
    source: str

    @property
    def peak_gflops(self):
        return self.cores * self.ghz * self.flops_per_cycle


# Two AVX-512 FMA units per core: 2 units x 16 float32 lanes x 2 FLOPs (multiply and add) = 64 per cycle.
SOCKETS = {
    "xeon_platinum_8160": Socket(
        "Intel Xeon Platinum 8160",
        24,
        2.1,
        64,
        "Intel ARK, Xeon Platinum 8160: 24 cores, 2.10 GHz base, 2 AVX-512 FMA units per core",
    ),
    "xeon_phi_7250": Socket(
        "Intel Xeon Phi 7250",
        68,
        1.4,
        64,
        "Intel ARK, Xeon Phi 7250: 68 cores, 1.40 GHz base; Sodani et al., 'Knights Landing: Second-"
        "Generation Intel Xeon Phi Product', IEEE Micro 36(2), 2016: 2 AVX-512 vector units per core",
    ),
}
LINK_RATE_BITS = 100e9  # Intel Omni-Path, the paper's network (You et al. 2018)
# One hop's latency on Omni-Path: about 1 microsecond MPI latency for first-generation Omni-Path
# (Birrittella et al., 'Intel Omni-Path Architecture: Enabling Scalable, High Performance Fabrics', IEEE Hot
# Interconnects 2015). An assumption, not a measurement: the emulated links have no wire latency.
LINK_LATENCY_S = 1e-6
# The paper's runs (You et al. 2018, ICPP, tables of results): model, sockets, global batch, epochs ->
# (minutes, CPU).
PAPER = {
    ("alexnet_bn", 2048, 32768, 100): (11.0, "xeon_platinum_8160"),
    ("resnet50", 2048, 32768, 90): (20.0, "xeon_phi_7250"),
}


# ------------------------------------------------------------------------------------------- arithmetic


def updates_per_epoch(global_batch, images=IMAGENET_TRAIN_IMAGES):
    """Optimizer updates per epoch: ceil(images / global batch) (the paper's solvers: 40 at 32K)."""
    if global_batch < 1:
        raise ValueError(f"global batch {global_batch}: must be >= 1 image.")
    return math.ceil(images / global_batch)


def ring_allreduce_s(nbytes, ranks, alpha_s, bandwidth, hop_latency_s=0.0, fusion_bytes=FUSION_BYTES):
    """Eq. (4): seconds to average `nbytes` per rank over `ranks` ranks (0 for 1) with a ring allreduce:
    `alpha_s` per fused message of at most `fusion_bytes`, `bandwidth` bytes/s, `hop_latency_s` a step."""
    if ranks < 1 or nbytes < 0:
        raise ValueError(f"ring_allreduce_s: ranks={ranks}, nbytes={nbytes}; need ranks >= 1, nbytes >= 0.")
    if ranks == 1:
        return 0.0
    messages = max(1, math.ceil(nbytes / fusion_bytes))
    return (
        messages * (alpha_s + 2 * (ranks - 1) * hop_latency_s) + 2 * (ranks - 1) / ranks * nbytes / bandwidth
    )


def step_time_s(compute_s, allreduce_s, overlap=0.0):
    """Eq. (1) and (5): compute + the part of the allreduce not hidden behind the backward pass."""
    hidden = overlap * BACKWARD_SHARE * compute_s
    return compute_s + max(0.0, allreduce_s - hidden)


def overlap_from_measurement(step_s, compute_s, allreduce_s):
    """Inverse of `step_time_s`: the overlap share that makes eq. (1) give the measured step (clipped to
    [0, 1]): hidden = allreduce - (step - compute), overlap = hidden / backward time."""
    hidden = allreduce_s - (step_s - compute_s)
    return min(1.0, max(0.0, hidden / (BACKWARD_SHARE * compute_s)))


def scaled_images_per_second(rate_here, matmul_gflops_here, socket):
    """Eq. (3): images/s of a target socket from the rate here and the peaks."""
    return rate_here * socket.peak_gflops / matmul_gflops_here


def time_to_train_s(epochs, global_batch, step_s, images=IMAGENET_TRAIN_IMAGES):
    """Eq. (6), seconds."""
    return epochs * updates_per_epoch(global_batch, images) * step_s


def predict(
    rate_here, matmul_gflops_here, gradient_bytes, socket, sockets, global_batch, epochs, link, overlap
):
    """The model at one configuration; `link` is (alpha s, bandwidth bytes/s, hop latency s). Returns a
    dict: per_socket_batch, images_per_second_per_socket, compute_s, allreduce_s, step_s, time_to_train_s,
    efficiency (compute / step: the share of the step the sockets compute)."""
    if global_batch % sockets:
        raise ValueError(f"global batch {global_batch} does not divide over {sockets} sockets.")
    per_socket = global_batch // sockets
    rate = scaled_images_per_second(rate_here, matmul_gflops_here, socket)
    compute = per_socket / rate
    alpha, bandwidth, latency = link
    reduce = ring_allreduce_s(gradient_bytes, sockets, alpha, bandwidth, latency)
    step = step_time_s(compute, reduce, overlap)
    return {
        "per_socket_batch": per_socket,
        "images_per_second_per_socket": rate,
        "compute_s": compute,
        "allreduce_s": reduce,
        "step_s": step,
        "time_to_train_s": time_to_train_s(epochs, global_batch, step),
        "efficiency": compute / step,
    }


# ------------------------------------------------------------------------------------------ measurements


def link_fit(sweep):
    """(alpha s, bandwidth bytes/s) of one of COMMUNICATION_JSON's sweeps: the median of SMALL_MESSAGES,
    the fit to LARGE_MESSAGES and more."""
    sizes = sweep["sizes"]
    medians = [statistics.median(t) for t in sweep["times_s"]]
    alpha = statistics.median(
        m for s, m in zip(sizes, medians) if SMALL_MESSAGES[0] <= s <= SMALL_MESSAGES[1]
    )
    large = [(s, m) for s, m in zip(sizes, medians) if s >= LARGE_MESSAGES]
    _, bandwidth, _ = common.alpha_beta([s for s, _ in large], [m for _, m in large])
    return alpha, bandwidth


def hosts_fit(record, variant=HOSTS_VARIANT):
    """alpha and B of eq. (4) from allreduce_hosts.json's `variant` at layouts of 1 rank per host: alpha_s,
    the median SMALL_MESSAGES allreduce at the smallest p; bandwidth (bytes/s) and share (of link_bits), one
    fit of t = c_p + 2 (p - 1)/p x S / B to the LARGE_MESSAGES at every p (`common.ring_per_p`); per_p:
    {p: small_s, share fitted to that p alone, worst relative miss, n sizes}.

    Raises:
        ValueError: fewer than 2 p with 2 or more large sizes, no small message at the smallest p, or a
        non-positive fitted B.
    """
    import numpy as np

    link_bits = common.link_rate_bits(record["link_rate"])
    rows = [
        r for r in record["results"]
        if r["variant"] == variant and r["layout"] == f"{r['p']}x1" and r.get("median_s")
    ]  # fmt: skip
    large = [r for r in rows if r["size"] >= LARGE_MESSAGES]
    ps = sorted(p for p in {r["p"] for r in large} if sum(r["p"] == p for r in large) >= 2)
    if len(ps) < 2:
        raise ValueError(
            f"hosts_fit: variant {variant!r} has 2 or more allreduces of >= {LARGE_MESSAGES} B at p = {ps}; "
            "2 or more p needed"
        )
    large = [r for r in large if r["p"] in ps]
    lo, hi = SMALL_MESSAGES
    small = {p: [r["median_s"] for r in rows if r["p"] == p and lo <= r["size"] <= hi] for p in ps}
    if not small[ps[0]]:
        raise ValueError(
            f"hosts_fit: no allreduce of {SMALL_MESSAGES[0]}-{SMALL_MESSAGES[1]} B at p = {ps[0]}."
        )

    def fit(subset):
        columns = ([r["p"] for r in subset], [r["size"] for r in subset], [r["median_s"] for r in subset])
        return common.ring_per_p(*columns)

    _, inverse_b, residual = fit(large)
    at = np.array([r["p"] for r in large])
    per_p = {
        p: {
            "small_s": statistics.median(small[p]) if small[p] else None,
            "share": 8 / fit([r for r in large if r["p"] == p])[1] / link_bits,
            "worst": float(residual[at == p].max()),
            "n": int((at == p).sum()),
        }
        for p in ps
    }
    return {
        "alpha_s": statistics.median(small[ps[0]]), "bandwidth": 1 / inverse_b,
        "share": 8 / inverse_b / link_bits, "link_bits": link_bits, "per_p": per_p,
    }  # fmt: skip


def cpu_label(record):
    """A throughput record's CPU key (`common.cpu`), else (older records) its short name."""
    cpu = record.get("cpu", {})
    return cpu.get("key") or cpu.get("family") or cpu.get("model") or "unknown CPU"


def load_measurements(cpu=None):
    """Everything the model takes from results/, the throughput records of the CPU whose `cpu_label`
    contains `cpu` (None: the only CPU there is); ValueError, listing the CPUs, if that is not one CPU."""
    communication = common.read_json(os.path.join(RESULTS, COMMUNICATION_JSON))
    links = {
        k.split("|")[1]: link_fit(v)
        for k, v in communication.items()
        if k.startswith("sweep|") and "mpi" in k
    }
    throughput = {}
    records = []
    for path in sorted(glob.glob(os.path.join(RESULTS, THROUGHPUT_GLOB))):
        records.append((path, common.read_json(path)))
    labels = sorted({cpu_label(r) for _, r in records})
    if cpu is not None:
        records = [(p, r) for p, r in records if cpu in cpu_label(r)]
        if not records:
            raise ValueError(f"no throughput record of a CPU matching --cpu={cpu!r}; the CPUs: {labels}")
    elif len(labels) > 1:
        raise ValueError(
            f"results/{os.path.dirname(THROUGHPUT_GLOB)}/ holds records of {len(labels)} CPUs ({labels}): "
            "name one with --cpu (the model's compute rates must all come from one CPU)"
        )
    for path, record in records:
        rates = [r["gflops"] for r in record["runs"] if r["kind"] == "matmul"]
        ours = [r for r in record["runs"] if r["kind"] == "ours" and r["precision"] == "float32"]
        throughput[record["model"]] = {
            "images_per_second": statistics.mean(r["images_per_second"] for r in ours),
            "matmul_gflops": max(r["float32"] for r in rates),
            # The run's tf.matmul rates for its report line (the best of its start and end, as its own).
            "matmul": {d: max(r.get(d, 0.0) for r in rates) for d in ("float32", "bfloat16")},
            "gflop_per_image": ours[0]["train_gflop_per_image"],
            "cpu": record["cpu"],
            "source": os.path.relpath(path, REPO),
        }
    scaling = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, SCALING_GLOB))):
        record = common.read_json(path)
        scaling[record["label"]] = record
    hosts, hosts_error = None, f"no results/{HOSTS_JSON}"
    if os.path.exists(os.path.join(RESULTS, HOSTS_JSON)):
        with open(os.path.join(RESULTS, HOSTS_JSON)) as f:
            try:
                hosts = hosts_fit(json.load(f))
            except ValueError as e:  # only the predictions need it: `target_link` raises with this
                hosts_error = f"results/{HOSTS_JSON} gives no fit: {e}"
    return {"links": links, "throughput": throughput, "scaling": scaling, "hosts": hosts,
            "hosts_error": hosts_error}  # fmt: skip


def gradient_bytes(model_name):
    """float32 bytes of a model's trainable parameters (what one rank allreduces per update)."""
    from hvd_lars.models import get_model

    model = get_model(model_name)
    return 4 * sum(int(math.prod(v.shape)) for v in model.trainable_variables)


# ------------------------------------------------------------------------------------------ validation


def validate(measurements, grads):
    """Predicted against measured steps of the 2-host emulated cluster (results/scaling/): (rows, the
    overlap share calibrated on ResNet-50's overlapped run at 1 Gbit/s, None without it)."""
    rows, cases = [], []
    for label, record in sorted(measurements["scaling"].items()):
        if label not in measurements["links"]:
            continue  # the loopback run ("local") has no link fit
        alpha, bandwidth = measurements["links"][label]
        busy = record["compute_both_cores_busy"]["models"]
        for model, entry in record["ranks"]["models"].items():
            compute = statistics.mean(busy[model]["modes"]["compute"])
            reduce = ring_allreduce_s(grads[model], record["ranks"]["world_size"], alpha, bandwidth)
            for mode in ("grouped", "overlap"):
                cases.append((label, model, mode, compute, reduce, entry["modes"][mode]))
    overlap = None
    for label, model, mode, compute, reduce, steps in cases:
        measured = statistics.mean(steps)
        if (label, model, mode) == ("1gbit", "resnet50", "overlap"):
            overlap = overlap_from_measurement(measured, compute, reduce)
    for label, model, mode, compute, reduce, steps in cases:
        measured = statistics.mean(steps)
        share = 0.0 if mode == "grouped" else (overlap or 0.0)
        predicted = step_time_s(compute, reduce, share)
        rows.append(
            {
                "link": label, "model": model, "mode": mode, "compute_s": compute, "allreduce_s": reduce,
                "predicted_s": predicted, "measured_s": measured, "error": predicted / measured - 1,
                "calibration": (label, model, mode) == ("1gbit", "resnet50", "overlap"),
                "steps_s": sorted(steps),
            }
        )  # fmt: skip
    return rows, overlap


# ---------------------------------------------------------------------------------------------- report

MODEL_NAMES = {"alexnet_bn": "AlexNet-BN", "resnet50": "ResNet-50"}
# What to predict: (model, socket, epochs, [(sockets, global batch), ...]).
PREDICTIONS = [
    ("alexnet_bn", "xeon_platinum_8160", 100, [(1024, 32768), (2048, 32768)]),
    ("resnet50", "xeon_phi_7250", 90, [(2048, 8192), (2048, 16384), (2048, 32768)]),
]
# Paper flagfiles: name -> (model whose measurements apply, ranks, per-rank batch, socket).
FLAGFILES = {
    "alexnet_bn_bs32k": ("alexnet_bn", 2048, 16, "xeon_platinum_8160"),
    "alexnet_bn_bs512": ("alexnet_bn", 8, 64, "xeon_platinum_8160"),
    # Plain AlexNet has AlexNet-BN's convolutions and dense layers (its LRN costs are not counted).
    "alexnet_bs8k": ("alexnet_bn", 512, 16, "xeon_platinum_8160"),
    "resnet50_bs32k_lars": ("resnet50", 2048, 16, "xeon_phi_7250"),
    "resnet50_bs8k_momentum": ("resnet50", 256, 32, "xeon_phi_7250"),
}


def target_link(measurements):
    """(alpha, bandwidth, hop latency, share) of Omni-Path: alpha and the reached share of the link's rate
    from `hosts_fit`, applied to 100 Gbit/s, LINK_LATENCY_S per hop. ValueError (with `load_measurements`'
    reason) where results/allreduce_hosts/allreduce_hosts.json is missing or gives no fit."""
    if measurements.get("hosts") is None:
        raise ValueError(
            f"{measurements.get('hosts_error', f'no results/{HOSTS_JSON}')}: run python -m "
            "benchmarks.allreduce_hosts (as root) at 2 or more layouts of 1 rank per host"
        )
    alpha, share = measurements["hosts"]["alpha_s"], measurements["hosts"]["share"]
    return alpha, share * LINK_RATE_BITS / 8, LINK_LATENCY_S, share


def _predict(measurements, grads, overlap, model, socket_name, sockets, batch, epochs):
    """`predict` with this model's measured rates and Omni-Path's link (`target_link`)."""
    t = measurements["throughput"][model]
    link = target_link(measurements)[:3]
    socket = SOCKETS[socket_name]
    return predict(t["images_per_second"], t["matmul_gflops"], grads[model], socket, sockets, batch, epochs,
                   link, overlap)  # fmt: skip


def predictions(measurements, grads, overlap):
    rows = []
    for model, socket_name, epochs, configs in PREDICTIONS:
        for sockets, batch in configs:
            p = _predict(measurements, grads, overlap, model, socket_name, sockets, batch, epochs)
            paper = PAPER.get((model, sockets, batch, epochs))
            rows.append({"model": model, "socket": socket_name, "epochs": epochs, "sockets": sockets,
                         "global_batch": batch, "paper_minutes": paper and paper[0], **p})  # fmt: skip
    return rows


def _fmt_s(seconds):
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def plot(measurements, grads, overlap, png=PNG):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [2**k for k in range(4, 13)]
    fig, (ax_time, ax_eff) = plt.subplots(1, 2, figsize=(12, 4.5))
    for model, socket_name, epochs, _ in PREDICTIONS:
        label = f"{MODEL_NAMES[model]}, {epochs} epochs, batch 32K, {SOCKETS[socket_name].name}"
        ps = [_predict(measurements, grads, overlap, model, socket_name, n, 32768, epochs) for n in counts]
        line = ax_time.loglog(counts, [p["time_to_train_s"] / 60 for p in ps], marker="o", label=label)[0]
        ax_eff.semilogx(
            counts, [p["efficiency"] for p in ps], marker="o", color=line.get_color(), label=label
        )
        for (m, sockets, _, _), (minutes, s) in PAPER.items():
            if m == model and s == socket_name:
                ax_time.scatter([sockets], [minutes], marker="*", s=160, color=line.get_color(), zorder=5)
    ax_time.set_xlabel("sockets (1 rank each)")
    ax_time.set_ylabel("predicted time to train (minutes)")
    ax_time.set_title("Time to train (stars: the paper's runs)")
    ax_eff.set_xlabel("sockets (1 rank each)")
    ax_eff.set_ylabel("scaling efficiency = compute / step time")
    ax_eff.set_ylim(0, 1.05)
    ax_eff.set_title("Scaling efficiency at global batch 32K")
    for ax in (ax_time, ax_eff):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def flagfile_line(name, measurements, grads, overlap):
    """The `# Predicted:` header line of a paper flagfile (FLAGFILES), from its flags and the model."""
    model, ranks, per_rank, socket_name = FLAGFILES[name]
    with open(os.path.join(REPO, "flags", f"{name}.flags")) as f:
        text = f.read()
    batch = int(re.search(r"^--global_batch_size=(\d+)", text, re.M).group(1))
    epochs = float(re.search(r"^--epochs=([\d.]+)", text, re.M).group(1))
    if ranks * per_rank != batch:
        raise ValueError(f"{name}: {ranks} ranks x per-rank batch {per_rank} != global batch {batch}")
    p = _predict(measurements, grads, overlap, model, socket_name, ranks, batch, epochs)
    return (
        f"# Predicted: {ranks} ranks x per-rank batch {per_rank} x accumulation 1 = {batch}; on {ranks} "
        f"{SOCKETS[socket_name].name} sockets (1 rank each, 100 Gb/s Omni-Path) a step of "
        f"{_fmt_s(p['step_s'])} and {p['time_to_train_s'] / 60:.1f} minutes to train "
        f"(benchmarks/time_to_train.py; results/time_to_train.md says how and where it errs)."
    )


def update_flagfiles(measurements, grads, overlap):
    """Rewrites each paper flagfile's `# Predicted:` block (`flagfile_line`), just above its `# Expected:`."""
    for name in FLAGFILES:
        path = os.path.join(REPO, "flags", f"{name}.flags")
        with open(path) as f:
            text = re.sub(r"^# Predicted:.*\n(?:#           .*\n)*", "", f.read(), flags=re.M)
        line = flagfile_line(name, measurements, grads, overlap)
        new = textwrap.wrap(
            line, 110, subsequent_indent="#           ", break_on_hyphens=False, break_long_words=False
        )
        at = text.index("# Expected:")
        text = text[:at] + "\n".join(new) + "\n" + text[at:]
        with open(path, "w") as f:
            f.write(text)
        print(f"[time_to_train] {path}: {' '.join(new)}", flush=True)


def report(measurements, grads, rows, overlap, predicted, markdown=MARKDOWN, command=None):
    alpha, bandwidth, latency, share = target_link(measurements)
    command = command or common.command_line("time_to_train", [])
    lines = [
        "# Time to train at the paper's scale: a model from this project's measurements",
        "",
        f"- Command (from the repository root): `{command}` (arithmetic on the committed measurements, "
        "seconds; the model and its sources are in the script's docstring)",
        f"- Git SHA: {common.sha_text(common.git_sha())}; date (UTC): {common.now()}",
        "- Machine: the figures do not depend on the machine that computes them; the compute rates (eq. 3) "
        "are those of "
        + "; ".join(
            f"{MODEL_NAMES[m]} on {common.describe(t['cpu'], t['matmul'])} (`{t['source']}`)"
            for m, t in sorted(measurements["throughput"].items())
        ),
        f"- Inputs: `results/{THROUGHPUT_GLOB}` (benchmarks/benchmark_models.py), "
        f"`results/{COMMUNICATION_JSON}` (benchmarks/communication.py), `results/{SCALING_GLOB}` "
        f"(benchmarks/scaling.py), `results/{HOSTS_JSON}` (benchmarks/allreduce_hosts.py); each report "
        "(`results/models_throughput.md`, `results/communication.md`, `results/scaling.md`, "
        "`results/allreduce_hosts.md`) names the machine of its runs.",
        "",
        "## Inputs",
        "",
        "| model | float32 images/s here (all cores) | CPU | tf.matmul float32 here | fraction | GFLOP/image "
        "| gradient MB | " + " | ".join(f"images/s per {s.name}" for s in SOCKETS.values()) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(SOCKETS),
    ]
    for model, t in sorted(measurements["throughput"].items()):
        scaled = [
            scaled_images_per_second(t["images_per_second"], t["matmul_gflops"], s) for s in SOCKETS.values()
        ]
        lines.append(
            f"| {MODEL_NAMES[model]} | {t['images_per_second']:.2f} | {t['cpu']['model']} "
            f"({', '.join(t['cpu']['flags'])}) | {t['matmul_gflops']:.0f} GFLOP/s | "
            f"{t['images_per_second'] * t['gflop_per_image'] / t['matmul_gflops']:.2f} | "
            f"{t['gflop_per_image']:.1f} | {grads[model] / 1e6:.0f} | "
            + " | ".join(f"{x:.0f}" for x in scaled)
            + " |"
        )
    lines += [
        "",
        "Peaks (float32, base clock): "
        + "; ".join(f"{s.name} {s.peak_gflops:,.0f} GFLOP/s ({s.source})" for s in SOCKETS.values())
        + ".",
        "",
        "| link (2 emulated hosts, MPI) | alpha: median of 1-64 KiB allreduces | B: fit to 1-128 MiB |",
        "|---|---|---|",
    ]
    for label, (a, b) in sorted(measurements["links"].items()):
        lines.append(f"| {label} | {a * 1e3:.2f} ms | {b * 8 / 1e9:.2f} Gbit/s |")
    lines += [""] + hosts_section(measurements["hosts"])
    lines += [
        "",
        f"Omni-Path in the model: alpha {alpha * 1e3:.2f} ms per fused message (Horovod's cycle under the",
        f"main program's settings), B = {share:.2f} (the share of the link's rate reached at p = 2-8)",
        f"x 100 Gbit/s = {bandwidth * 8 / 1e9:.0f} Gbit/s, and",
        f"{latency * 1e6:.0f} us per ring step (2 (p - 1) steps per message).",
        "",
        "## Validation: the 2-host emulated cluster under shaped links",
        "",
    ]
    if not rows:
        lines += [f"No shaped-link run in `results/{SCALING_GLOB}`: the predictions use overlap 0.", ""]
    else:
        lines += [
            "1 rank per host, each on 1 core; compute = the same per-rank batch trained by one process per",
            "core with both cores busy, in the same run; allreduce = eq. (4) with the link's own fit, p = 2;",
            "predicted step = eq. (1). Grouped: no overlap, nothing fitted. Overlapped: the overlap share is",
            f"calibrated on ResNet-50 at 1 Gbit/s (marked), giving {overlap:.2f} of the backward time.",
            "",
            "| link | model | gradients | compute (s) | allreduce, predicted (s) | step predicted (s) "
            "| step measured (s) | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            mark = " (calibration)" if r["calibration"] else ""
            lines.append(
                f"| {r['link']} | {MODEL_NAMES[r['model']]} | {r['mode']}{mark} | {r['compute_s']:.3f} | "
                f"{r['allreduce_s']:.3f} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                f"{r['error']:+.0%} |"
            )
        worst = max((r for r in rows if not r["calibration"]), key=lambda r: abs(r["error"]))
        within = all(abs(r["error"]) <= 0.2 for r in rows)
        lines += [
            "",
            f"Largest miss: {worst['error']:+.0%} ({worst['link']}, {MODEL_NAMES[worst['model']]}, "
            f"{worst['mode']}); "
            + ("every prediction is within 20%." if within else "not all within 20%: below."),
            "",
        ]
        for r in rows:
            if abs(r["error"]) <= 0.2:
                continue
            steps = r["steps_s"]
            near = [t for t in steps if abs(r["predicted_s"] / t - 1) <= 0.2]
            lines += [
                f"- {r['link']}, {MODEL_NAMES[r['model']]}, {r['mode']}: the {len(steps)} measured steps: "
                + ", ".join(f"{t:.2f}" for t in steps)
                + f" s; {len(near)} of them lie within 20% of the predicted {r['predicted_s']:.2f} s, the "
                f"others are up to {steps[-1] - r['predicted_s']:.1f} s slower.",
            ]
        if not within:
            lines.append("")
    lines += [
        "## Predictions at the paper's scale (float32, 1 rank per socket, 100 Gb/s Omni-Path)",
        "",
        "| model | CPU | sockets | global batch | per-socket batch | images/s per socket | compute "
        "| allreduce | step | efficiency | time to train | the paper |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in predicted:
        paper = f"{p['paper_minutes']:.0f} min" if p["paper_minutes"] else ""
        lines.append(
            f"| {MODEL_NAMES[p['model']]}, {p['epochs']} epochs | {SOCKETS[p['socket']].name} | "
            f"{p['sockets']:,} | {p['global_batch']:,} | {p['per_socket_batch']} | "
            f"{p['images_per_second_per_socket']:.0f} | "
            f"{_fmt_s(p['compute_s'])} | {_fmt_s(p['allreduce_s'])} | {_fmt_s(p['step_s'])} | "
            f"{p['efficiency']:.2f} | {p['time_to_train_s'] / 60:.1f} min | {paper} |"
        )
    lines += ["", "![predicted time to train and scaling efficiency](time_to_train.png)", ""]
    lines += disagreement(measurements, predicted)
    common.write_report(markdown, "\n".join(lines).rstrip())
    print(f"[time_to_train] wrote {markdown}", flush=True)


def hosts_section(hosts):
    """The report's lines on the allreduce against p: `hosts_fit`'s figures, per p and jointly."""
    ps = sorted(hosts["per_p"])
    lines = [
        f"## The allreduce at p = {', '.join(map(str, ps))} emulated hosts",
        "",
        f"`results/{HOSTS_JSON}`, the settings hvd_lars.main runs with (variant `{HOSTS_VARIANT}`), 1 rank",
        f"per host, links shaped to {hosts['link_bits'] / 1e6:.0f} Mbit/s. B: one fit of "
        f"t = c_p + 2 (p - 1)/p x S / B to the allreduces of {LARGE_MESSAGES // 2**20} MiB and",
        f"more at every p (a latency c_p per p), **{hosts['share']:.2f} of the link's rate**; beside it the "
        "same form fitted to each p alone. alpha:",
        f"the median of the {SMALL_MESSAGES[0] // 2**10}-{SMALL_MESSAGES[1] // 2**10} KiB allreduces at "
        f"p = {ps[0]}, **{hosts['alpha_s'] * 1e3:.2f} ms**.",
        "",
        f"| p | median {SMALL_MESSAGES[0] // 2**10}-{SMALL_MESSAGES[1] // 2**10} KiB allreduce "
        "| B / link rate, this p alone | the joint B's largest miss at this p |",
        "|---|---|---|---|",
    ]
    for p in ps:
        f = hosts["per_p"][p]
        small = f"{f['small_s'] * 1e3:.1f} ms" if f["small_s"] is not None else "-"
        lines.append(f"| {p} | {small} | {f['share']:.2f} | {f['worst']:.0%} ({f['n']} sizes) |")
    return lines


def disagreement(measurements, predicted):
    """Paragraphs comparing the model with the paper's two runs, with the figures that decide it."""
    lines = ["## Model against paper", ""]
    for p in predicted:
        if not p["paper_minutes"]:
            continue
        updates = p["epochs"] * updates_per_epoch(p["global_batch"])
        paper_step = p["paper_minutes"] * 60 / updates
        # If the paper's step had been all compute, each socket trained this many images per second.
        paper_rate = p["per_socket_batch"] / paper_step
        t = measurements["throughput"][p["model"]]
        paper_fraction = paper_rate * t["gflop_per_image"] / SOCKETS[p["socket"]].peak_gflops
        lines.append(
            f"- {MODEL_NAMES[p['model']]} on {p['sockets']:,} {SOCKETS[p['socket']].name}: the paper's "
            f"{p['paper_minutes']:.0f} minutes are {updates:,} updates of {paper_step * 1e3:.0f} ms, i.e. at "
            f"least {paper_rate:.0f} images/s per socket ({paper_fraction:.0%} of its float32 peak at this "
            f"model's {t['gflop_per_image']:.1f} GFLOP per image); the model predicts "
            f"{p['images_per_second_per_socket']:.0f} images/s per socket and a step of "
            f"{_fmt_s(p['step_s'])} ({_fmt_s(p['compute_s'])} compute, {_fmt_s(p['allreduce_s'])} "
            "allreduce), "
            f"{p['time_to_train_s'] / 60:.1f} minutes: {p['time_to_train_s'] / 60 / p['paper_minutes']:.2f}x "
            "the paper."
        )
    return lines


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument(
        "--update_flagfiles", action="store_true", help="rewrite the paper flagfiles' Predicted:"
    )
    parser.add_argument("--out", default=MARKDOWN, help="the report; the plot goes beside it (.png)")
    parser.add_argument(
        "--cpu",
        default=DEFAULT_CPU,
        help="the CPU whose throughput records to use (text of its label); default: the CPU of the "
        "committed emulated-cluster records (results/scaling/), so that one CPU's rates go into the model",
    )
    args = parser.parse_args(argv)
    try:
        measurements = load_measurements(args.cpu)
    except ValueError as e:
        parser.error(str(e))
    missing = [m for m in MODEL_NAMES if m not in measurements["throughput"]]
    if missing:
        raise SystemExit(
            f"results/{os.path.dirname(THROUGHPUT_GLOB)}/ has no measurement of {missing}: "
            "run python -m benchmarks.benchmark_models first"
        )
    try:
        target_link(measurements)
    except ValueError as e:
        parser.error(str(e))
    grads = {m: gradient_bytes(m) for m in MODEL_NAMES}
    rows, overlap = validate(measurements, grads)
    overlap = overlap or 0.0
    predicted = predictions(measurements, grads, overlap)
    plot(measurements, grads, overlap, os.path.splitext(args.out)[0] + ".png")
    command = common.command_line("time_to_train", argv)
    report(measurements, grads, rows, overlap, predicted, args.out, command)
    if args.update_flagfiles:
        update_flagfiles(measurements, grads, overlap)


if __name__ == "__main__":
    main()
