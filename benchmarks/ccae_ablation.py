"""Chapter 8's ablation: the book's CCAE, each of its changes undone in turn, and the official configuration, at
several seeds, all the same length.

    python benchmarks/ccae_ablation.py                          # every configuration, seeds 0 1 2, two runs at a time
    python benchmarks/ccae_ablation.py --configs book official --seeds 3 4 --max-minutes 50

Each run is one `python benchmarks/ccae.py ARGS --seed S --steps STEPS --out runs/ccae_ablation/NAME-HASH-sS` (HASH:
of the arguments) in a process of its own (one thread each). A run stopped by --max-minutes keeps its checkpoint in that folder, and running this
script again resumes it; a finished run is not run again. Every run's held-out accuracy (2,000 fresh constellations
every --eval-every steps) goes to benchmarks/results/ccae_ablation/NAME-sS.metrics.jsonl, and its final evaluation on
10,000 fresh constellations (accuracy and the one-capsule floor, overall and by objects present) to one line of
benchmarks/results/ccae_ablation.jsonl.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# The book's CCAE: the official configuration with five changes (Chapter 8 derives each).
CHANGES = {
    "dynamic part presences": ["--part-presence", "static"],        # Eq. (8.2)
    "prior sparsity": ["--prior-sparsity", "0"],
    "deformations": ["--no-deformations"],                          # rigid templates
    "drop 0.5": ["--drop-prob", "0.2"],                             # training constellations only
    "no weight average": ["--average", "0.999"],                    # evaluate the moving average
}
# two more changes, measured and not kept: the competitive readout (Eq. 8.1) and no training noise on the part
# presences
COMPETITIVE = ["--readout", "competitive"]
NO_PART_NOISE = ["--no-part-noise"]


def without(*undone: str) -> list[str]:
    "The book's arguments with the changes `undone` left out."
    return [a for name, change in CHANGES.items() if name not in undone for a in change]


BOOK = without()
# the book's CCAE and the same with each change undone alone (named by what comes back); the book with the
# competitive readout, and that with each change undone; that with the training noise off the part presences,
# without the weight average, and with each other change undone; the official configuration
CR = "book + competitive readout"
CONFIGS = {"book": BOOK,
           **{f"book, {undone}": without(undone) for undone in CHANGES},
           CR: BOOK + COMPETITIVE,
           **{f"{CR}, {undone}": without(undone) + COMPETITIVE for undone in CHANGES},
           f"{CR} + no part noise": BOOK + COMPETITIVE + NO_PART_NOISE,
           f"{CR} + no part noise, no weight average": without("no weight average") + COMPETITIVE + NO_PART_NOISE,
           **{f"{CR} + no part noise, no weight average, {undone}":
              without("no weight average", undone) + COMPETITIVE + NO_PART_NOISE
              for undone in CHANGES if undone != "no weight average"},
           "official": []}


def config_of(args: list[str]) -> str:
    "The name of the configuration whose arguments are `args` (in any order)."
    def flags(a: list[str]) -> list[tuple]:
        groups = []
        for token in a:
            if token.startswith("--"): groups.append((token,))
            else: groups[-1] += (token,)
        return sorted(groups)
    return next(name for name, a in CONFIGS.items() if flags(a) == flags(args))


def slug(name: str) -> str:
    return name.replace(" + ", "-plus-").replace(", ", "-").replace(" ", "-")


def metrics_file(name: str, seed: int) -> Path:
    "Where a finished run's metrics (held-out accuracy every --eval-every steps) are kept."
    return RESULTS / "ccae_ablation" / f"{slug(name)}-s{seed}.metrics.jsonl"


def run_folder(name: str, seed: int) -> Path:
    "A run's folder, named by its arguments (a name may come to mean other arguments)."
    key = hashlib.sha1(" ".join(CONFIGS[name]).encode()).hexdigest()[:8]
    return ROOT / "runs" / "ccae_ablation" / f"{slug(name)}-{key}-s{seed}"


def result_rows() -> list[dict]:
    path = RESULTS / "ccae_ablation.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def command(name: str, seed: int, steps: int, eval_every: int, max_minutes) -> list[str]:
    out = run_folder(name, seed)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ccae.py"), *CONFIGS[name], "--seed", str(seed),
           "--steps", str(steps), "--out", str(out), "--eval-every", str(eval_every), "--log-every", "500",
           "--no-progress"]
    if max_minutes: cmd += ["--max-minutes", str(max_minutes)]
    if (out / "last.pt").exists(): cmd.append("--resume")
    return cmd


def finish(name: str, seed: int, proc: subprocess.Popen, log) -> None:
    "Record a finished run: its metrics file and its final evaluation; an unfinished one keeps its checkpoint."
    log.close()
    out = run_folder(name, seed)
    text = Path(log.name).read_text()
    lines = [l for l in text.splitlines() if l.startswith("{")]
    report = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 or "accuracy" not in report:
        state = "stopped (resume by running this again)" if proc.returncode == 0 else f"failed, see {log.name}"
        print(f"{name} seed {seed}: {state}", flush=True)
        return
    (RESULTS / "ccae_ablation").mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "metrics.jsonl", metrics_file(name, seed))
    row = {"config": name, "seed": seed, "args": CONFIGS[name],
           **{k: v for k, v in report.items() if k != "settings"},
           "steps": report["settings"]["steps"]}
    with open(RESULTS / "ccae_ablation.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{name} seed {seed}: accuracy {row['accuracy']:.3f} (1/2/3 objects "
          f"{row['accuracy_1_objects']:.3f} / {row['accuracy_2_objects']:.3f} / {row['accuracy_3_objects']:.3f})",
          flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME",
                   help="configurations to run (default: all): " + "; ".join(CONFIGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--eval-every", type=int, default=2500)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    p.add_argument("--max-minutes", type=float, default=None, help="passed to each run (resumable)")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    done = {(config_of(r["args"]), r["seed"]) for r in result_rows() if r.get("steps") == args.steps}
    # the book's CCAE and the official configuration first, then the ablation
    order = sorted(args.configs, key=lambda c: (c not in ("book", "official"), list(CONFIGS).index(c)))
    todo = [(c, s) for c in order for s in args.seeds if (c, s) not in done]
    print(f"{len(todo)} runs to do, {len(done)} done", flush=True)
    logs = ROOT / "runs" / "ccae_ablation" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running = []
    while todo or running:
        while todo and len(running) < args.jobs:
            name, seed = todo.pop(0)
            log = open(logs / f"{run_folder(name, seed).name}.log", "w")
            proc = subprocess.Popen(command(name, seed, args.steps, args.eval_every, args.max_minutes),
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running.append((name, seed, proc, log))
            print(f"started {name} seed {seed}", flush=True)
        time.sleep(5)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            finish(*item)


if __name__ == "__main__":
    main()
