"""Convergence of low-precision gradient wires: ``flatshard train`` on the embedded corpus under
each ``--comm.reduce`` (fp32, bf16, int8, fp8; int8 and fp8 with and without
``--comm.error_feedback``), seed fixed, at each world size; a table and a loss plot.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/bench_low_precision.py \
         [--worlds 2 4] [--steps 1000] [--settings fp32 bf16 int8 int8+ef fp8 fp8+ef] \
         [--seeds 0 1 2] [--runs-dir /tmp/lowp_runs] [--plot docs/low_precision.png] \
         [--summarize-only] [--timing ROUNDS] [-- EXTRA TRAIN ARGS]

Each (world, setting, seed) trains into ``RUNS_DIR/w{world}_{setting}`` (seed 0) or
``RUNS_DIR/w{world}_{setting}_s{seed}`` (one run at a time: the
timings share the box with nothing of ours). A run whose ``metrics.jsonl`` already reaches
``--steps`` is not repeated, so the command resumes an interrupted sweep, and
``--summarize-only`` rebuilds the table and plot from what is there. Reported per run: the final
training loss (mean of the last 20 steps), the last validation loss, the gradient bytes one
rank's reduction sends per step (what ``fs.comm_stats`` counts, from the model's parameter count:
docs/low_precision.md's table; the all-gathers, unchanged by ``--comm``, are left out), and the
median step time. With several seeds, a second table gives each setting's difference from fp32
*at the same seed* (the seed fixes the initialization and the data order, so the pairing removes
both), as the mean and the range over seeds, beside fp32's own spread over seeds. The tables go
to ``RUNS_DIR/table.md`` and stdout; the plot (matplotlib, imported only here; seed 0) to
``--plot``.

``--timing ROUNDS`` measures step time instead (``--steps`` short, e.g. 60): ROUNDS rounds, each
running every setting once in turn (interleaved, so a load that comes and goes on a shared box
falls on every setting alike), and reports per setting the median step time (steps after the
first 5, the warm-up) and its ratio to fp32's in the same round (median over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SETTINGS = {  # name -> train flags
    "fp32": ["--comm.reduce", "fp32"],
    "bf16": ["--comm.reduce", "bf16"],
    "int8": ["--comm.reduce", "int8", "--comm.error_feedback", "false"],
    "int8+ef": ["--comm.reduce", "int8", "--comm.error_feedback", "true"],
    "fp8": ["--comm.reduce", "fp8", "--comm.error_feedback", "false"],
    "fp8+ef": ["--comm.reduce", "fp8", "--comm.error_feedback", "true"],
}
BLOCK = 256  # comm/quantize.py's BLOCK (not imported: this script only launches the trainer)
BYTES_PER_PARAM = {  # the reduction's counted bytes per parameter (precision.reduce_dtype fp32)
    "fp32": 4.0,
    "bf16": 2.0,
    "int8": 1 + 4 / BLOCK,
    "fp8": 1 + 4 / BLOCK,
}


def run_dir(args, world: int, setting: str, seed: int) -> Path:
    suffix = f"_s{seed}" if seed else ""  # seed 0 keeps the single-seed sweep's names
    return Path(args.runs_dir) / f"w{world}_{setting}{suffix}"


def run_one(world: int, setting: str, seed: int, args, extra: list[str]) -> Path:
    out = run_dir(args, world, setting, seed)
    rows = _metrics(out)
    if rows and rows[-1]["step"] >= args.steps:
        return out  # done already
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", "--nproc", str(world),
           "--steps", str(args.steps), "--seed", str(seed), "--out", str(out),
           "--log.sample_tokens", "0", "--log.progress_bar", "false",
           "--checkpoint.every", "0", *SETTINGS[setting], *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)
    return out


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(world: int, setting: str, seed: int, out: Path, params: int | None) -> dict | None:
    rows = _metrics(out)
    if not rows:
        return None
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    kind = setting.split("+")[0]
    return {
        "world": world,
        "setting": setting,
        "seed": seed,
        "steps": rows[-1]["step"],
        "train": statistics.fmean(r["loss"] for r in rows[-20:]),
        "val": vals[-1] if vals else float("nan"),
        "bytes": BYTES_PER_PARAM[kind] * params if params else None,
        "step_s": statistics.median(r["step_time_s"] for r in rows[1:] or rows),
        "losses": [r["loss"] for r in rows],
    }


def table(results: list[dict]) -> str:
    lines = [
        "| world | setting | seed | steps | final train loss (last 20) | val loss"
        " | reduce bytes/step/rank | median step s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        size = f"{r['bytes']:,.0f}" if r["bytes"] else "?"
        lines.append(
            f"| {r['world']} | {r['setting']} | {r['seed']} | {r['steps']} | {r['train']:.4f}"
            f" | {r['val']:.4f}"
            f" | {size} | {r['step_s']:.3f} |"
        )
    return "\n".join(lines)


def paired_table(results: list[dict]) -> str:
    """Each setting against fp32 at the same (world, seed): mean and range over seeds of the
    relative difference of the final train and validation losses, in percent."""
    base = {(r["world"], r["seed"]): r for r in results if r["setting"] == "fp32"}
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in results:
        ref = base.get((r["world"], r["seed"]))
        if ref is None or r["steps"] != ref["steps"]:
            continue
        diff = (100 * (r["train"] / ref["train"] - 1), 100 * (r["val"] / ref["val"] - 1))
        groups.setdefault((r["world"], r["setting"]), []).append(diff)
    lines = [
        "| world | setting | seeds | train vs fp32, mean [min, max] %"
        " | val vs fp32, mean [min, max] % |",
        "|---:|---|---:|---|---|",
    ]
    for (world, setting), diffs in sorted(groups.items()):
        cells = [_spread([d[i] for d in diffs]) for i in (0, 1)]
        lines.append(f"| {world} | {setting} | {len(diffs)} | {cells[0]} | {cells[1]} |")
    for world in sorted({w for w, _ in base}):
        refs = [r for (w, _), r in base.items() if w == world]
        if len(refs) > 1:
            lines.append(_fp32_spread(world, refs))
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):+.2f} [{min(values):+.2f}, {max(values):+.2f}]"


def _fp32_spread(world: int, refs: list[dict]) -> str:
    """fp32's own spread over seeds: each seed's loss against the mean over seeds, in percent."""
    cells = []
    for key in ("train", "val"):
        mean = statistics.fmean(r[key] for r in refs)
        cells.append(_spread([100 * (r[key] / mean - 1) for r in refs]))
    return f"| {world} | fp32 over seeds (vs its mean) | {len(refs)} | {cells[0]} | {cells[1]} |"


def plot(results: list[dict], path: str) -> None:
    import matplotlib  # lazy: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in results})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        for r in (r for r in results if r["world"] == world and r["seed"] == 0):
            smooth = [statistics.fmean(r["losses"][max(0, i - 19) : i + 1])
                      for i in range(len(r["losses"]))]  # fmt: skip
            ax.plot(range(1, len(smooth) + 1), smooth, label=r["setting"], linewidth=1)
        ax.set(title=f"world {world}", xlabel="step", ylabel="train loss (20-step mean)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _count_params(args, extra: list[str]) -> int | None:
    """The parameter count the trainer prints (``model: ..., N parameters``; one 1-step
    run, cached in RUNS_DIR)."""
    cache = Path(args.runs_dir) / "params.txt"
    if cache.is_file():
        return int(cache.read_text())
    if args.summarize_only:
        return None
    cmd = [sys.executable, "-m", "flatshard.tools.cli", "train", "--nproc", "1", "--steps", "1",
           "--out", str(Path(args.runs_dir) / "count"), "--checkpoint.enabled", "false",
           "--log.sample_tokens", "0", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    text = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    line = next(li for li in text.splitlines() if "parameters" in li and "model:" in li)
    count = int("".join(ch for ch in line.split(",", 1)[1] if ch.isdigit()))
    cache.write_text(str(count))
    return count


def timing(world: int, args, extra: list[str]) -> str:
    """``--timing``: interleaved short runs; the table of median step times and ratios."""
    import shutil

    times: dict[str, list[float]] = {s: [] for s in args.settings}
    for round_ in range(args.timing):
        for setting in args.settings:
            run_dir_ = run_one(world, setting, 0, _timing_args(args, round_), extra)
            steps = [r["step_time_s"] for r in _metrics(run_dir_)[5:]]
            times[setting].append(statistics.median(steps))
            shutil.rmtree(run_dir_)  # a rerun measures afresh
    lines = [f"| world | setting | median step s ({args.timing} rounds) | ratio to fp32 |",
             "|---:|---|---:|---:|"]  # fmt: skip
    for setting, values in times.items():
        ratio = "—"
        if "fp32" in times:
            pairs = zip(values, times["fp32"], strict=True)
            ratio = f"{statistics.median([v / f for v, f in pairs]):.2f}"
        lines.append(f"| {world} | {setting} | {statistics.median(values):.3f} | {ratio} |")
    return "\n".join(lines)


def _timing_args(args, round_: int):
    return argparse.Namespace(**{**vars(args), "runs_dir": f"{args.runs_dir}/timing_r{round_}"})


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--runs-dir", default="/tmp/lowp_runs")
    p.add_argument("--plot", default="docs/low_precision.png")
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--timing", type=int, default=0, metavar="ROUNDS")
    args = p.parse_args(argv)
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    if args.timing:
        text = "\n\n".join(timing(world, args, extra) for world in args.worlds)
        (Path(args.runs_dir) / "timing.md").write_text(text + "\n")
        print(text)
        return
    params = _count_params(args, extra)
    results = []
    for world in args.worlds:
        for seed in args.seeds:
            for setting in args.settings:
                if not args.summarize_only:
                    run_one(world, setting, seed, args, extra)
                out = run_dir(args, world, setting, seed)
                summary = summarize(world, setting, seed, out, params)
                if summary is not None:
                    results.append(summary)
    text = table(results) + "\n\n" + paired_table(results)
    (Path(args.runs_dir) / "table.md").write_text(text + "\n")
    print(text)
    if results and args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
