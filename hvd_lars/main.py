"""Command line: `python -m hvd_lars.main --flagfile=flags/<experiment>.flags` (or `hvd-lars-train`), once per
rank (horovodrun, mpirun, srun) or alone. One flag per `TrainConfig` field, parsed and checked before Keras,
TensorFlow or Horovod is imported; then `hvd_lars.training.train.run` (`run_elastic` with `--elastic`)."""

import dataclasses
import difflib
import logging
import os
import sys
import textwrap

from absl import app, flags
from absl import logging as absl_logging

from hvd_lars.training.config import TrainConfig

FLAGS = flags.FLAGS
EXIT_BAD_INPUT = 2
log = logging.getLogger("hvd_lars")
# Where each launcher tells a rank its place (horovodrun --gloo, Open MPI, MPICH/PMIx, srun), before
# Horovod is started: the lines of the run are written by rank 0, and a mistake in the flags is said once.
_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_HELP = ("-h", "-?", "--help", "--helpshort", "--helpfull")
USAGE = """\
usage: python -m hvd_lars.main --flagfile=flags/<experiment>.flags [--flag=value ...]
       horovodrun -np N -H host1:n,host2:n python -m hvd_lars.main --flagfile=...   (one rank a slot)
       launch/mpirun.sh, launch/slurm/train.sbatch: the same on mpirun and Slurm (README, docs/cluster.md)
hvd-lars-train is the same program. Flags after the flagfile override it; --flagfile may be given twice.
Exit status: 0 done, 2 bad input (one line), 3 diverged, 75 stopped and resumable (start it again)."""


def define_flags(flag_values=FLAGS):
    """Defines one absl flag per field of `TrainConfig`, from the field's default and help."""
    kinds = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float}
    for field in dataclasses.fields(TrainConfig):
        default = list(field.default) if field.type is tuple else field.default
        define = flags.DEFINE_list if field.type is tuple else kinds.get(field.type, flags.DEFINE_string)
        define(field.name, default, field.metadata["help"], flag_values=flag_values)


define_flags()


def config_from_flags(flag_values=FLAGS):
    """The `TrainConfig` of the parsed flags. Raises ValueError naming the flag for a list element that is
    not of the field's type."""
    values = {}
    for field in dataclasses.fields(TrainConfig):
        values[field.name] = value = flag_values[field.name].value
        if field.type is tuple:
            try:
                values[field.name] = tuple(field.metadata["item"](v) for v in value)
            except ValueError as e:
                raise ValueError(f"--{field.name}={','.join(value)}: {e}") from e
    return TrainConfig(**values)


def help_text():
    """`--help`: the usage lines, then each group's flags with default and accepted values."""
    lines = [USAGE]
    for field in dataclasses.fields(TrainConfig):
        name, default, meta = field.name, field.default, field.metadata
        if meta["group"]:
            lines += ["", f"{meta['group']}:"]
        if isinstance(default, bool):
            lines.append(f"  --[no]{name}  (default: {str(default).lower()})")
        else:
            default = ",".join(map(str, default)) if field.type is tuple else default
            lines.append(f"  --{name}  (default: {default if default != '' else 'empty'})")
        text, accepted = meta["help"], meta["accepted"]
        if isinstance(accepted, tuple):
            text += f" One of: {', '.join(map(str, accepted))}."
        elif accepted is not None:
            text += f" {accepted.describe().capitalize()}{' each' if field.type is tuple else ''}."
        lines += textwrap.wrap(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def place():
    """(rank, world size): Horovod's once it is started (an elastic job's change), else the launcher's
    (0, 1 alone)."""
    horovod = sys.modules.get("horovod.tensorflow")
    if horovod is not None and horovod.is_initialized():
        return horovod.rank(), horovod.size()
    rank = next((int(os.environ[v]) for v in _RANK_VARIABLES if os.environ.get(v, "").isdigit()), 0)
    size = next((int(os.environ[v]) for v in _SIZE_VARIABLES if os.environ.get(v, "").isdigit()), 1)
    return rank, size


class _RunLines(logging.Formatter):
    """`[hvd_lars] ...`, `[hvd_lars] warning: ...`, `hvd_lars: error: ...`; in a job of several ranks, a line
    of a rank other than 0 names it (`[hvd_lars rank 3] ...`)."""

    def format(self, record):
        rank, size = place()
        name = "hvd_lars" if size == 1 or rank == 0 else f"hvd_lars rank {rank}"
        if record.levelno >= logging.ERROR:
            return f"{name}: error: {record.getMessage()}"
        return f"[{name}] {'warning: ' if record.levelno >= logging.WARNING else ''}{record.getMessage()}"


def configure_logging():
    """The run's lines through Python's logging (logger `hvd_lars`): information on stdout, warnings and
    errors on stderr; rank 0's, and those another rank marks as its own (`extra={"every_rank": True}`)."""
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    for stream, errors in ((sys.stdout, False), (sys.stderr, True)):
        handler = logging.StreamHandler(stream)
        handler.setFormatter(_RunLines())
        handler.addFilter(lambda record, errors=errors: (record.levelno >= logging.WARNING) == errors)
        handler.addFilter(lambda record: place()[0] == 0 or getattr(record, "every_rank", False))
        log.addHandler(handler)


def parse(argv):
    """The checked `TrainConfig` of `argv`; `--help` prints the help and exits 0; bad input is one line
    (from rank 0) and exit status 2. Imports nothing heavy."""
    if any(arg in _HELP for arg in argv[1:]):
        sys.stdout.write(help_text() + "\n")
        sys.exit(0)
    configure_logging()
    try:
        rest = FLAGS(argv)
        if len(rest) > 1:
            raise ValueError(f"unexpected arguments {' '.join(rest[1:])}: give settings as --name=value.")
        config = config_from_flags()
        config.validate()
    except flags.UnrecognizedFlagError as e:
        near = difflib.get_close_matches(e.flagname.removeprefix("no"), list(FLAGS), n=1, cutoff=0.75)
        near = f"; did you mean --{near[0]}?" if near else ""
        _exit(f"--{e.flagname}: no such flag{near} (--help lists them)")
    except flags.CantOpenFlagFileError as e:
        _exit(f"{str(e).removeprefix('ERROR:: ')} (the experiments' flagfiles are in flags/)")
    except UnicodeDecodeError as e:  # a ValueError: first
        _exit(_undecodable_flagfile(argv, e))
    except (flags.Error, ValueError) as e:
        _exit(str(e))
    return config


def run_training(config, extra_callbacks=()):
    """The loop `config` asks for: elastic (workers come and go) or of a fixed world size."""
    from hvd_lars.training import train

    return (train.run_elastic if config.elastic else train.run)(config, extra_callbacks)


def _raised_here(error):
    # Bad input is what this package refuses (raise sites in hvd_lars/, or an optional import it makes); a
    # ValueError from inside Keras or TensorFlow is an internal error and keeps its traceback.
    last, tb = None, error.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith("<frozen importlib"):
            last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and os.path.abspath(last).startswith(_PACKAGE + os.sep)


def _main(config):
    from hvd_lars import quiet_tensorflow

    quiet_tensorflow.load()  # before TensorFlow is imported: without its C++ start-up notices
    from hvd_lars.parallel.collectives import WorldSizeMismatch
    from hvd_lars.training import faults, threads

    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's checkpoint code logs every save at INFO
    threads.apply_horovod_cpu_defaults()
    try:
        run_training(config)
    except FileNotFoundError as e:
        _exit(str(e), every_rank=True)  # a host's own data: every rank that misses it says so
    except (WorldSizeMismatch, faults.FileFailure) as e:
        _exit(str(e))
    except faults.TrainingDiverged as e:
        _exit(str(e), faults.EXIT_DIVERGED)
    except (ValueError, ImportError) as e:
        if not _raised_here(e):
            raise
        _exit(str(e))  # bad input or a missing optional package: every rank meets it alike
    except faults.Preempted as e:
        # Not an error: the job is to be started again (launch/slurm/train.sbatch requeues it).
        log.info(str(e), extra={"every_rank": True})
        sys.exit(faults.EXIT_PREEMPTED)


def _exit(message, status=EXIT_BAD_INPUT, every_rank=False):
    log.error(message, extra={"every_rank": every_rank})
    sys.exit(status)


def _undecodable_flagfile(argv, error):
    """Where the first flagfile of `argv` (or one it names) fails to decode as `error.encoding`."""
    paths = [a.split("=", 1)[1] for a in argv[1:] if a.lstrip("-").startswith("flagfile=")]
    for path in paths:  # grows with the flagfiles each names
        try:
            with open(path, "rb") as f:
                data = f.read()
            lines = data.decode(error.encoding).splitlines()
        except OSError:
            continue
        except UnicodeDecodeError as e:
            line, column = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start)
            return (
                f"--flagfile={path}: line {line} is not {error.encoding} text (byte {data[e.start]:#04x} at "
                f"column {column}); save the file as {error.encoding}."
            )
        named = [x.strip().split("=", 1)[1] for x in lines if x.strip().lstrip("-").startswith("flagfile=")]
        paths += [x for x in named if x not in paths]
    return f"a flagfile is not {error.encoding} text ({error})."


def main():
    app.run(_main, flags_parser=parse)


if __name__ == "__main__":
    main()
