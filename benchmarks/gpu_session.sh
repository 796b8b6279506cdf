#!/usr/bin/env bash
# A prepared session for a machine with one GPU (this workplace's `device` tool: 15 minutes for a whole issue,
# the machine's start included). It trains, side by side on the one GPU, the runs that take days on these CPUs,
# each in its own process under one time limit (--max-minutes: each stops cleanly with a checkpoint), then packs
# each run (its float16 weights with their manifest entry, its metrics.jsonl, its last evaluation) for the trip
# back.
#
#   bash benchmarks/gpu_session.sh train [JOB ...]   train (default: all jobs below), pack, copy the first packs
#                                                    to $OUT (as many as the trip back holds)
#   bash benchmarks/gpu_session.sh collect [JOB ...] copy the named packs to $OUT (a second call on the still-warm
#                                                    machine: what the first trip could not hold)
#   SMOKE=1 OUT=/tmp/o bash benchmarks/gpu_session.sh train   on a CPU: every job a few steps on the MNIST sample
#   SCAE_FROM=runs/scae-stageN/STEP.weights.pt bash ... train scae-mnist
#                                                    the image SCAE goes on from the book's best weights (Chapter
#                                                    11's last stage; name the file in the call's carry) at the
#                                                    official batch, rate and weights, instead of from scratch
#
# Before the call: the tree travels (64 MiB at most), so move weights/ and runs/ out of the checkout; MNIST travels
# with it: copy ../shared/data/mnist/*.gz to data/mnist/ (ignored by git) and name `data` in the call's carry.
# The trip back holds 8 files of at most 16 MiB, 64 MiB in all: a pack larger than 15 MiB is cut into parts
# (`cat NAME.tar.part-* > NAME.tar`). Here, afterwards: `tar xf NAME.tar` gives NAME/weights/NAME.pt, the entry to
# merge into weights/manifest.json (NAME/weights/manifest.json) and NAME/metrics.jsonl, which the entry names as
# benchmarks/results/NAME.metrics.jsonl. A job of Chapter 4b trains in two runs (Eq. 4.1, then the cooldown, as its
# manifest command says): it is shipped by weights.ship_two_runs, so its metrics.jsonl is the two runs' curve as one
# and its entry counts both runs' steps and seconds.
set -uo pipefail
MODE=${1:-train}; shift || true
OUT=${OUT:?set OUT to the folder whose files come back}
MINUTES=${MINUTES:-7}                 # each run's training time limit
WORK=${WORK:-/tmp/gpu_session}        # kept between calls while the machine stays warm
PART=15M
# capsnet-mnist is shipped (Chapter 4: 50 epochs of the official schedule on the CPU, then a cooldown); its job
# stays, for a run by name, and is no longer among the defaults
# cnn-expanded, capsnet-expanded and capsnet-expanded-r1 are shipped too (Chapter 4b); their jobs stay, for a run
# by name
ALL=(scae-mnist)
JOBS=("${@:-${ALL[@]}}")
if [ "${#JOBS[@]}" -eq 0 ] || [ -z "${JOBS[0]}" ]; then JOBS=("${ALL[@]}"); fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}                # the device machine: its python3 holds PyTorch
CB=("$PYTHON" -c "import sys; from capsule_book.cli import main; sys.exit(main())")
if [ -n "${SMOKE:-}" ]; then
  DEVICE=cpu
else
  DEVICE=cuda
  export CAPSULE_BOOK_DATA=$WORK/data
  mkdir -p "$CAPSULE_BOOK_DATA/MNIST/raw"
  for f in "$ROOT"/data/mnist/*.gz; do
    [ -e "$f" ] || { echo "no MNIST in data/mnist/: copy ../shared/data/mnist/*.gz there, carry data" >&2; exit 2; }
    gunzip -c "$f" > "$CAPSULE_BOOK_DATA/MNIST/raw/$(basename "$f" .gz)"
  done
fi

# each job: the command's arguments after `capsule-book train`, and its model for `capsule-book eval`
args_of() {
  case $1 in
    capsnet-mnist) echo "capsnet --epochs 50 --eval-every 2345" ;;               # the official schedule, 50 epochs
    # Chapter 4b's networks: Eq. (4.1) for `base_steps` (the run NAME-base), then the cooldown of `cooldown_of`
    capsnet-expanded) echo "capsnet --canvas 40" ;;
    capsnet-expanded-r1) echo "capsnet --canvas 40 --routing-iterations 1" ;;
    cnn-expanded) echo "cnn" ;;
    # the image SCAE (issue 29): from scratch at the official batch, with the tenfold rate that moves it in a short
    # budget; with SCAE_FROM, Chapter 11's stages continued at the official batch, rate and between-example weight
    scae-mnist) if [ -n "${SCAE_FROM:-}" ]; then
        echo "scae --from-scae $SCAE_FROM --batch-size 128 --prior-between 0.35 --lr 3e-5 --eval-every 5000 --eval-n 5000"
      else echo "scae --batch-size 128 --lr 3e-4 --eval-every 5000 --eval-n 5000"; fi ;;
    *) echo "unknown job $1 (jobs: ${ALL[*]})" >&2; return 2 ;;
  esac
}

# the jobs trained in two runs (Chapter 4b): Eq. (4.1)'s steps (evaluated every epoch, BASE_EVAL), then the
# cooldown's flags; none for the others
BASE_EVAL="--eval-every 469"
base_steps() {
  case $1 in
    capsnet-expanded|capsnet-expanded-r1) echo 967 ;;
    cnn-expanded) echo 2433 ;;
  esac
}
cooldown_of() {
  case $1 in
    capsnet-expanded|capsnet-expanded-r1) echo "--epochs 6 --eval-every 235 --stop-at-accuracy 0.992" ;;
    cnn-expanded) echo "--epochs 4 --eval-every 235 --stop-at-accuracy 0.992" ;;
  esac
}

# SMOKE: each model's few steps on the MNIST sample (training, then evaluation); none otherwise
train_size() {
  [ -n "${SMOKE:-}" ] || return 0
  case $1 in
    scae) echo "--sample --steps 3 --batch-size 8 --eval-n 16 --log-every 1 --eval-every 3" ;;
    *) echo "--sample --steps 3 --batch-size 8 --limit-test 16 --log-every 1 --eval-every 3" ;;
  esac
}
eval_size() {
  [ -n "${SMOKE:-}" ] || return 0
  case $1 in
    scae) echo "--sample --n-train 40 --n-test 20" ;;
    *) echo "--sample --limit-test 16" ;;
  esac
}

pack() {   # NAME: the run's weights (float16) and manifest entry, metrics and evaluation, as NAME.tar (in parts)
  local name=$1 run=$WORK/runs/$1 args
  args=$(args_of "$name") || return 2
  local model=${args%% *} dir=$WORK/packs/$name size command="capsule-book train $args" base=""
  if [ -n "$(base_steps "$name")" ]; then
    base=$run-base
    command="capsule-book train $args --steps $(base_steps "$name") $BASE_EVAL --out runs/$name && capsule-book"
    command+=" train $args --cooldown-from runs/$name/last.pt $(cooldown_of "$name") --out runs/$name-cooldown"
  fi
  read -r -a size <<< "$(eval_size "$model")"
  rm -rf "$dir" && mkdir -p "$dir/weights"
  "${CB[@]}" eval "$model" --checkpoint "$run/last.pt" --device "$DEVICE" "${size[@]}" > "$dir/eval.json" \
    || { echo "$name: evaluation failed" >&2; return 1; }
  local gpu; gpu=$(nvidia-smi -L 2>/dev/null | head -1)
  "$PYTHON" - "$run/last.pt" "$name" "$dir" "$command" "$gpu" "$base" <<'EOF' || return 1
import json, shutil, sys
from pathlib import Path
from capsule_book.weights import ship, ship_two_runs
ck, name, folder, command, gpu, base = sys.argv[1:]
metric = json.loads(open(f"{folder}/eval.json").read().strip().splitlines()[-1])
kw = dict(dtype="float16", folder=f"{folder}/weights", metrics=f"benchmarks/results/{name}.metrics.jsonl",
          notes=f"trained on {gpu or 'the CPU'} by benchmarks/gpu_session.sh")
if base:    # two runs: one curve, both runs' steps and seconds
    ship_two_runs(ck, f"{base}/last.pt", name, command, metric, f"{base}/metrics.jsonl",
                  f"{folder}/metrics.jsonl", **kw)
else:
    ship(ck, name, command, metric, **kw)
    shutil.copy(Path(ck).parent / "metrics.jsonl", f"{folder}/metrics.jsonl")
EOF
  cp "$WORK/logs/$name.log" "$dir/" 2>/dev/null
  (cd "$WORK/packs" && tar cf "$name.tar" "$name" && rm -f "$name.tar.part-"* \
     && if [ "$(stat -c %s "$name.tar")" -gt 15728640 ]; then split -b $PART "$name.tar" "$name.tar.part-" \
        && rm "$name.tar"; fi)
}

send() {   # copy packs to $OUT while they fit the trip back (8 files, 64 MiB)
  local files=0 bytes=0 f n b
  for name in "$@"; do
    n=0; b=0
    for f in "$WORK/packs/$name".tar*; do [ -e "$f" ] || continue; n=$((n + 1)); b=$((b + $(stat -c %s "$f"))); done
    if [ "$n" -eq 0 ]; then echo "$name: no pack" >&2; continue; fi
    if [ $((files + n)) -gt 8 ] || [ $((bytes + b)) -gt 66060288 ]; then echo "left for collect: $name"; continue; fi
    cp "$WORK/packs/$name".tar* "$OUT/" && files=$((files + n)) && bytes=$((bytes + b)) && echo "sent: $name"
  done
}

left() { local m=$(( (END - $(date +%s)) / 60 )); echo $(( m > 0 ? m : 0 )); }   # whole minutes to END

run_job() {   # NAME: its run (resumed where a checkpoint is), or its two runs, until END
  local name=$1 run=$WORK/runs/$1 steps base
  steps=$(base_steps "$name")
  if [ -z "$steps" ]; then
    "${CB[@]}" train "${a[@]}" "${size[@]}" --out "$run" --device "$DEVICE" --no-progress \
      --max-minutes "$MINUTES" $( [ -e "$run/last.pt" ] && echo --resume )
    return
  fi
  [ -n "${SMOKE:-}" ] && steps=3
  if [ ! -e "$run/last.pt" ]; then                            # Eq. (4.1) first, in NAME-base
    "${CB[@]}" train "${a[@]}" $BASE_EVAL "${size[@]}" --steps "$steps" --out "$run-base" --device "$DEVICE" \
      --no-progress --max-minutes "$(left)" $( [ -e "$run-base/last.pt" ] && echo --resume ) || return
    base=$("$PYTHON" -c "import sys; from capsule_book.train import load_checkpoint
print(load_checkpoint(sys.argv[1], mmap=True)['step'])" "$run-base/last.pt") || return
    [ "$base" = "$steps" ] || { echo "$name: Eq. (4.1) stopped at step $base of $steps"; return; }
  fi
  [ "$(left)" -gt 0 ] || return
  read -r -a c <<< "$(cooldown_of "$name")"
  "${CB[@]}" train "${a[@]}" "${size[@]}" "${c[@]}" --cooldown-from "$run-base/last.pt" --out "$run" \
    --device "$DEVICE" --no-progress --max-minutes "$(left)" $( [ -e "$run/last.pt" ] && echo --resume )
}

for name in "${JOBS[@]}"; do args_of "$name" > /dev/null || exit 2; done
case $MODE in
  train)
    mkdir -p "$WORK/runs" "$WORK/packs" "$WORK/logs"
    END=$(( $(date +%s) + ${MINUTES%.*} * 60 ))
    for name in "${JOBS[@]}"; do
      read -r -a a <<< "$(args_of "$name")" || exit 2
      read -r -a size <<< "$(train_size "${a[0]}")"
      run_job "$name" > "$WORK/logs/$name.log" 2>&1 &
    done
    wait
    for name in "${JOBS[@]}"; do tail -n 2 "$WORK/logs/$name.log"; pack "$name"; done
    send "${JOBS[@]}" ;;
  collect) send "${JOBS[@]}" ;;
  *) echo "usage: gpu_session.sh train|collect [JOB ...]" >&2; exit 2 ;;
esac
