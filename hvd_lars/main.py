"""usage: python -m hvd_lars.main --flagfile=flags/<experiment>.flags [--flag=value ...]
       horovodrun -np N -H host1:n,host2:n python -m hvd_lars.main --flagfile=...   (one rank a slot)
       launch/mpirun.sh, launch/slurm/train.sbatch: the same on mpirun and Slurm (README, docs/cluster.md)
hvd-lars-train is the same program. Flags after the flagfile override it; --flagfile may be given twice.
Exit status: 0 done, 2 bad input (one line), 3 diverged, 4 hung (no progress for --hang_timeout_s), 75
stopped and resumable (start it again)."""

import dataclasses
import difflib
import logging
import os
import pathlib
import re
import sys
import textwrap
import traceback

from absl import app, flags
from absl import logging as absl_logging

from hvd_lars import arguments
from hvd_lars.training.config import TrainConfig

FLAGS = flags.FLAGS
EXIT_BAD_INPUT = 2
log = logging.getLogger("hvd_lars")
# Each launcher's rank variable (horovodrun --gloo, Open MPI, MPICH/PMIx, srun), read before Horovod starts.
_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def define_flags(flag_values=FLAGS):
    """Defines one absl flag per field of `TrainConfig` (parsed and checked before TensorFlow is imported)."""
    kinds = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float}
    for field in dataclasses.fields(TrainConfig):
        default = list(field.default) if field.type is tuple else field.default
        define = flags.DEFINE_list if field.type is tuple else kinds.get(field.type, flags.DEFINE_string)
        define(field.name, default, field.metadata["help"], flag_values=flag_values)


define_flags()


def config_from_flags(flag_values=FLAGS):
    return TrainConfig(**{f.name: flag_values[f.name].value for f in dataclasses.fields(TrainConfig)})


def help_text():
    """`--help`: the usage lines, then each group's flags with default and accepted values."""
    lines = [__doc__]
    for field in dataclasses.fields(TrainConfig):
        name, default, meta = field.name, field.default, field.metadata
        lines += ["", f"{meta['group']}:"] if meta["group"] else []
        if isinstance(default, bool):
            lines.append(f"  --[no]{name}  (default: {str(default).lower()})")
        else:
            shown = ",".join(map(str, default)) if field.type is tuple else default
            lines.append(f"  --{name}  (default: {shown if shown != '' else 'empty'})")
        accepted = meta["accepted"]
        if isinstance(accepted, tuple):
            accepted = f"One of: {', '.join(map(str, accepted))}."
        elif accepted is not None:
            accepted = f"{accepted.describe().capitalize()}{' each' if field.type is tuple else ''}."
        lines.append(textwrap.indent(textwrap.fill(f"{meta['help']} {accepted or ''}", 94), " " * 6))
    return "\n".join(lines)


class _RunLines(logging.Handler):
    """Rank 0's lines, and another rank's marked `extra={"every_rank": True}`: errors, warnings on stderr."""

    def emit(self, record):
        horovod = sys.modules.get("horovod.tensorflow")  # once started, its rank (an elastic job's changes)
        if horovod is not None and horovod.is_initialized():
            rank = horovod.rank()
        else:
            rank = next((int(os.environ[v]) for v in _RANK_VARIABLES if os.environ.get(v, "").isdigit()), 0)
        warning, error = record.levelno >= logging.WARNING, record.levelno >= logging.ERROR
        if rank == 0 or getattr(record, "every_rank", False):
            name = f"hvd_lars rank {rank}" if rank else "hvd_lars"
            head = f"{name}: error: " if error else f"[{name}] {'warning: ' * warning}"
            stream = sys.stderr if warning else sys.stdout
            stream.write(f"{head}{record.getMessage()}\n")  # one write: a launcher tags each write's lines
            stream.flush()


def configure_logging():
    log.handlers[:] = [_RunLines()]
    log.setLevel(logging.INFO)
    log.propagate = False


def parse(argv):
    """The checked `TrainConfig` of `argv`, or exit: 0 after `--help`, 2 after one line naming bad input."""
    if {"-h", "-?", "--help", "--helpshort", "--helpfull"} & set(argv[1:]):
        sys.stdout.write(help_text() + "\n")
        sys.exit(0)
    configure_logging()
    if len(argv) == 1:
        _exit(
            "no settings: give an experiment, e.g. --flagfile=flags/smoke.flags (flags/ holds the paper's)."
        )
    try:
        rest = FLAGS(argv)
        if len(rest) > 1:
            raise ValueError(f"unexpected arguments {' '.join(rest[1:])}: give settings as --name=value.")
        config = config_from_flags()
        config.validate()
    except flags.UnrecognizedFlagError as e:
        near = difflib.get_close_matches(e.flagname.removeprefix("no"), list(FLAGS), n=1, cutoff=0.75)
        near = "".join(f"; did you mean --{n}?" for n in near)
        _exit(f"--{e.flagname}{_flagfile_line(argv, e.flagname)}: no such flag{near} (--help lists them)")
    except flags.CantOpenFlagFileError as e:
        _exit(f"{str(e).removeprefix('ERROR:: ')} (the experiments' flagfiles are in flags/)")
    except UnicodeDecodeError as e:  # a ValueError: first
        _exit(_undecodable_flagfile(argv, e.encoding))
    except flags.IllegalFlagValueError as e:
        _exit(_unparsed_value(str(e)))
    except (flags.Error, ValueError) as e:
        _exit(str(e))
    return config


def run_training(config, extra_callbacks=()):
    from hvd_lars.training import train

    return (train.run_elastic if config.elastic else train.run)(config, extra_callbacks)


def _raised_here(error):
    """Bad input is what this package refuses (raised in hvd_lars/), not a ValueError of Keras or TF."""
    frames = [f.filename for f in traceback.extract_tb(error.__traceback__) if "<frozen" not in f.filename]
    return bool(frames) and os.path.abspath(frames[-1]).startswith(_PACKAGE + os.sep)


def _main(config):
    from hvd_lars import quiet_tensorflow

    quiet_tensorflow.load()  # before TensorFlow is imported: without its C++ start-up notices
    from hvd_lars.parallel import ompi_allreduce_rules
    from hvd_lars.parallel.collectives import WorldSizeMismatch
    from hvd_lars.training import faults

    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's checkpoint code logs every save at INFO
    ompi_allreduce_rules.apply()  # before Horovod starts MPI
    try:
        run_training(config)
    except FileNotFoundError as e:
        _exit(str(e), every_rank=True)  # a host's own data: every rank that misses it says so
    except faults.TrainingDiverged as e:
        _exit(str(e), faults.EXIT_DIVERGED)
    except (ValueError, ImportError, WorldSizeMismatch, faults.FileFailure) as e:
        if not _raised_here(e):
            raise
        _exit(str(e))  # bad input, a missing optional package, a failed write: every rank meets it alike
    except faults.Preempted as e:  # not an error: start it again (launch/slurm/train.sbatch requeues it)
        log.info(str(e), extra={"every_rank": True})
        sys.exit(faults.EXIT_PREEMPTED)


def _exit(message, status=EXIT_BAD_INPUT, every_rank=False):
    log.error(message, extra={"every_rank": every_rank})
    sys.exit(status)


def _unparsed_value(message):
    """absl's "flag --name=value: <its parser's words>" in the one wording, with what the flag accepts."""
    match = re.match(r"flag --(\w+)=(.*?): ", message, re.S)
    field = next((f for f in dataclasses.fields(TrainConfig) if match and f.name == match[1]), None)
    if field is None:  # one of absl's own flags, or another of its forms ("--flagfile with no argument")
        return message
    name, value = match.groups()
    accepted = field.metadata["accepted"]
    if isinstance(accepted, arguments.Range):
        what = accepted.describe()
    elif isinstance(accepted, tuple):
        what = f"one of {', '.join(map(str, accepted))}"
    else:
        what = {bool: "true or false", int: "a whole number"}.get(field.type, "a number")
    return arguments.refusal(f"--{name}", value, what)


def _flagfiles(argv):
    """(path, bytes) of each flagfile `argv` names and of each one those name, in that order."""
    paths = [w.split("=", 1)[1] for w in argv if w.lstrip("-").startswith("flagfile=")]
    for path in paths:  # grows with the flagfiles each names
        data = pathlib.Path(path).read_bytes() if os.path.isfile(path) else b""
        yield path, data
        words = data.decode(errors="replace").split()
        paths += [w[11:] for w in words if w.startswith("--flagfile=") and w[11:] not in paths]


def _undecodable_flagfile(argv, encoding):
    """Where the first flagfile of `argv` (or one it names) fails to decode as `encoding`."""
    for path, data in _flagfiles(argv):
        try:
            data.decode(encoding)
        except UnicodeDecodeError as e:
            line, column = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start)
            return (
                f"--flagfile={path}: line {line} is not {encoding} text (byte {data[e.start]:#04x} at column "
                f"{column}); save the file as {encoding}."
            )
    return f"a flagfile is not {encoding} text."


def _flagfile_line(argv, name):
    """' (line N of --flagfile=PATH)' where a flagfile of `argv` (or one it names) sets --`name`, else ''."""
    for path, data in _flagfiles(argv):
        for number, line in enumerate(data.decode(errors="replace").splitlines(), start=1):
            if re.fullmatch(rf"--{re.escape(name)}(=.*)?", line.strip()):
                return f" (line {number} of --flagfile={path})"
    return ""


def main():
    app.run(_main, flags_parser=parse)


if __name__ == "__main__":
    main()
