"""Command line: `python -m hvd_lars.main --flagfile=flags/<experiment>.flags` (or `hvd-lars-train`).

The only reader of flags: turns them into one `TrainConfig` and calls `hvd_lars.training.train.run`. Launch it
once per rank (horovodrun, mpirun, srun) or alone for a single-process run.
"""

import dataclasses
import sys

from absl import app, flags, logging

from hvd_lars.parallel.collectives import GRADIENT_COMPRESSIONS, GRADIENT_REDUCTIONS
from hvd_lars.training import threads
from hvd_lars.training.config import OPTIMIZERS, PRECISIONS, TrainConfig

_D = TrainConfig()
flags.DEFINE_string(
    "dataset", _D.dataset, "Input pipeline: fashion_mnist, imagenet2012, image_folder or synthetic."
)
flags.DEFINE_string("data_dir", _D.data_dir, "Data folder; empty: the dataset's default location.")
flags.DEFINE_string(
    "manual_dir", _D.manual_dir, "imagenet2012: folder with ILSVRC2012_img_train.tar and _val.tar."
)
flags.DEFINE_integer("image_size", _D.image_size, "Crop side in pixels (0: 224; 227 for AlexNet).")
flags.DEFINE_string(
    "preprocessing",
    _D.preprocessing,
    "ImageNet-style image views: inception (default: Inception crops of 8-100 percent of the area), caffe "
    "(256x256, random 227 crop + mirror, centre crop for eval, channel means subtracted: AlexNet), "
    "caffe_scaled (the same times 1/256: the released AlexNet-BN).",
)
flags.DEFINE_bool("deterministic", _D.deterministic, "Fixed input order (exact resume); off: faster.")
flags.DEFINE_bool("skip_corrupt", _D.skip_corrupt, "Skip and count unreadable training images.")
flags.DEFINE_integer("input_threads", _D.input_threads, "Input pipeline threads (0: this rank's cores).")
flags.DEFINE_string("model", _D.model, "Model name (hvd_lars.models.MODELS).")
flags.DEFINE_enum("optimizer", _D.optimizer, OPTIMIZERS, "lars, or momentum (SGD with coupled L2 decay).")
flags.DEFINE_integer(
    "global_batch_size",
    _D.global_batch_size,
    "Images per update over all ranks and micro-batches (0: derived).",
)
flags.DEFINE_integer(
    "per_rank_batch_size",
    _D.per_rank_batch_size,
    "Images per micro-batch on one rank (0: derived from global).",
)
flags.DEFINE_integer(
    "accumulation_steps",
    _D.accumulation_steps,
    "Micro-batches per optimizer update. Batch norm normalises each micro-batch on its own and updates its "
    "moving averages once per micro-batch (the run log says how often per update).",
)
flags.DEFINE_enum(
    "gradient_reduction",
    _D.gradient_reduction,
    GRADIENT_REDUCTIONS,
    "overlap: allreduce each gradient as backprop produces it; grouped: one allreduce after backprop.",
)
flags.DEFINE_enum(
    "gradient_compression",
    _D.gradient_compression,
    GRADIENT_COMPRESSIONS,
    "fp16: gradients travel as float16 (divided by the world size before the sum).",
)
flags.DEFINE_enum(
    "precision",
    _D.precision,
    PRECISIONS,
    "Keras dtype policy; auto: mixed_bfloat16 on CPUs with native bf16.",
)
flags.DEFINE_float("label_smoothing", _D.label_smoothing, "Label smoothing of the cross-entropy (0: none).")
flags.DEFINE_float("epochs", _D.epochs, "Training epochs (whole number).")
flags.DEFINE_float("warmup_epochs", _D.warmup_epochs, "Linear warmup length in epochs.")
flags.DEFINE_float(
    "base_learning_rate",
    _D.base_learning_rate,
    "Peak learning rate per 256 images (scaled linearly to the global batch).",
)
flags.DEFINE_float("peak_learning_rate", _D.peak_learning_rate, "Peak learning rate (instead of base).")
flags.DEFINE_float("warmup_start_learning_rate", _D.warmup_start_learning_rate, "Rate at step 0.")
flags.DEFINE_float("end_learning_rate", _D.end_learning_rate, "Rate at the last step.")
flags.DEFINE_string(
    "schedule",
    _D.schedule,
    "Learning-rate policy: mlperf_poly (warmup from 0, poly decay after warmup), paper_poly (the paper's "
    "solver: poly decay counted from step 0), cosine, step (Goyal et al.).",
)
flags.DEFINE_float("decay_power", _D.decay_power, "Polynomial decay power after warmup.")
flags.DEFINE_list(
    "decay_boundaries_epochs", [], "Epochs at which the step schedule multiplies the rate by --decay_factor."
)
flags.DEFINE_float("decay_factor", _D.decay_factor, "Step schedule: multiplier at each boundary.")
flags.DEFINE_string(
    "trust_ratio_mode",
    _D.trust_ratio_mode,
    "LARS convention: paper (||g|| + beta ||w|| in the trust ratio), decayed_gradient (||g + beta w||), "
    "update (trust ratio on the momentum update).",
)
flags.DEFINE_enum(
    "momentum_correction",
    _D.momentum_correction,
    ["none", "warmup", "always"],
    "LARS velocity rescaled by lr_t / lr_{t-1}: none (Intel Caffe's fused update, the paper's runs), "
    "warmup (its non-fused update: during warmup only), always (Goyal et al. eq. 10).",
)
flags.DEFINE_float("momentum", _D.momentum, "Momentum.")
flags.DEFINE_float("weight_decay", _D.weight_decay, "L2 weight decay (beta).")
flags.DEFINE_float("eta", _D.eta, "LARS trust coefficient.")
flags.DEFINE_bool(
    "exclude_bn_and_bias",
    _D.exclude_bn_and_bias,
    "Leave batch-norm parameters and biases out of LARS adaptation and weight decay (MLPerf recipe).",
)
flags.DEFINE_float("epsilon", _D.epsilon, "LARS epsilon in the trust ratio's denominator.")
flags.DEFINE_string("workdir", _D.workdir, "Parent folder of the run directory.")
flags.DEFINE_string("run_name", _D.run_name, "Run directory name; empty: derived from the flags.")
flags.DEFINE_integer("seed", _D.seed, "Random seed (weights, shuffling).")
flags.DEFINE_bool("resume", _D.resume, "Resume from the run directory's latest checkpoint.")
flags.DEFINE_integer(
    "eval_every_epochs", _D.eval_every_epochs, "Evaluate every N epochs (and after the last)."
)
flags.DEFINE_integer(
    "checkpoint_every_steps", _D.checkpoint_every_steps, "Checkpoint every N updates (0: epoch ends only)."
)
flags.DEFINE_bool(
    "checkpoint_at_epoch_end", _D.checkpoint_at_epoch_end, "Checkpoint at each epoch end (after evaluation)."
)
flags.DEFINE_bool(
    "async_checkpoints",
    _D.async_checkpoints,
    "Rank 0 writes checkpoints in a background thread (the index is replaced when the files are complete).",
)
flags.DEFINE_bool(
    "elastic",
    _D.elastic,
    "Elastic training under horovodrun --min-np/--max-np --host-discovery-script (launch/elastic.sh): "
    "workers may leave and join; the global batch and schedule stay, the per-rank batch adapts.",
)
flags.DEFINE_integer(
    "elastic_commit_every_steps",
    _D.elastic_commit_every_steps,
    "Elastic: updates between commits of the state in memory (what a dead worker costs; when a membership "
    "change is taken up).",
)
flags.DEFINE_float(
    "hang_timeout_s",
    _D.hang_timeout_s,
    "A rank that completes no update, evaluation batch or checkpoint for this many seconds ends its process "
    "(exit status 4), so that a silent host or link cannot hang the job; 0: never.",
)
flags.DEFINE_integer("keep_checkpoints", _D.keep_checkpoints, "How many recent checkpoints to keep.")
flags.DEFINE_integer(
    "max_train_examples", _D.max_train_examples, "Use only the first N training images (0: all)."
)
flags.DEFINE_integer(
    "max_eval_examples", _D.max_eval_examples, "Use only the first N evaluation images (0: all)."
)
flags.DEFINE_integer(
    "validation_examples",
    _D.validation_examples,
    "Hold out the last N training images (never trained on) and evaluate them like the test set as "
    "val_top1/val_top5/val_loss, for choosing hyperparameters (0: none; fashion_mnist only).",
)
flags.DEFINE_integer(
    "steps_per_epoch", _D.steps_per_epoch, "Override steps per epoch (0: data size // batch)."
)
flags.DEFINE_integer("intra_op_threads", _D.intra_op_threads, "TF intra-op threads (0: this rank's cores).")
flags.DEFINE_integer("inter_op_threads", _D.inter_op_threads, "TF inter-op threads (0: this rank's cores).")
flags.DEFINE_integer("verbose", _D.verbose, "Keras verbosity on rank 0: 0, 1 (progress bar), 2 (per epoch).")

FLAGS = flags.FLAGS


def config_from_flags():
    values = {f.name: FLAGS[f.name].value for f in dataclasses.fields(TrainConfig)}
    try:
        values["decay_boundaries_epochs"] = tuple(float(e) for e in values["decay_boundaries_epochs"])
    except ValueError as e:
        raise app.UsageError(f"--decay_boundaries_epochs must be numbers: {e}") from e
    return TrainConfig(**values)


def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    # TensorFlow's checkpoint code logs every save at INFO through absl.
    logging.set_verbosity(logging.WARNING)
    # Horovod's cycle and MPI's waiting sized for ranks that use every core (unless exported).
    threads.apply_horovod_cpu_defaults()
    from hvd_lars.parallel.collectives import WorldSizeMismatch
    from hvd_lars.training.checkpoints import CheckpointWriteError
    from hvd_lars.training.faults import EXIT_DIVERGED, EXIT_PREEMPTED, Preempted, TrainingDiverged
    from hvd_lars.training.train import run

    try:
        run(config_from_flags())
    except (ValueError, FileNotFoundError, ImportError, WorldSizeMismatch, CheckpointWriteError) as e:
        # Bad input or a missing optional package: one clear line, exit status 2, no traceback.
        print(f"hvd_lars: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TrainingDiverged as e:
        print(f"hvd_lars: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_DIVERGED)
    except Preempted as e:
        # Not an error: the job is to be started again (launch/slurm/train.sbatch requeues it).
        print(f"[hvd_lars] {e}", flush=True)
        sys.exit(EXIT_PREEMPTED)


def main():
    app.run(_main)


if __name__ == "__main__":
    main()
