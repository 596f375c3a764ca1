"""The large-batch study's report: a Markdown file and a PNG plot made from the finished runs' records.

Called by `benchmarks.large_batch_study` after every run (so an interrupted study still has a report of
what is done); the records are `large_batch_study._record` dicts. The hand-written part of the report (from
`benchmarks.common.HAND_WRITTEN` on) is kept when the tables are rewritten.
"""

import datetime
import math
import os
import statistics

from benchmarks import common

# ImageNet-1k at the paper's largest batch, for perspective (You et al., ICPP 2018).
IMAGENET_TRAIN = 1_281_167
IMAGENET_BATCH = 32768
IMAGENET_EPOCHS = (90, 100)  # ResNet-50, AlexNet
# A difference in mean test top-1 smaller than this (or than the seeds' spread) is called "the same".
SAME_ACCURACY = 0.005


def chosen_scores(records):
    """{(arm, batch): [test top-1 of each seed of the chosen rate]}."""
    out = {}
    for r in records:
        if r["chosen"]:
            out.setdefault((r["arm"], r["batch"]), []).append(r["test_top1"])
    return out


def _summary(values):
    mean = statistics.fmean(values)
    return mean, min(values), max(values)


def _cell(values):
    if not values:
        return "pending"
    mean, low, high = _summary(values)
    spread = f" ({low:.4f}-{high:.4f})" if len(values) > 1 else ""
    return f"**{mean:.4f}**{spread}, n={len(values)}"


def _short(arm):
    return arm.label.split(" (")[0]


def findings(records, arms, batches):
    """Plain sentences: each arm at each batch against the best arm at the smallest batch, the arms
    against each other, and which batches bear out the paper's claim (LARS holds the accuracy that
    momentum SGD with linear scaling loses)."""
    scores = chosen_scores(records)
    smallest = min(batches)
    reference = [scores[(a, smallest)] for a in arms if (a, smallest) in scores]
    if len(reference) < len(arms):
        return [f"Not enough finished runs yet: the smallest batch ({smallest}) is the reference."]
    best_small = max(_summary(v)[0] for v in reference)
    sentences = [
        f"Reference: the better arm at the smallest batch ({smallest}) reaches {best_small:.4f} mean test "
        f'top-1; an arm "holds" at a batch when its mean is at most {100 * SAME_ACCURACY:.1f} points below.'
    ]
    verdicts = {}
    for batch in sorted(batches):
        if any((a, batch) not in scores for a in arms) or batch == smallest:
            continue
        means = {a: _summary(scores[(a, batch)]) for a in arms}
        holds = {a: best_small - means[a][0] <= SAME_ACCURACY for a in arms}
        parts = [
            f"{_short(arms[a])} {means[a][0]:.4f} "
            + ("(holds)" if holds[a] else f"(loses {100 * (best_small - means[a][0]):.1f} points)")
            for a in arms
        ]
        if {"lars", "momentum"} <= set(means):
            lars, momentum = means["lars"], means["momentum"]
            gap = lars[0] - momentum[0]
            overlap = lars[1] <= momentum[2] and momentum[1] <= lars[2]
            if abs(gap) <= SAME_ACCURACY or overlap:
                parts.append("the arms are within 0.5 points or within the seeds' spread of each other")
            else:
                parts.append(f"LARS is {'ahead' if gap > 0 else 'behind'} by {100 * abs(gap):.1f} points")
            verdicts[batch] = (holds["lars"], holds["momentum"])
        sentences.append(f"Batch {batch}: " + "; ".join(parts) + ".")
    if verdicts:
        groups = {
            (True, False): "LARS held the accuracy and momentum SGD lost it (the paper's claim) at",
            (True, True): "both held at",
            (False, False): "both lost accuracy at",
            (False, True): "momentum SGD held and LARS lost at",
        }
        said = [
            f"{text} {', '.join(str(b) for b in sorted(verdicts) if verdicts[b] == key)}"
            for key, text in groups.items()
            if key in verdicts.values()
        ]
        sentences.append("In short: " + "; ".join(said) + ".")
    return sentences


def why(args, train):
    """The paragraph on the batch range and epoch budget, from the study's arguments."""
    per_epoch = IMAGENET_TRAIN // IMAGENET_BATCH
    share = IMAGENET_BATCH / IMAGENET_TRAIN
    equivalent = share * train
    closest = min(args.batches, key=lambda b: abs(math.log(b / equivalent)))
    largest, smallest = max(args.batches), min(args.batches)
    return [
        f"The paper's largest batch, {IMAGENET_BATCH:,} on ImageNet's {IMAGENET_TRAIN:,} images, takes "
        f"{100 * share:.1f}% of the training set per update and still makes {per_epoch} updates per epoch, "
        f"{IMAGENET_EPOCHS[0] * per_epoch:,}-{IMAGENET_EPOCHS[1] * per_epoch:,} in a run. On {train:,} "
        f"training images the same share is a batch of about {equivalent:,.0f}. The batches here, "
        f"{smallest:,} to {largest:,}, span a factor {largest // smallest} (the paper went from 512 to 32K, "
        f"a factor 64): {closest:,} is the paper's largest batch by share of the data per update, and "
        f"{largest:,} goes a factor {largest / equivalent:.0f} past it, to see where the claim breaks. "
        f"Beyond that a run is a handful of updates (16K: {train // 16384} per epoch), which would test "
        "the update count and nothing else. The epoch budget is what about 3 hours of this 2-core machine "
        "allow for the whole grid with its sweeps and seeds (one process per run trains 2,500-2,800 "
        "images/s at every batch here, faster than 2 Horovod ranks on the same cores: "
        "`results/large_batch_throughput.md`). It leaves the largest batch "
        f"{max(1, round(train / largest)) * args.epochs} updates, far fewer than ImageNet's thousands, so "
        "at the largest batches the update count, not only the batch, is under test:",
    ]


def plot(records, arms, batches, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = chosen_scores(records)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, arm in arms.items():
        xs = [b for b in sorted(batches) if (name, b) in scores]
        if not xs:
            continue
        stats = [_summary(scores[(name, b)]) for b in xs]
        means = [100 * s[0] for s in stats]
        below = [100 * (s[0] - s[1]) for s in stats]
        above = [100 * (s[2] - s[0]) for s in stats]
        ax.errorbar(xs, means, yerr=[below, above], marker="o", capsize=4, label=arm.label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.set_xlabel("global batch (images per update)")
    ax.set_ylabel("test top-1 (%), mean and min-max over seeds")
    ax.set_title("Fashion-MNIST, small_cnn, same epochs: test top-1 vs global batch")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(args, records, attempts, arms):
    """Writes `args.report` (Markdown) and the PNG beside it (same name, .png)."""
    png = os.path.splitext(args.report)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    plot(records, {a: arms[a] for a in args.arms}, args.batches, png)
    cpu = common.cpu()
    shas = sorted({r["git_sha"] for r in records})
    train = args.max_train_examples or 60000 - args.validation_examples
    seconds = sum(a["seconds"] for a in attempts)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    used = {a: arms[a] for a in args.arms}
    lines = [
        "# Does LARS hold accuracy where momentum SGD loses it? (Fashion-MNIST, this machine)",
        "",
        f"- Command (from the repository root; the same command resumes): `{args.command}`",
        f"- Git SHA of the runs: {', '.join(f'`{s}`' for s in shas) or 'none yet'}; report written {now} "
        "(UTC)",
        f"- Machine: {cpu['model']}; bf16/AMX-related CPU flags: {', '.join(cpu['flags']) or 'none'} "
        "(irrelevant to the results: every run is float32)",
        f"- Wall time: {seconds / 3600:.2f} h over {len(attempts)} run attempts "
        f"({len(records)} runs finished; run processes from start to exit, including any time paused by "
        f"`bench` or shared with other work on the machine); runs: `{args.output_dir}`",
        "",
        "## Findings",
        "",
        *[f"- {s}" for s in findings(records, used, args.batches)],
        "",
        "Test top-1 of the chosen learning rate of each batch and arm (mean over seeds, min-max in "
        "brackets):",
        "",
        "| global batch | " + " | ".join(used[a].label for a in args.arms) + " |",
        "|---|" + "---|" * len(args.arms),
    ]
    scores = chosen_scores(records)
    for batch in sorted(args.batches):
        lines.append(
            f"| {batch} | " + " | ".join(_cell(scores.get((a, batch), [])) for a in args.arms) + " |"
        )
    lines += [
        "",
        f"![test top-1 against global batch]({os.path.basename(png)})",
        "",
        "## Set-up",
        "",
        f"- Data: Fashion-MNIST from Debian's package; training on the first {train:,} of the 60,000 "
        f"training images, learning rates chosen on the last {args.validation_examples:,} (validation "
        "split, never trained on; `--validation_examples`), test top-1 on "
        f"{args.max_eval_examples or 10000:,} test images, "
        "reported only for the chosen rates. No augmentation in either arm (the product's Fashion-MNIST "
        "pipeline has none).",
        "- Network: `small_cnn` (4 convolutions 16-16-32-32 and dense 128, each with batch norm, momentum "
        "0.9 so that the running statistics follow the few updates of the largest batches; 0.22M "
        "parameters). One process per run (world size 1), so batch norm sees the whole global batch.",
        f"- Both arms: {args.epochs} epochs, linear warmup from 0 over {args.warmup_epochs:g} epoch(s), then "
        "polynomial decay with power 2 to 0 over the remaining steps (`--schedule=mlperf_poly`: the paper's "
        "poly policy, decay counted after warmup), momentum 0.9, weight decay "
        f"{args.weight_decay:g} (L2 added to the gradient), float32, deterministic input order.",
        "- Momentum SGD: Goyal et al.'s linear scaling rule, peak = base rate x batch / 256, with the same "
        "gradual warmup; poly decay instead of their step decay, so that the schedule is identical in both "
        "arms and the one difference is LARS's layer-wise trust ratio.",
        "- LARS: the paper's rule on every tensor (eta 0.001, trust ratio eta ||w|| / (||g|| + beta ||w||)).",
        f"- Sweep: {args.sweep_points} rates a factor {args.sweep_ratio:g} apart around the centre below, on "
        f"seed 0; while the best validation top-1 is at an edge, one more rate past it (at most "
        f"{args.max_extensions}). The chosen rate is then trained with {args.seeds - 1} more seed(s).",
        *[f"  - {a.label}: centre {a.centre_rule}." for a in used.values()],
        "- Images per epoch: steps per epoch = round(training images / batch), so every batch sees within 4% "
        "of the same images per epoch.",
        "",
        "## Why this batch range and epoch budget",
        "",
        *why(args, train),
        "",
        "| global batch | share of training set per update | updates per epoch | updates per run | "
        "warmup updates |",
        "|---|---|---|---|---|",
    ]
    for batch in sorted(args.batches):
        steps = max(1, round(train / batch))
        lines.append(
            f"| {batch} | {100 * batch / train:.2f}% | {steps} | {steps * args.epochs:,} | "
            f"{round(args.warmup_epochs * steps)} |"
        )
    lines += [
        "",
        "## Learning-rate sweep (seed 0; chosen on validation top-1)",
        "",
        "| arm | global batch | swept rate | peak rate | validation top-1 | validation loss | train loss | "
        "images/s | chosen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(records, key=lambda r: (r["arm"], r["batch"], r["rate"], r["seed"]))
    for r in ordered:
        if r["role"] != "sweep":
            continue
        swept = f"{r['rate']:g}" + (" per 256" if r["rate_flag"] == "base_learning_rate" else "")
        mark = ("yes" + (" (at the sweep's edge)" if r["edge"] else "")) if r["chosen"] else ""
        lines.append(
            f"| {r['arm']} | {r['batch']} | {swept} | {r['peak_learning_rate']:.4g} | {r['val_top1']:.4f} | "
            f"{r['val_loss']:.4f} | {r['train_loss']:.4f} | {r['images_per_second'] or 0:.0f} | {mark} |"
        )
    lines += [
        "",
        "## Chosen rates, every seed",
        "",
        "| arm | global batch | peak rate | seed | validation top-1 | test top-1 | test top-5 | run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        if r["chosen"]:
            lines.append(
                f"| {r['arm']} | {r['batch']} | {r['peak_learning_rate']:.4g} | {r['seed']} | "
                f"{r['val_top1']:.4f} | {r['test_top1']:.4f} | {r['test_top5']:.4f} | `{r['run_name']}` |"
            )
    common.write_report(args.report, "\n".join(lines))
