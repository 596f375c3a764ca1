"""What a start of an image-folder run pays to know its files: listing the folders (`listing.list_split`)
against reading the run's index (`listing.listed`), on a generated tree of 100,000 small files, warm and
with the kernel's caches dropped (root), and on 2 Horovod ranks (`image_folder.list_splits`).

    python -m benchmarks.listing_index --repeats=3     # results/listing_index.md, about a minute
    python -m benchmarks.listing_index --classes=20 --repeats=1 --warm_only --out=/tmp/listing.md
"""

import os
import statistics
import sys
import tempfile
import time

from benchmarks import common
from hvd_lars.data import listing

CLASSES, PER_CLASS, PER_CLASS_VALIDATION = 1000, 100, 5


def make_tree(root, classes=CLASSES):
    for split, count in (("train", PER_CLASS), ("validation", PER_CLASS_VALIDATION)):
        for c in range(classes):
            folder = os.path.join(root, split, f"c{c:04d}")
            os.makedirs(folder)
            for i in range(count):
                with open(os.path.join(folder, f"img_{i:05d}.JPEG"), "wb") as f:
                    f.write(b"\xff\xd8\xff\xe0" + bytes(60))


def drop_caches():
    """True when the kernel's caches were dropped (needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn, repeats, cold=False):
    times = []
    for _ in range(repeats):
        if cold and not drop_caches():
            return None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def list_both(root):
    train = listing.list_split(os.path.join(root, "train"))
    listing.list_split(os.path.join(root, "validation"), train.classes)
    return train


def index_both(root, index_dir, reuse=True):
    """Both splits through the run's index (`listing.listed`): written where `reuse` is False, else read."""
    train, reused = listing.listed(os.path.join(root, "train"), os.path.join(index_dir, "train.index.npz"))
    val, reused_val = listing.listed(
        os.path.join(root, "validation"), os.path.join(index_dir, "validation.index.npz"), train.classes
    )
    assert (reused and reused_val) == reuse
    return train


RANK_WORKER = """
import json, sys, time
from hvd_lars.parallel import collectives
from hvd_lars.data import image_folder
rank, size = collectives.init()
times = []
for start in range(2):  # the first start lists; the second reads the index written by the first
    collectives.barrier()
    t = time.perf_counter()
    train, _ = image_folder.list_splits(sys.argv[1], sys.argv[2], rank, size)
    times.append(time.perf_counter() - t)
    assert len(train.files) == {files}
with open(f"{{sys.argv[3]}}/times_{{rank}}.json", "w") as f:
    json.dump(times, f)  # a file per rank: horovodrun interleaves the ranks' output lines
"""


def two_ranks(root, index_dir, classes=CLASSES):
    code = RANK_WORKER.format(files=classes * PER_CLASS)
    out = os.path.dirname(index_dir)
    os.makedirs(out, exist_ok=True)
    command = [common.HOROVODRUN, "-np", "2", "-H", "localhost:2", sys.executable, "-c", code]
    common.run(command + [root, index_dir, out], timeout=600)
    times = {}
    for rank in range(2):
        times[rank] = common.read_json(os.path.join(out, f"times_{rank}.json"))
    return times


def ms(seconds):
    return f"{seconds * 1e3:.0f} ms"


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--classes", type=int, default=CLASSES, help="class folders of the generated tree")
    parser.add_argument("--warm_only", action="store_true", help="do not drop the kernel's caches")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "listing_index.md"))
    args = parser.parse_args(argv)
    classes = args.classes
    with tempfile.TemporaryDirectory() as tmp:
        root, index_dir = os.path.join(tmp, "data"), os.path.join(tmp, "run", "image_folder_index")
        t = time.perf_counter()
        make_tree(root, classes)
        made = time.perf_counter() - t
        assert len(list_both(root).files) == classes * PER_CLASS
        index_both(root, index_dir, reuse=False)
        index_bytes = sum(os.path.getsize(os.path.join(index_dir, f)) for f in os.listdir(index_dir))
        rows = {"warm": (None, None), "cold": (None, None)}
        for caches in ("warm",) if args.warm_only else ("warm", "cold"):
            listed_s = timed(lambda: list_both(root), args.repeats, cold=caches == "cold")
            rows[caches] = (
                listed_s,
                timed(lambda: index_both(root, index_dir), args.repeats, cold=caches == "cold"),
            )
        ranks = two_ranks(root, os.path.join(tmp, "run2", "image_folder_index"), classes)
    lines = [
        "# Listing an image folder once per run: listing against the run's index file",
        "",
        *common.provenance_lines(common.command_line("listing_index", argv), common.matmul_rate()),
        "",
        f"Tree: {classes:,} class folders with {PER_CLASS} files each in `train/` "
        f"({classes * PER_CLASS:,} files) and {PER_CLASS_VALIDATION} each in `validation/`, 64-byte files "
        f"(written in {made:.0f} s). "
        f"Index files of both splits: {index_bytes / 1e6:.2f} MB. Times are medians of {args.repeats} tries, "
        "both splits together, in one process.",
        "",
        "| caches | list the folders (`list_split`) | read the index (`listed`, valid) | listing / index |",
        "|---|---:|---:|---:|",
    ]
    for name, (listed_s, index_s) in rows.items():
        if listed_s is None:
            lines.append(
                f"| {name} | not measured (dropping the caches needs root; not with --warm_only) | | |"
            )
        else:
            lines.append(
                f"| {name} | {listed_s * 1e3:.0f} ms | {index_s * 1e3:.0f} ms | {listed_s / index_s:.1f}x |"
            )
    lines += [
        "",
        "On 2 Horovod ranks (`image_folder.list_splits`, what `--dataset=image_folder` calls; rank 1 waits "
        "in the broadcast while rank 0 works):",
        "",
        "| start | rank 0 | rank 1 |",
        "|---|---:|---:|",
        f"| first (rank 0 lists, writes the index, broadcasts) | {ms(ranks[0][0])} | {ms(ranks[1][0])} |",
        f"| later (rank 0 reads the index, broadcasts) | {ms(ranks[0][1])} | {ms(ranks[1][1])} |",
    ]
    common.write_report(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
