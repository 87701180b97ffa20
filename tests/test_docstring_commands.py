"""Every command in every script's docstring runs, in its smallest form.

A reader copies these commands first; one that stops ("folder runs/q does not exist") is the
first thing they see. Each script's commands run in their order, in one fresh folder (so
`runs/ddp/checkpoint.pt` is the one the command before wrote), as real processes on the CPU:
synthetic data, one epoch of two steps where the script takes those flags, every torchrun
command on one node with 2 processes (4 where --dp or --replicate asks for 2 groups of 2;
nd_parallel.py's with all the processes it names, its mesh's; forked as torchrun's workers
unless torchrun is given options of its own: see run()),
`cuda:N` devices as the CPU, DIR as a small folder of images. A file a command reads that no
command before it writes (an earlier run's checkpoint.pt or model.pt) is made first by the
same script's smallest run.

The quick test reads the commands and passes each one's flags through its script's argument
checks; the slow one runs them.
"""

import argparse
import ast
import importlib
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, clean_env, communicate, popen, torchrun_workers

SHARED = {"common.py", "models.py", "data.py", "checkpoint.py", "training.py", "profiling.py"}
SCRIPTS = sorted(p.name for p in ROOT.glob("*.py") if p.name not in SHARED)
# Flags set to their smallest value wherever a script takes them, and those left alone.
SMALL = {"--epochs": "1", "--max-steps": "2", "--qat-steps": "2", "--runs": "1"}
# model_parallel.py's one stage per process (its torchrun commands) needs PyTorch 2.10.
PIPELINING = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 10)
TORCHRUN_DROP = ("--nnodes", "--nproc_per_node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id")


def docstring_commands(script):
    """(script run, its arguments, torchrun's processes or None) for each command line."""
    doc = ast.get_docstring(ast.parse((ROOT / script).read_text())) or ""
    for line in doc.replace("\\\n", " ").splitlines():
        line = re.sub(r"^\s*([A-Z_]+=\S*\s+)*", "", line)  # CUDA_VISIBLE_DEVICES=0,1
        if not re.match(r"(python3?|torchrun) ", line):
            continue
        words = shlex.split(line.split(" #")[0])
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if at is None:  # prose that starts with "torchrun"
            continue
        nproc = None
        if words[0] == "torchrun":
            options = dict(w.split("=", 1) for w in words[1:at] if "=" in w)
            groups = next(
                (
                    words[i + 1]
                    for i in range(at, len(words) - 1)
                    if words[i] in ("--dp", "--replicate")
                ),
                "1",
            )
            nproc = 2 * int(groups)
            if words[at] == "nd_parallel.py":  # its mesh is the processes it names, all
                nproc = int(options["--nproc_per_node"]) * int(options.get("--nnodes", 1))
            kept = [w for w in words[1:at] if not w.startswith(TORCHRUN_DROP)]
            assert options.get("--nproc_per_node"), line
            yield words[at], [*kept, "|", *words[at + 1 :]], nproc
        else:
            yield words[at], ["|", *words[at + 1 :]], None


def smallest(script, argv, images):
    """The command's own flags, shrunk, plus the smallest data and device the script takes."""
    source = (ROOT / script).read_text()
    if "sharded_parser(" in source:  # the sharded scripts' shared flags are training.py's
        source += (ROOT / "training.py").read_text()
    takes = lambda flag: f'"{flag}"' in source  # noqa: E731 - its add_argument names it
    launcher, flags = argv[: argv.index("|")], argv[argv.index("|") + 1 :]
    flags = ["cpu" if re.fullmatch(r"cuda(:\d+)?(,cuda(:\d+)?)*", f) else f for f in flags]
    flags = [",".join("cpu" for _ in f.split(",")) if f == "cpu" else f for f in flags]
    flags = [str(images) if f == "DIR" else f for f in flags]
    out = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        if flag in SMALL and i + 1 < len(flags):
            out += [flag, SMALL[flag]]
            i += 2
            continue
        out.append(flag)
        i += 1
    # A named image data set becomes the synthetic one; text, a small corpus (the GPT's data:
    # context_parallel.py's and nd_parallel.py's default, or --data text).
    out = ["synthetic" if f in ("fashion-mnist", "mnist", "cifar10") else f for f in out]
    given = set(out)
    extra = [(f, v) for f, v in SMALL.items() if f not in given and takes(f)]
    on_text = ("context_parallel.py", "nd_parallel.py")  # text by default
    text = "text" in given or (script in on_text and "vit" not in given)
    if text:
        corpus = Path(images).parent / "corpus.txt"
        if not corpus.exists():  # 16,000 bytes of UTF-8 text
            corpus.write_bytes(Path(argparse.__file__).read_bytes()[:16000])
        extra += [("--data-dir", str(corpus)), ("--seq-len", "32")]
    elif "--data" not in given and takes("--data"):
        extra.append(("--data", "synthetic"))
    if takes("--device"):
        extra.append(("--device", "cpu"))
    if script == "finetune.py":  # no download of ImageNet weights; a ResNet at its smallest
        if "--weights-file" not in given:
            extra.append(("--weights", "none"))
        if "--image-size" not in given:
            extra.append(("--image-size", "32"))
    return launcher, out + [w for pair in extra for w in pair]


def files_read(flags):
    """The .pt files a command reads (not the folders it writes)."""
    return [
        Path(v)
        for f, v in zip(flags, flags[1:], strict=False)
        if v.endswith(".pt") and f not in ("--export",)
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_docstring_flags_pass_the_checks(no_launcher, script, tmp_path):
    """Each docstring command's flags, in their smallest form, pass the argument checks of the
    script it runs (a flag renamed or dropped shows here in seconds)."""
    commands = list(docstring_commands(script))
    assert commands, f"{script}'s docstring has no command to launch it"
    for name, argv, _ in commands:
        _, flags = smallest(name, argv, tmp_path)
        importlib.import_module(name.removesuffix(".py")).get_args(flags)


def image_folder(root):
    """Two classes of 16x16 PNGs, train/ and val/ (what --data imagefolder reads): 64 a class,
    a whole default batch (finetune.py's 64) for each of 2 processes."""
    from PIL import Image

    for split, count in (("train", 64), ("val", 4)):
        for c, colour in enumerate([(200, 30, 30), (30, 200, 30)]):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (16, 16), colour).save(root / split / f"c{c}" / f"{i}.png")
    return root


def run(cwd, launcher, nproc, script, flags):
    """The command in `cwd`. A torchrun command without options of torchrun's own runs as its
    nproc workers forked under torchrun's variables (conftest.torchrun_workers: what they
    compute is the same; a launch costs 0.5 s instead of 4-5 s, and 8 fresh workers' imports
    cost 20 s here); one with them (--max-restarts=3) runs under real torchrun."""
    cmd = [sys.executable, str(ROOT / script), *flags]
    if nproc and set(launcher) <= {"--standalone"}:
        torchrun_workers(nproc, cmd[1:], timeout=600, cwd=cwd)
        return
    if nproc:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", *launcher]
        cmd.insert(4 + len(launcher), f"--nproc_per_node={nproc}")
    proc = communicate(popen(cmd, cwd, clean_env(PYTHONPATH=str(ROOT))), timeout=600)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_docstring_commands_run(script, tmp_path):
    images = image_folder(tmp_path / "images")
    cwd = tmp_path / "work"
    cwd.mkdir()
    done = set()
    for name, argv, nproc in docstring_commands(script):
        if nproc and name == "model_parallel.py" and not PIPELINING:
            continue  # one stage per process: refused before PyTorch 2.10 (tested)
        launcher, flags = smallest(name, argv, images)
        # run() adds --standalone to every torchrun command: a multi-node line, on one node,
        # is often the same run as a line above it. So is a line whose flags parse to the same
        # arguments (ddp_mp_spawn.py's default --nprocs is --nprocs 2 on a CPU): its script
        # parses it here, and running it again would add 2 fresh interpreters, nothing more.
        parsed = vars(importlib.import_module(name.removesuffix(".py")).get_args(flags))
        launched = (name, nproc, frozenset(launcher) - {"--standalone"})
        if (command := (*launched, repr(sorted(parsed.items())))) in done:
            continue
        done.add(command)
        for path in files_read(flags):
            if not (cwd / path).exists():  # an earlier run's file: made by the smallest run
                _, made = smallest(name, ["|"], images)
                where = ["--output-dir", str(path.parent)] if path.name == "checkpoint.pt" else []
                where = where or ["--export", str(path)]
                run(cwd, [], None, name, [*made, *where])
        run(cwd, launcher, nproc, name, flags)


def test_commands_are_found():
    """The reader above finds what it should: the launcher, the script, the processes."""
    found = {s: list(docstring_commands(s)) for s in ("ddp_train.py", "quantize.py")}
    assert [n for _, _, n in found["ddp_train.py"]] == [None, 2, 2, 2]
    names = [name for name, _, _ in found["quantize.py"]]
    assert names[:2] == ["ddp_train.py", "quantize.py"] and "fsdp_train.py" in names


@pytest.mark.parametrize("script", SCRIPTS)
def test_docstring_is_at_most_25_lines(script):
    """A script's docstring is its launch recipes and what to know before them: 25 lines at
    most, counted as Python's help() shows it (ast.get_docstring)."""
    doc = ast.get_docstring(ast.parse((ROOT / script).read_text())) or ""
    assert len(doc.splitlines()) <= 25, (script, len(doc.splitlines()))


def test_ci_installs_with_the_readme_setup_line():
    """README's Quickstart installs with one line, and .ci/run runs that line word for word:
    CI proves that it installs everything the test command needs."""
    readme = (ROOT / "README.md").read_text().splitlines()
    setup = next(ln.split("#")[0].strip() for ln in readme if "-m pip install" in ln)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert setup in ci, setup
    assert 'python3 -m pytest -m "not slow" tests' in "\n".join(readme)


def imports(name, found=None):
    """The project's modules that module `name` imports, directly or through another."""
    found = set() if found is None else found
    for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module] if isinstance(node, ast.ImportFrom) else []
        for module in names:
            if f"{module}.py" in SHARED and module not in found:
                found.add(module)
                imports(module, found)
    return found


def readme_copy_table():
    """README's "Copying a script" table: script -> the files its row names."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Copying a script", 1)[1].split("\n## ", 1)[0]
    rows = [ln.split("|") for ln in section.splitlines() if ln.startswith("| `")]
    return {
        script: set(re.findall(r"`(\w+\.py)`", files))
        for cells in rows
        for script in re.findall(r"`(\w+\.py)`", cells[1])
        for files in [cells[2]]
    }


@pytest.mark.parametrize(
    "script",
    [pytest.param(s, marks=[] if s == "ddp_train.py" else pytest.mark.slow) for s in SCRIPTS],
)
def test_each_script_runs_from_a_copy_with_the_files_readme_names(script, tmp_path):
    """README says which files a copy of each script needs: exactly the modules it imports
    (directly or through another). The script and those files alone, in an empty folder
    with nothing of the repository on the path, run: nothing else is needed."""
    needs = readme_copy_table()[script]
    assert needs == {f"{m}.py" for m in imports(script.removesuffix(".py"))}, script
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in [script, *needs]:
        shutil.copy(ROOT / name, copy / name)
    _, flags = smallest(script, ["|"], image_folder(tmp_path / "images"))
    env = clean_env()
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, script, *flags, "--output-dir", str(tmp_path / "out")]
    if script == "plan.py":  # arithmetic: it writes nothing
        cmd = cmd[:-2]
    if script == "ddp_mp_spawn.py":
        cmd += ["--nprocs", "1"]
    proc = communicate(popen(cmd, copy, env), timeout=300)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert sorted(p.name for p in copy.iterdir() if p.suffix == ".py") == sorted([script, *needs])
