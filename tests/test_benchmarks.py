"""The benchmark's GPU recipe (run_all.py, section e) runs only where CUDA is present, which
the machines that run these tests lack. Its flags still train here: the same recipe on CPU,
with synthetic data, a small batch, two steps and no torch.compile (tested on its own in
test_scripts.py), so a renamed flag or a broken combination shows before a GPU run."""

import importlib.util
import math

from conftest import ROOT, SYNTHETIC, read_metrics, run_python

spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
run_all = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_all)


def replace(flags, name, value):
    """flags with `name`'s value replaced (or the flag removed when value is None)."""
    out, i = [], 0
    while i < len(flags):
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flags[i] == name:
            if value is not None:
                out += [name, value]
            i += 2 if takes_value else 1
            continue
        out.append(flags[i])
        i += 1
    return out


def test_gpu_recipe_trains_on_cpu(tmp_path):
    flags = run_all.GPU_RECIPE
    assert {"--model", "--amp", "--augment", "--compile", "--channels-last"} <= set(flags)
    for name, value in (("--data", None), ("--download", None), ("--compile", None), ("--batch-size", "8")):
        flags = replace(flags, name, value)
    run_python(["ddp_train.py", *flags, *SYNTHETIC, "--max-steps", "2", "--output-dir", tmp_path])
    [record] = read_metrics(tmp_path)
    assert record["step"] == 2 and math.isfinite(record["test_loss"])
