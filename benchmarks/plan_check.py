"""plan.py against what it predicts: published runs (tests/plan_published.json: torchtitan's
Llama 3.1 on H100s, BLOOM-176B's layout tests and Narayanan et al. 2021's Table 1, GPT 1.7 B
to 1 T, on A100s) and this project's counted runs
(nd_costs.py at 8 CPU processes), one point each, predicted over published; a table of the
errors beside. Draws benchmarks/plan.png (matplotlib, requirements-dev.txt).

    python benchmarks/plan_check.py                 # the table, and benchmarks/plan.png
    python benchmarks/plan_check.py --no-picture    # the table only (no matplotlib needed)
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import plan  # noqa: E402

COLORS = {"torchtitan": "tab:blue", "BLOOM-176B": "tab:orange", "Narayanan": "tab:purple"}
LABELS = {
    "torchtitan": "torchtitan Llama 3.1, H100 (filled: a row fitted, here)",
    "BLOOM-176B": "BLOOM-176B layout tests, A100 (same)",
    "Narayanan": "Narayanan et al. 2021, GPT on A100 (same)",
}
DATA = json.loads((ROOT / "tests" / "plan_published.json").read_text())
MEMORY_FITTED = {r["name"]: r.get("memory_fitted") for r in DATA["rows"]}


def published():
    """(name, fitted, throughput predicted, published, memory predicted, published) a row:
    throughput in tokens/s a GPU (BLOOM's seconds a step turned into them)."""
    out = []
    for r in DATA["rows"]:
        args, m, hw, (p,) = plan.run(r["argv"])
        tokens = args.global_batch * m["seq_len"] / hw["gpus"]
        got = p["tokens_per_second_per_gpu"]
        want = r.get("tokens_per_second_per_gpu") or tokens / r["step_seconds"]
        out.append((r["name"], r["fitted"], got, want, p["memory_gib"], r.get("memory_gib")))
    return out


def counted():
    """(layout, memory predicted, measured peak) of nd_costs.py's runs, MiB."""
    rows = DATA["measured_cpu"]["rows"]
    return [(r, plan.run(r["argv"])[3][0]["memory_gib"] * 1024, r["peak"]) for r in rows]


def draw(rows, cpu, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    panels = [
        (axes[0], [(r[3], r[2], r) for r in rows], 0.15, "tokens/s a GPU"),
        (axes[1], [(r[5], r[4], r) for r in rows if r[5]], 0.20, "memory a GPU, GiB"),
    ]
    for ax, points, band, unit in panels:
        lo, hi = 0.5 * min(min(p[:2]) for p in points), 2 * max(max(p[:2]) for p in points)
        if unit.startswith("memory"):
            lo = min(lo, 0.5 * min(c[2] for c in cpu) / 1024)
            for _, got, want in cpu:  # MiB, drawn as GiB: one scale
                ax.scatter(want / 1024, got / 1024, marker="x", color="gray", zorder=3)
            ax.scatter([], [], marker="x", color="gray", label="nd_costs.py, 8 CPU processes")
        xs = [lo, hi]
        ax.plot(xs, xs, color="black", lw=1)
        ax.fill_between(xs, [x * (1 - band) for x in xs], [x * (1 + band) for x in xs],
                        color="tab:green", alpha=0.15, label=f"within {band:.0%}")  # fmt: skip
        for want, got, r in points:
            kind = COLORS[r[0].split()[0]]
            fit = r[1] if unit.startswith("tokens") else MEMORY_FITTED[r[0]]
            ax.scatter(want, got, color=kind, marker="o" if fit else "s", zorder=4,
                       facecolors=kind if fit else "none")  # fmt: skip
        for source, kind in COLORS.items():
            if any(r[0].startswith(source) for *_, r in points):
                ax.scatter([], [], color=kind, label=LABELS[source])
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
        ax.set(xlabel=f"published {unit}", ylabel=f"plan.py's {unit}")
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_title("Throughput: plan.py against published runs (band 15%)")
    axes[1].set_title("Memory: against published runs (20%) and counted ones (10%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--picture", action=argparse.BooleanOptionalAction, default=True,
                   help="draw benchmarks/plan.png")  # fmt: skip
    args = p.parse_args()
    rows, cpu = published(), counted()
    print("| run | fitted | tokens/s a GPU: plan.py / published | error | GiB: plan.py / "
          "published | error |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, fitted, got, want, mem, mem_want in rows:
        marks = ["yes" if fitted is True else "x0" if fitted else ""]
        fitted = ", ".join(filter(None, [*marks, "reserve" * bool(MEMORY_FITTED[name])]))
        print(
            f"| {name} | {fitted} | {got:,.0f} / {want:,.0f} | "
            f"{got / want - 1:+.1%} | {mem:.1f} / {mem_want or '-'} | "
            + (f"{mem / mem_want - 1:+.1%} |" if mem_want else "|")
        )
    for r, got, want in cpu:
        layout = " x ".join(str(r[k]) for k in ("pp", "dp", "cp", "tp"))
        print(
            f"| nd_costs.py {layout} (pp x dp x cp x tp), CPU | | | | {got:.1f} / {want} MiB"
            f" | {got / want - 1:+.1%} |"
        )
    if args.picture:
        draw(rows, cpu, ROOT / "benchmarks" / "plan.png")
        print("wrote benchmarks/plan.png")


if __name__ == "__main__":
    main()
