"""The large-batch study's report (Markdown and a PNG plot) from the finished runs' records
(`large_batch_study._record`), rewritten after every run; its hand-written part is kept."""

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


def _loss(record, key):
    if record.get("diverged_at_step") is not None:
        return f"diverged at step {record['diverged_at_step']}"
    return f"{record[key]:.4f}"


def _summary(values):
    mean = statistics.fmean(values)
    return mean, min(values), max(values)


def status(args, group, outcome):
    """A table cell: the chosen rate's mean test top-1 (min-max, n), or what is not done yet."""
    chosen = [r["test_top1"] for r in outcome.records if r["chosen"]]
    if outcome.chosen is not None and len(chosen) == args.seeds:
        mean, low, high = _summary(chosen)
        spread = f" ({low:.4f}-{high:.4f})" if len(chosen) > 1 else ""
        return f"**{mean:.4f}**{spread}, n={len(chosen)}"
    if outcome.blocked:
        return f"not run yet ({outcome.blocked})"
    if not outcome.records:
        return "not run yet"
    if outcome.chosen is None:
        return f"not run yet (sweep: {len(outcome.records)} rate(s) done)"
    return f"not run yet (seeds: {len(chosen)} of {args.seeds} done)"


def _short(arm):
    return arm.label.split(" (")[0]


def _complete(args, outcome):
    return outcome.chosen is not None and sum(r["chosen"] for r in outcome.records) == args.seeds


def findings(args, network, outcomes, arms):
    """Sentences for one network: each arm at each batch against the best arm at the smallest batch, LARS
    against each momentum arm, and where the paper's claim (LARS holds what momentum loses) holds."""
    mine = {(g.arm, g.batch): o for g, o in outcomes.items() if g.network == network and _complete(args, o)}
    batches = sorted({g.batch for g in outcomes if g.network == network})
    if not batches:
        return ["Not in this study's grid."]
    smallest = min(batches)
    # The reference is the arms every batch has (an arm started from another's choice is an addition).
    at_smallest = [
        g.arm
        for g in outcomes
        if g.network == network and g.batch == smallest and not arms[g.arm].starts_from
    ]
    reference = [_scores(mine[(a, smallest)]) for a in at_smallest if (a, smallest) in mine]
    if not reference or len(reference) < len(at_smallest):
        return [
            f"Not enough finished runs yet: the smallest batch ({smallest}) is the reference, not run yet."
        ]
    best_small = max(_summary(v)[0] for v in reference)
    sentences = [
        f"Reference: the better arm at the smallest batch ({smallest}) reaches {best_small:.4f} mean test "
        f'top-1; an arm "holds" at a batch when its mean is at most {100 * SAME_ACCURACY:.1f} points below.'
    ]
    verdicts = {}
    for batch in batches:
        if batch == smallest:
            continue
        present = [a for a in arms if (a, batch) in mine]
        planned = [g.arm for g in outcomes if g.network == network and g.batch == batch]
        if not present:
            sentences.append(f"Batch {batch}: not run yet.")
            continue
        means = {a: _summary(_scores(mine[(a, batch)])) for a in present}
        holds = {a: best_small - means[a][0] <= SAME_ACCURACY for a in present}
        parts = [
            f"{_short(arms[a])} {means[a][0]:.4f} "
            + ("(holds)" if holds[a] else f"(loses {100 * (best_small - means[a][0]):.1f} points)")
            for a in present
        ]
        parts += [f"{_short(arms[a])} not run yet" for a in planned if a not in present]
        if "lars" in means:
            lars = means["lars"]
            for other in (a for a in present if a != "lars"):
                gap = lars[0] - means[other][0]
                overlap = lars[1] <= means[other][2] and means[other][1] <= lars[2]
                if abs(gap) <= SAME_ACCURACY or overlap:
                    parts.append(f"LARS and {_short(arms[other])} are within 0.5 points or the seeds' spread")
                else:
                    parts.append(
                        f"LARS is {'ahead of' if gap > 0 else 'behind'} {_short(arms[other])} by "
                        f"{100 * abs(gap):.1f} points"
                    )
            momenta = [a for a in present if a != "lars"]
            if momenta:
                missing = [_short(arms[a]) for a in planned if a not in present]
                verdicts[batch] = _verdict(holds, momenta, arms) + (
                    f" ({', '.join(missing)} not run yet)" if missing else ""
                )
        sentences.append(f"Batch {batch}: " + "; ".join(parts) + ".")
    if verdicts:
        sentences.append("In short: " + "; ".join(f"at {b}, {verdicts[b]}" for b in sorted(verdicts)) + ".")
    return sentences


def _verdict(holds, momenta, arms):
    held = [_short(arms[a]) for a in momenta if holds[a]]
    if holds["lars"] and not held:
        return "LARS held what the momentum arms lost (the paper's claim holds)"
    if holds["lars"]:
        return f"LARS held and so did {' and '.join(held)} (no case for LARS here)"
    if held:
        return f"{' and '.join(held)} held and LARS lost (the claim is reversed)"
    return "every arm lost accuracy (the claim breaks here: LARS did not hold either)"


def _scores(outcome):
    return [r["test_top1"] for r in outcome.records if r["chosen"]]


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
        "`results/archive/large_batch_throughput.md`). It leaves the largest batch "
        f"{max(1, round(train / largest)) * args.epochs} updates, far fewer than ImageNet's thousands, so "
        "at the largest batches the update count, not only the batch, is under test:",
    ]


def plot(args, outcomes, networks, arms, path):
    """Mean test top-1 of each arm's chosen rate against the global batch, a panel per network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(networks), figsize=(5.2 * len(networks), 4.2), squeeze=False)
    for ax, (network, info) in zip(axes[0], networks.items()):
        batches = sorted({g.batch for g in outcomes if g.network == network})
        for colour, (name, arm) in enumerate(arms.items()):
            done = [
                (g.batch, _summary(_scores(o)))
                for g, o in sorted(outcomes.items(), key=lambda item: item[0].batch)
                if g.network == network and g.arm == name and _complete(args, o)
            ]
            if not done:
                continue
            xs = [b for b, _ in done]
            means = [100 * s[0] for _, s in done]
            below = [100 * (s[0] - s[1]) for _, s in done]
            above = [100 * (s[2] - s[0]) for _, s in done]
            ax.errorbar(
                xs, means, yerr=[below, above], marker="o", capsize=4, label=arm.label, color=f"C{colour}"
            )
        ax.set_xscale("log", base=2)
        if batches:
            ax.set_xlim(min(batches) / 1.4, max(batches) * 1.4)
            ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("global batch (images per update)")
        ax.set_title(info.label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not run yet", transform=ax.transAxes, ha="center", va="center")
    axes[0][0].set_ylabel("test top-1 (%), mean and min-max over seeds")
    fig.suptitle("Fashion-MNIST, same epochs: test top-1 of the chosen rate vs global batch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(args, outcomes, attempts, networks, arms):
    """Writes `args.report` and the PNG beside it from `outcomes` (`large_batch_study.collect`) and the
    output folder's run `attempts`."""
    png = os.path.splitext(args.report)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    plot(args, outcomes, networks, arms, png)
    records = [r for o in outcomes.values() for r in o.records]
    shas = sorted({r["git_sha"] for r in records if r["source"] == "run directory"})
    dirty = f" (`-dirty`: {common.DIRTY})" if any("-dirty" in s for s in shas) else ""
    machines = {}
    for r in records:
        machines.setdefault(_run_machine(r), []).append(r)
    recovered = [r for r in records if r["source"] != "run directory"]
    train = args.max_train_examples or 60000 - args.validation_examples
    seconds = sum(a["seconds"] for a in attempts)
    now = common.now()
    commands = list(dict.fromkeys(a.get("command") for a in attempts if a.get("command")))
    lines = [
        "# Does LARS hold accuracy where momentum SGD loses it? (Fashion-MNIST, this machine)",
        "",
        "- Commands (from the repository root; the same command resumes; `--networks`/`--arms` select a "
        "part, the report always covers the whole study): "
        + ", ".join(f"`{c}`" for c in commands or [args.command]),
        f"- Git SHA of the runs in `{args.output_dir}`: {', '.join(f'`{s}`' for s in shas) or 'none yet'}"
        f"{dirty}; report written {now} (UTC)",
        "- Machines of the runs: "
        + "; or ".join(f"{m} ({len(runs)} runs)" for m, runs in sorted(machines.items())),
        f"- Wall time: {seconds / 3600:.2f} h over {len(attempts)} run attempts in that folder (run "
        "processes from start to exit, including any time paused or shared with other work on the machine)",
    ]
    if recovered:
        lines.append(
            f"- {len(recovered)} earlier runs are known only by their records in "
            f"`{os.path.relpath(common.data_path(args.report), common.REPO)}`: {recovered[0]['source']}"
        )
    lines.append("")
    scores_line = (
        "Test top-1 of the chosen learning rate of each batch and arm (mean over seeds, min-max in brackets; "
        "`-`: not part of the study):"
    )
    for network, info in networks.items():
        mine = {(g.arm, g.batch): (g, o) for g, o in outcomes.items() if g.network == network}
        batches = sorted({b for _, b in mine})
        lines += [f"## Findings: {info.label}", ""]
        lines += [f"- {s}" for s in findings(args, network, outcomes, arms)]
        lines += [
            "",
            scores_line,
            "",
            "| global batch | " + " | ".join(a.label for a in arms.values()) + " |",
        ]
        lines.append("|---|" + "---|" * len(arms))
        for batch in batches:
            cells = [status(args, *mine[(a, batch)]) if (a, batch) in mine else "-" for a in arms]
            lines.append(f"| {batch} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        f"![test top-1 against global batch, one panel per network]({os.path.basename(png)})",
        "",
        "## Set-up",
        "",
        f"- Data: Fashion-MNIST from Debian's package; training on the first {train:,} of the 60,000 "
        f"training images, learning rates chosen on the last {args.validation_examples:,} (validation "
        "split, never trained on; `--validation_examples`), test top-1 on "
        f"{args.max_eval_examples or 10000:,} test images, "
        "reported only for the chosen rates. No augmentation in any arm (the product's Fashion-MNIST "
        "pipeline has none).",
        *[f"- Network `{n.name}`: {n.description}." for n in networks.values()],
        "- One process per run (world size 1), so batch norm sees the whole global batch.",
        f"- Every arm: {args.epochs} epochs, linear warmup from 0 over {args.warmup_epochs:g} epoch(s), then "
        "polynomial decay with power 2 to 0 over the remaining steps (`--schedule=mlperf_poly`: the paper's "
        "poly policy, decay counted after warmup), momentum 0.9, weight decay "
        f"{args.weight_decay:g} (L2 added to the gradient), float32, deterministic input order.",
        "- Momentum SGD: Goyal et al.'s linear scaling rule, peak = base rate x batch / 256, with the same "
        "gradual warmup; poly decay instead of their step decay, so that the schedule is identical in every "
        "arm and the one difference from LARS is its layer-wise trust ratio.",
        "- Nesterov momentum SGD (`--optimizer=nesterov`): the momentum arm with Keras's Nesterov step "
        "(v = m v - lr d, w += m v - lr d, d = g + beta w); Nado et al. (2021) found Nesterov with a tuned "
        "schedule matched LARS at batch 32K on ResNet-50.",
        "- LARS: the paper's rule on every tensor (eta 0.001, trust ratio eta ||w|| / (||g|| + beta ||w||)).",
        f"- Sweep: {args.sweep_points} rates a factor {args.sweep_ratio:g} apart around the centre below, on "
        f"seed 0; while the best validation top-1 is at an edge, one more rate past it (at most "
        f"{args.max_extensions}); while no rate learned anything (validation top-1 at most "
        f"{args.learned_above:g}, chance being 0.1), one more below the lowest (at most "
        f"{args.untrained_extensions} more). The chosen rate is then trained with {args.seeds - 1} more "
        "seed(s).",
        *[f"  - {a.label}: centre {a.centre_rule}." for a in arms.values()],
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
    for batch in sorted({g.batch for g in outcomes}):
        steps = max(1, round(train / batch))
        lines.append(
            f"| {batch} | {100 * batch / train:.2f}% | {steps} | {steps * args.epochs:,} | "
            f"{round(args.warmup_epochs * steps)} |"
        )
    lines += [
        "",
        "## Learning-rate sweep (seed 0; chosen on validation top-1)",
        "",
        "| network | arm | global batch | swept rate | peak rate | validation top-1 | validation loss | "
        "train loss | images/s | chosen |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: i for i, name in enumerate(networks)}
    ordered = sorted(records, key=lambda r: (order[r["network"]], r["arm"], r["batch"], r["rate"], r["seed"]))
    for r in ordered:
        if r["role"] != "sweep":
            continue
        swept = f"{r['rate']:g}" + (" per 256" if r["rate_flag"] == "base_learning_rate" else "")
        mark = ("yes" + (" (at the sweep's edge)" if r["edge"] else "")) if r["chosen"] else ""
        lines.append(
            f"| {r['network']} | {r['arm']} | {r['batch']} | {swept} | {r['peak_learning_rate']:.4g} | "
            f"{r['val_top1']:.4f} | {_loss(r, 'val_loss')} | {_loss(r, 'train_loss')} | "
            f"{r['images_per_second'] or 0:.0f} | {mark} |"
        )
    lines += [
        "",
        "## Chosen rates, every seed",
        "",
        "| network | arm | global batch | peak rate | seed | validation top-1 | test top-1 | test top-5 | "
        "run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        if r["chosen"]:
            lines.append(
                f"| {r['network']} | {r['arm']} | {r['batch']} | {r['peak_learning_rate']:.4g} | "
                f"{r['seed']} | {r['val_top1']:.4f} | {r['test_top1']:.4f} | {r['test_top5']:.4f} | "
                f"`{r['run_name']}` |"
            )
    lines += [
        "",
        "## Provenance of the runs",
        "",
        "| git SHA | machine | dates (UTC) | source | runs |",
        "|---|---|---|---|---|",
    ]
    sources = {}
    for r in ordered:
        key = (r["git_sha"], _run_machine(r), r["source"])
        sources.setdefault(key, []).append(r)
    for (sha, machine, source), runs in sorted(sources.items(), key=lambda item: str(item[0])):
        dates = sorted(str(r["date"])[:10] for r in runs if r["date"])
        span = f"{dates[0]} to {dates[-1]}" if dates else "not recorded"
        groups = sorted({f"{r['network']}/{r['arm']}" for r in runs})
        lines.append(
            f"| {common.sha_text(sha)} | {machine} | {span} | {source} | {len(runs)} ({', '.join(groups)}) |"
        )
    common.write_report(args.report, "\n".join(lines))


def _run_machine(record):
    """A run's machine (`common.describe`) with what the study measured when it trained it, if anything."""
    if record.get("cpu"):
        return common.describe(record["cpu"], record.get("matmul"), record["machine"])
    return common.describe(record["machine"], None)
