"""The code of README.md and docs/*.md runs as a reader would run it.

- Every Python block runs, on its own or after the preamble its marker names (`<!-- test: preamble=NAME
  ranks=N -->` above the fence; checks/readme_preambles.py holds each preamble, what the block
  assumes, and what is checked after it), under horovodrun on N ranks when the marker says so.
- Every command of the README's set-up, training and cluster sections (`RUN_SECTIONS`) is run as written
  by a test named in `RUNS` (with the small data and flags a test needs appended), or listed in `NOT_RUN`
  with the reason; a command added to those sections without either fails
  `test_every_command_of_the_run_sections_is_run_or_excused`.
- Every other command of the README and docs is checked: its script, Makefile target and variables,
  module, flagfile and flags exist and parse (`check_command`).
"""

import ast
import json
import os
import re
import shlex
import subprocess

import pytest

from checks import readme
from checks.readme_preambles import PREAMBLES
from tests.support import REPO

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"

# The README's sections whose commands run in tests as written.
RUN_SECTIONS = ("Two commands", "On a cluster (no root, the cluster's MPI and Python)", "Running")

# command as written -> the test that runs it (tests/<file>::<function>).
RUNS = {
    "make train": "checks/test_readme_code.py::test_make_train_as_written_reaches_the_data_dir",
    "FASHION_MNIST_DIR=$HOME/data/fashion-mnist bash install/setup.sh": (
        "checks/test_readme_code.py::test_cluster_setup_command_as_written"
    ),
    "launch/mpirun.sh localhost 2 flags/fashion_mnist_lars.flags --data_dir=$HOME/data/fashion-mnist": (
        "checks/test_readme_code.py::test_first_cluster_command_as_written"
    ),
    "sbatch --nodes=2 --ntasks-per-node=2 launch/slurm/train.sbatch flags/fashion_mnist_lars.flags "
    "--data_dir=$HOME/data/fashion-mnist": (
        "checks/test_readme_code.py::test_readme_cluster_sbatch_command_on_two_emulated_nodes"
    ),
    ".venv/bin/horovodrun -np 2 -H localhost:2 .venv/bin/python -m hvd_lars.main "
    "--flagfile=flags/fashion_mnist_lars.flags": (
        "checks/test_readme_code.py::test_running_commands_as_written"
    ),
    ".venv/bin/python -m hvd_lars.main --flagfile=flags/smoke.flags": (
        "checks/test_readme_code.py::test_running_commands_as_written"
    ),
}
# command as written -> why no test runs it (each is still checked by `check_command` where it can be).
NOT_RUN = {
    "make test": "the test suite itself (.ci/run runs it)",
    "make test-quick": "the unit tier of this very suite",
    "make check-docs": "these very checks (.ci/run runs it)",
    "module load gcc openmpi python/3.11": "environment modules are a cluster's; this machine has none",
    "git clone <this repository> hvd_lars && cd hvd_lars": "the checkout the tests run in",
}

# The appended flags that make a Fashion-MNIST run of the README small: 4,096 training images (1 update
# per epoch at the flagfile's global batch), 2 epochs, 1,000 test images.
SMALL_FASHION_MNIST = ["--max_train_examples=4096", "--epochs=2", "--max_eval_examples=1000"]


# ------------------------------------------------------------------------------------------ Python blocks


def _python_blocks():
    # A block marked `backend=every` runs on each Keras backend in tests/test_every_backend.py.
    blocks = [b for path in readme.documents() for b in readme.blocks(path) if b.lang == "python"]
    return [b for b in blocks if "backend" not in b.marker]


def _block_id(block):
    return f"{block.path}:{block.line}"


@pytest.mark.unit
def test_python_blocks_name_known_preambles_and_hold_no_ellipsis():
    for block in _python_blocks():
        name = block.marker.get("preamble")
        assert name is None or name in PREAMBLES, f"{_block_id(block)}: unknown preamble {name!r}"
        tree = ast.parse(block.text, _block_id(block))
        dots = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value is Ellipsis]
        assert not dots, f"{_block_id(block)}: `...` where a reader needs a value (block lines {dots})"


@pytest.mark.horovod
@pytest.mark.parametrize("block", _python_blocks(), ids=_block_id)
def test_python_block_runs(block, tmp_path):
    preamble = PREAMBLES[block.marker["preamble"]] if "preamble" in block.marker else None
    source = (preamble.before if preamble else "") + block.text + (preamble.after if preamble else "")
    script = tmp_path / "block.py"
    script.write_text(source)
    ranks = int(block.marker.get("ranks", 1))
    python = os.path.join(REPO, ".venv", "bin", "python")
    cmd = [python, str(script)]
    if ranks > 1:
        cmd = [
            os.path.join(REPO, ".venv", "bin", "horovodrun"),
            "-np",
            str(ranks),
            "-H",
            f"localhost:{ranks}",
            *cmd,
        ]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (
        f"{_block_id(block)}\n{source}\n" + result.stdout[-3000:] + result.stderr[-4000:]
    )
    if preamble and preamble.expect:
        assert result.stdout.count(preamble.expect) == ranks, result.stdout[-3000:]


# ------------------------------------------------------------------------------------ commands, checked


def _shell_commands(sections=None):
    found = []
    for path in readme.documents():
        for block in readme.blocks(path):
            if block.lang not in ("sh", "bash"):
                continue
            if sections is not None and (path != "README.md" or block.section not in sections):
                continue
            found += [(f"{path}:{block.line}", c) for c in readme.commands(block)]
    return found


@pytest.mark.unit
def test_every_command_of_the_run_sections_is_run_or_excused():
    commands = [c for _, c in _shell_commands(RUN_SECTIONS)]
    assert commands, "no commands found in the run sections: renamed?"
    missing = [c for c in commands if c not in RUNS and c not in NOT_RUN]
    assert not missing, f"commands of {RUN_SECTIONS} no test runs (add to RUNS or NOT_RUN): {missing}"
    stale = sorted((set(RUNS) | set(NOT_RUN)) - set(commands))
    assert not stale, f"RUNS or NOT_RUN name commands the README no longer has: {stale}"
    for command, test in RUNS.items():
        path, function = test.split("::")
        with open(os.path.join(REPO, path)) as f:
            assert re.search(rf"^def {function}\(", f.read(), re.M), f"{test} (runs {command!r}) not found"


@pytest.mark.unit
@pytest.mark.parametrize("where, command", _shell_commands(), ids=lambda x: x if ":" in str(x) else None)
def test_command_exists_and_parses(where, command):
    assert check_command(command) == [], f"{where}: {command}"


# The programs a command may start that are not this project's: nothing of theirs to check.
EXTERNAL = {
    "pip", "tar", "sed", "module", "git", "ssh", "printf", "echo", "cat", "cd", "chmod", "tensorboard",
    "conda", "apt-get",
}  # fmt: skip


def check_command(command):
    """What is wrong with a README/docs command: scripts, Makefile targets and variables, modules,
    flagfiles and the main program's flags that do not exist or do not parse; [] when nothing is."""
    lexer = shlex.shlex(command.replace("$HOME", "/home/user").replace("$PWD", REPO), posix=True,
                        punctuation_chars=";&|>")  # fmt: skip
    lexer.whitespace_split = True
    problems, words, tokens = [], [], list(lexer) + [";"]
    for i, token in enumerate(tokens):
        if token in (";", "&&", "||", "|", "&"):
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words.pop(0)  # VAR=value before the program
            if words and words[0] == "sudo":
                words.pop(0)
            if words:
                problems += _check_words(words)
            words = []
        elif token in (">", ">>") or (i and tokens[i - 1] in (">", ">>")):
            continue  # a redirection and its target
        else:
            words.append(token)
    return problems


def _check_words(words):
    program = words[0]
    if program == "make":
        return _check_make(words[1:])
    if program in ("bash", "sh"):
        return _check_words(words[1:])
    if program == "sbatch":
        script = next((w for w in words[1:] if not w.startswith("-") and w != "..."), None)
        if script is None:
            return [f"sbatch without a script: {words}"]
        rest = words[words.index(script) + 1 :]
        problems = _exists(script)
        if rest and rest[0] != "...":
            problems += _check_main_flags(rest[0], rest[1:], world_size=_sbatch_world(words))
        return problems
    if program.endswith("horovodrun") and "--check-build" in words:
        return []
    if program.endswith("horovodrun"):
        np_ = int(words[words.index("-np") + 1]) if "-np" in words else 1
        return _check_python(words[words.index(next(w for w in words if w.endswith("python"))) :], np_)
    if program.endswith("python") or program.endswith("python3"):
        return _check_python(words, 1)
    if program.startswith("hvd-lars-"):
        return _check_console_script(program)
    if program.startswith(("launch/", "install/", "./launch/", "./install/")):
        return _check_launch(words)
    if program in EXTERNAL or program.startswith("./"):
        return []
    return [f"unknown program {program!r}: not this project's and not in EXTERNAL"]


def _exists(path):
    return [] if os.path.exists(os.path.join(REPO, path)) else [f"{path} does not exist"]


def _check_make(args):
    with open(os.path.join(REPO, "Makefile")) as f:
        makefile = f.read()
    problems = []
    for arg in args:
        if "=" in arg:
            name = arg.split("=", 1)[0]
            if not re.search(rf"^{name} \??=", makefile, re.M):
                problems.append(f"Makefile has no variable {name}")
        elif not re.search(rf"^{re.escape(arg)}:", makefile, re.M):
            problems.append(f"Makefile has no target {arg}")
    return problems


def _check_launch(words):
    script = words[0].removeprefix("./")
    problems = _exists(script)
    if problems:
        return problems
    name = os.path.basename(script)
    positional = {"mpirun.sh": 2, "horovodrun.sh": 2, "elastic.sh": 3}
    if name in positional:
        n = positional[name]
        if len(words) < n + 2:
            return [f"{script} needs {n} arguments and a flagfile: {words}"]
        ranks = words[n] if name != "elastic.sh" else words[3]
        return _check_main_flags(words[n + 1], words[n + 2 :], world_size=int(ranks))
    if name == "emulated_cluster.sh":
        return [] if words[1:2] and words[1] in ("up", "down", "status") else [f"{script}: {words[1:]}"]
    return []


def _sbatch_world(words):
    def option(name, default):
        for w in words:
            if w.startswith(f"--{name}="):
                return int(w.split("=", 1)[1])
        return default

    return option("nodes", 1) * option("ntasks-per-node", 2)


def _check_python(words, world_size):
    if len(words) < 3 or words[1] != "-m":
        return [f"not a `python -m MODULE` command: {words}"]
    module = words[2]
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return [f"no module {module}"]
    if module == "hvd_lars.main":
        flagfile = next((w.split("=", 1)[1] for w in words[3:] if w.startswith("--flagfile=")), None)
        rest = [w for w in words[3:] if not w.startswith("--flagfile=")]
        return _check_main_flags(flagfile, rest, world_size)
    return []


def _check_console_script(program):
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    scripts = dict(
        (line.split("=")[0].strip(), line.split("=")[1].strip())
        for line in config["options.entry_points"]["console_scripts"].strip().splitlines()
    )
    if program not in scripts:
        return [f"setup.cfg declares no console script {program}"]
    import importlib.util

    module = scripts[program].split(":")[0]
    return [] if importlib.util.find_spec(module) else [f"{program}: no module {module}"]


def _check_main_flags(flagfile, flags, world_size):
    """The main program's flags, parsed as absl parses them (a fresh FlagValues), then validated for the
    command's world size."""
    from absl import flags as absl_flags

    from hvd_lars import main

    if flagfile is None:
        args = []
    else:
        if not os.path.exists(os.path.join(REPO, flagfile)):
            return [f"flagfile {flagfile} does not exist"]
        args = [f"--flagfile={os.path.join(REPO, flagfile)}"]
    if "..." in flags:
        flags = flags[: flags.index("...")]
    values = absl_flags.FlagValues()
    main.define_flags(flag_values=values)
    try:
        values(["hvd-lars-train", *args, *flags])
        config = main.config_from_flags(values)
        config.validate()
        config.resolve_batch(world_size)
    except (absl_flags.Error, ValueError) as e:
        return [f"flags {args + flags}: {e}"]
    return []


@pytest.mark.unit
@pytest.mark.parametrize(
    "command, problem",
    [
        ("launch/mpirun.sh localhost 2 flags/nope.flags", "flagfile flags/nope.flags does not exist"),
        ("launch/mpirun.sh localhost 2 flags/smoke.flags --no_such_flag=1", "no_such_flag"),
        ("make trian", "Makefile has no target trian"),
        ("make train DATADIR=/x", "Makefile has no variable DATADIR"),
        (".venv/bin/python -m hvd_lars.nope", "no module hvd_lars.nope"),
        ("launch/nope.sh x", "launch/nope.sh does not exist"),
        ("launch/mpirun.sh localhost 3 flags/smoke.flags", "does not divide by the world size 3"),
        ("frobnicate --now", "unknown program"),
    ],
)
def test_check_command_finds_what_a_reader_would_trip_on(command, problem):
    problems = check_command(command)
    assert problems and problem in " ".join(problems), problems


# ---------------------------------------------------------------------------------- commands, run as written


@pytest.fixture
def home(tmp_path):
    """A $HOME whose data/fashion-mnist holds the four Fashion-MNIST files (links to Debian's), as the
    README's cluster section has the user put them."""
    folder = tmp_path / "home" / "data" / "fashion-mnist"
    folder.mkdir(parents=True)
    for name in os.listdir(FASHION_MNIST):
        os.symlink(os.path.join(FASHION_MNIST, name), folder / name)
    return tmp_path / "home"


def _run_as_written(command, appended, env, timeout=900):
    """Runs the README's `command` through bash in the repository root, with `appended` words added."""
    line = command + "".join(" " + shlex.quote(a) for a in appended)
    return subprocess.run(
        ["bash", "-c", line], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env=dict({k: v for k, v in os.environ.items() if k not in ("RANKS_PER_SOCKET", "THREADS_PER_RANK")},
                 **env),
    )  # fmt: skip


def _summary(workdir, run_name):
    with open(os.path.join(workdir, run_name, "summary.json")) as f:
        return json.load(f)


@pytest.mark.horovod
def test_make_train_as_written_reaches_the_data_dir(home, tmp_path):
    data = home / "data" / "fashion-mnist"
    workdir, record = tmp_path / "runs", tmp_path / "record.md"
    flags = " ".join(SMALL_FASHION_MNIST)
    result = _run_as_written(
        "make train",
        [f"DATA_DIR={data}", f"WORKDIR={workdir}", f"RECORD={record}", f"TRAIN_FLAGS={flags}"],
        {"HOME": str(home)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = _summary(workdir, "fashion_mnist_lars_b4096")
    assert summary["config"]["data_dir"] == str(data) and summary["world_size"] == 2
    assert summary["plan"]["total_steps"] == 2 and summary["final_test_top1"] is not None
    assert f"DATA_DIR={data}" in record.read_text()  # the record names the command as it was run
    # A folder without the files: the set-up refuses, naming it, before anything runs.
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run_as_written("make train", [f"DATA_DIR={empty}", f"WORKDIR={workdir}"], {"HOME": str(home)})
    assert result.returncode != 0 and f"in {empty}" in result.stderr, result.stderr[-2000:]


@pytest.mark.horovod
def test_cluster_setup_command_as_written(home):
    command = readme.find_command("README.md", RUN_SECTIONS[1], "FASHION_MNIST_DIR=")
    result = _run_as_written(command, [], {"HOME": str(home)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[setup] ready:" in result.stdout


@pytest.mark.horovod
def test_first_cluster_command_as_written(home, tmp_path):
    # On this one-socket machine, with no placement exported (PPR 1:socket would refuse 2 ranks).
    command = readme.find_command("README.md", RUN_SECTIONS[1], "launch/mpirun.sh localhost 2")
    result = _run_as_written(command, [*SMALL_FASHION_MNIST, f"--workdir={tmp_path}"], {"HOME": str(home)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = _summary(tmp_path, "fashion_mnist_lars_b4096")
    assert summary["world_size"] == 2 and summary["config"]["data_dir"] == str(
        home / "data" / "fashion-mnist"
    )
    assert summary["threads"]["cores_per_rank"] == [[c] for c in sorted(os.sched_getaffinity(0))[:2]]


@pytest.mark.horovod
def test_running_commands_as_written(tmp_path):
    two = readme.find_command("README.md", "Running", ".venv/bin/horovodrun -np 2")
    result = _run_as_written(two, [*SMALL_FASHION_MNIST, f"--workdir={tmp_path}"], {})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _summary(tmp_path, "fashion_mnist_lars_b4096")["world_size"] == 2
    one = readme.find_command("README.md", "Running", ".venv/bin/python -m hvd_lars.main")
    result = _run_as_written(one, [f"--workdir={tmp_path}"], {})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = _summary(tmp_path, "smoke")
    assert summary["world_size"] == 1 and summary["plan"]["total_steps"] == 6


@pytest.mark.system
def test_readme_cluster_sbatch_command_on_two_emulated_nodes(cluster, slurm, shared_dir):
    """The README's `sbatch --nodes=2 --ntasks-per-node=2 launch/slurm/train.sbatch flags/fashion_mnist_lars
    .flags --data_dir=$HOME/data/fashion-mnist`, as written: its $HOME holds the Fashion-MNIST
    files, the flags that make the run small are appended, and Slurm's output goes to the run's folder
    (SBATCH_OUTPUT, which overrides the script's #SBATCH line). 4 ranks on node1 and node2, placed by
    train.sbatch itself (no placement exported)."""
    command = readme.find_command("README.md", RUN_SECTIONS[1], "sbatch --nodes=2")
    data = shared_dir / "home" / "data" / "fashion-mnist"
    data.mkdir(parents=True)
    for name in os.listdir(FASHION_MNIST):
        os.symlink(os.path.join(FASHION_MNIST, name), data / name)
    line = " ".join([command, *SMALL_FASHION_MNIST, f"--workdir={shared_dir}", "--intra_op_threads=1"])
    env = {k: v for k, v in slurm.env.items() if k not in ("RANKS_PER_SOCKET", "THREADS_PER_RANK")}
    env.update(HOME=str(shared_dir / "home"), SBATCH_OUTPUT=str(shared_dir / "slurm-%j.out"))
    submitted = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.split()[-1]  # "Submitted batch job N"
    state = slurm.wait(job, timeout=600)
    log = (shared_dir / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    summary = json.loads((shared_dir / "fashion_mnist_lars_b4096" / "summary.json").read_text())
    assert summary["hosts"] == ["node1", "node2"] and summary["world_size"] == 4
    assert summary["config"]["data_dir"] == str(data) and summary["plan"]["total_steps"] == 2
