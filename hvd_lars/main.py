"""Command line: `python -m hvd_lars.main --flagfile=flags/<experiment>.flags` (or `hvd-lars-train`).

The only reader of flags: one flag per field of `TrainConfig` (its default, help and accepted values come
from the field), turned into one `TrainConfig` for `hvd_lars.training.train.run` (or, with `--elastic`,
`hvd_lars.training.elastic_loop.run`). Launch it once per rank (horovodrun, mpirun, srun) or alone.
"""

import dataclasses
import os
import sys

from absl import app, flags, logging

from hvd_lars.data import imagenet_preparation
from hvd_lars.parallel.collectives import WorldSizeMismatch
from hvd_lars.training import elastic_loop, threads, train
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.faults import EXIT_DIVERGED, EXIT_PREEMPTED, Preempted, TrainingDiverged
from hvd_lars.training.file_failures import FileFailure
from hvd_lars.training.settings import choices_of

FLAGS = flags.FLAGS
EXIT_BAD_INPUT = 2
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def define_flags(config_class=TrainConfig, flag_values=FLAGS):
    """Defines one absl flag per field of `config_class`, from the field's default, help and choices."""
    for field in dataclasses.fields(config_class):
        help_text = field.metadata["help"]
        choices = choices_of(field)
        if choices is not None:
            help_text += f" Valid: {', '.join(map(str, choices))}."
        if field.type in (bool, "bool"):
            flags.DEFINE_bool(field.name, field.default, help_text, flag_values=flag_values)
        elif field.type in (int, "int"):
            flags.DEFINE_integer(field.name, field.default, help_text, flag_values=flag_values)
        elif field.type in (float, "float"):
            flags.DEFINE_float(field.name, field.default, help_text, flag_values=flag_values)
        elif field.type in (tuple, "tuple"):
            flags.DEFINE_list(field.name, list(field.default), help_text, flag_values=flag_values)
        else:
            flags.DEFINE_string(field.name, field.default, help_text, flag_values=flag_values)


define_flags()
# Retired: training reads prepared data only, and ImageNet is prepared before the job (hvd_lars.prepare).
# Still a flag so that a command line passing it is refused with the command that prepares, filled in.
flags.DEFINE_string(
    "manual_dir",
    "",
    "Retired: prepare ImageNet once with hvd-lars-prepare before training; a value is refused.",
)


def config_from_flags(flag_values=FLAGS):
    """The `TrainConfig` of the parsed flags.

    Raises:
        ValueError: an element of a list flag that is not of the field's type, naming the flag.
    """
    values = {}
    for field in dataclasses.fields(TrainConfig):
        value = flag_values[field.name].value
        if field.type in (tuple, "tuple"):
            try:
                value = tuple(field.metadata["item"](v) for v in value)
            except ValueError as e:
                raise ValueError(f"--{field.name}={','.join(value)}: {e}") from e
        values[field.name] = value
    return TrainConfig(**values)


def run_training(config, extra_callbacks=()):
    """The loop `config` asks for: elastic (workers come and go) or of a fixed world size."""
    loop = elastic_loop.run if config.elastic else train.run
    return loop(config, extra_callbacks)


def _raised_here(error):
    # Bad input is what this package refuses (raise sites in hvd_lars/, or an optional import it makes); a
    # ValueError from inside Keras or TensorFlow is an internal error and keeps its traceback.
    last, tb = None, error.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith("<frozen importlib"):
            last = filename
        tb = tb.tb_next
    return last is not None and os.path.abspath(last).startswith(_PACKAGE + os.sep)


def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.manual_dir:
        _exit(f"hvd_lars: error: {_retired_manual_dir(FLAGS.manual_dir, FLAGS.data_dir)}", EXIT_BAD_INPUT)
    # TensorFlow's checkpoint code logs every save at INFO through absl.
    logging.set_verbosity(logging.WARNING)
    # Horovod's cycle and MPI's waiting sized for ranks that use every core (unless exported), and Open
    # MPI's allreduce rules of the library (hvd_lars.parallel.ompi_allreduce_rules).
    threads.apply_horovod_cpu_defaults()
    try:
        run_training(config_from_flags())
    except (WorldSizeMismatch, FileFailure, FileNotFoundError) as e:
        _exit(f"hvd_lars: error: {e}", EXIT_BAD_INPUT)
    except (ValueError, ImportError) as e:
        if not _raised_here(e):
            raise
        # Bad input or a missing optional package: one clear line, exit status 2, no traceback.
        _exit(f"hvd_lars: error: {e}", EXIT_BAD_INPUT)
    except TrainingDiverged as e:
        _exit(f"hvd_lars: error: {e}", EXIT_DIVERGED)
    except Preempted as e:
        # Not an error: the job is to be started again (launch/slurm/train.sbatch requeues it).
        print(f"[hvd_lars] {e}", flush=True)
        sys.exit(EXIT_PREEMPTED)


def _retired_manual_dir(manual_dir, data_dir):
    return (
        f"--manual_dir={manual_dir}: training no longer converts the ILSVRC-2012 tars. Prepare them once, "
        f"on one node: {imagenet_preparation.command(data_dir, manual_dir)}; then train with the same "
        "--data_dir and without --manual_dir."
    )


def _exit(message, status):
    print(message, file=sys.stderr, flush=True)
    sys.exit(status)


def _parse_flags(argv):
    # absl's own parsing; a flagfile that is not text of the locale's encoding is one line, not a traceback.
    try:
        return app.parse_flags_with_usage(argv)
    except UnicodeDecodeError as e:
        _exit(f"hvd_lars: error: {_undecodable_flagfile(argv, e)}", EXIT_BAD_INPUT)


def _undecodable_flagfile(argv, error):
    """Where the first flagfile of `argv` (or one it names) fails to decode as `error.encoding`."""
    pending = [a.split("=", 1)[1] for a in argv[1:] if a.lstrip("-").startswith("flagfile=")]
    seen = set()
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path, "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, 1):
            try:
                text = line.decode(error.encoding).strip()
            except UnicodeDecodeError as e:
                return (
                    f"--flagfile={path}: line {number} is not {error.encoding} text (byte "
                    f"{line[e.start]:#04x} at column {e.start + 1}); save the file as {error.encoding}."
                )
            if text.lstrip("-").startswith("flagfile="):
                pending.append(text.split("=", 1)[1])
    return f"a flagfile is not {error.encoding} text ({error})."


def main():
    # Run as the console script hvd-lars-train, sys.argv[0] is that script, not this module, and absl's
    # --help lists only the flags of sys.argv[0]'s module: these become that program's key flags.
    for flag in FLAGS.get_flags_for_module(__name__):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    app.run(_main, flags_parser=_parse_flags)


if __name__ == "__main__":
    main()
