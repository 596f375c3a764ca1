"""Two Horovod ranks reading one image folder: disjoint training shards covering the set, equal step
counts, an evaluation that counts every image exactly once (exact top-1/top-5 summed over ranks), and
one listing of the folder per run (rank 0's, kept in an index file), refusals reaching every rank."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import REPO
from tests.support.data_fixtures import make_image_folder
from tests.support.horovodrun_checked_once import HOROVODRUN
from tests.support.main_server import served

WORKER = os.path.join(REPO, "tests", "support", "data_worker.py")
# 13 classes of one training image each (a label names its image; one is left over with 2 ranks) and 9
# evaluation images (ranks get 4 and 5) with labels 0,0,1,2,3,5,7,9,12.
EVAL_COUNTS = [2, 1, 1, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1]


@pytest.mark.horovod
def test_two_ranks_shard_training_and_count_evaluation_once(tmp_path):
    make_image_folder(str(tmp_path / "data"), [1] * 13, EVAL_COUNTS, odd={})
    make_image_folder(str(tmp_path / "bad"), [1, 1], [1, 1], odd={})
    with open(tmp_path / "bad" / "train" / "n00000001" / "notes.txt", "w") as f:
        f.write("not an image")
    cmd = [
        *HOROVODRUN,
        "-np",
        "2",
        "-H",
        "localhost:2",
        sys.executable,
        WORKER,
        str(tmp_path / "data"),
        str(tmp_path),
    ]
    result = subprocess.run(served(cmd), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    r0, r1 = (np.load(tmp_path / f"data_rank{r}_of_2.npz") for r in range(2))
    assert int(r0["steps_per_epoch"]) == int(r1["steps_per_epoch"]) == 3  # 13 // 2 images, batch 2
    for epoch in range(2):
        shards = [sorted(r["train"][6 * epoch : 6 * (epoch + 1)].tolist()) for r in (r0, r1)]
        assert shards == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]  # disjoint; image 12 left out
    assert r0["eval"].tolist() == [0, 0, 1, 2] and r1["eval"].tolist() == [3, 5, 7, 9, 12]
    assert int(r0["num_eval_examples"]) == 9
    # The all-zero classifier's exact scores over all 9 images (ties broken by class index), identical on
    # both ranks.
    for r in (r0, r1):
        assert float(r["top1"]) == 2 / 9  # two images of class 0
        assert float(r["top5"]) == 5 / 9  # labels 0, 0, 1, 2, 3
    # Rank 0 listed train/ and validation/ once; the second build (a resume) used its index; rank 1 never
    # listed. The refused folder was listed by rank 0 alone, and both ranks raised its error.
    assert r0["first_listings"].tolist() == ["train", "validation"] and r1["first_listings"].tolist() == []
    assert r0["listings"].tolist() == ["train", "validation", "train"] and r1["listings"].tolist() == []
    for r in (r0, r1):
        assert "files that are not images this pipeline reads" in str(r["refusal"])
        assert f"{tmp_path}/bad/train/n00000001/notes.txt" in str(r["refusal"])
    assert sorted(os.listdir(tmp_path / "image_folder_index")) == ["train.index.npz", "validation.index.npz"]
