#!/usr/bin/env bash
# Chapter 19's recordings in one go: the decode-step profile, the ablations and a short online
# curve, each under a time limit and each writing its JSON as it goes, so that a run cut short
# still leaves what it finished. stdout of each part goes to OUT/<part>.txt, its log to
# OUT/<part>.log; a table of exit codes closes the run. BUDGET (seconds) bounds the whole run:
# the profile gets at most 200 s, the ablations what is left but 90 s, the online curve the rest.
#
#   benchmark/record.sh OUT_DIR [MODEL]            # the GPU run (models/qwen3-0.6b-like)
#   SCALE=small benchmark/record.sh OUT_DIR models/tiny-qwen3   # the same commands, tiny, CPU
set -u
out=${1:?usage: benchmark/record.sh OUT_DIR [MODEL]}
model=${2:-models/qwen3-0.6b-like}
mkdir -p "$out"
if [ "${SCALE:-full}" = small ]; then
  profile=(--batch-sizes 1,8 --context-len 64 --steps 3 --profile-steps 2)
  ablations=(--num-requests 8 --min-len 8 --max-len 24 --num-prefixes 2 --prefix-len 32
             --short-requests 4 --long-requests 2 --long-len 200 --chunk-size 48)
  online=(--device cpu --rates 8,inf --num-requests 8 --max-input 32 --max-output 16)
  budget=${BUDGET:-600}
else
  profile=(--batch-sizes 1,128 --context-len 1024)
  ablations=(--num-requests 128 --min-len 64 --max-len 384 --num-prefixes 4 --prefix-len 2048
             --short-requests 32 --long-requests 4 --long-len 8192 --chunk-size 2048)
  online=(--device cuda --rates 8,16,32,64,inf --num-requests 64 --min-input 100
          --max-input 512 --min-output 100 --max-output 512)
  budget=${BUDGET:-510}  # seconds for all three parts; the online curve keeps the last 90
fi
status=()
left() {  # left RESERVE: seconds of the budget left, keeping RESERVE for the parts after
  echo $((budget - SECONDS - $1))
}
part() {  # part NAME LIMIT COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most $limit s): $*"
  local start=$SECONDS
  { echo "\$ $*"; timeout "$limit" "$@" 2>"$out/$name.log"; } >"$out/$name.txt"
  local code=$?
  status+=("$name: exit $code in $((SECONDS - start)) s")
  echo "${status[-1]}"
}
part profile "$(($(left 290) < 200 ? $(left 290) : 200))" python benchmark/profile_decode.py --model "$model" "${profile[@]}" \
  --out "$out/profile.json"
part ablations "$(left 90)" python benchmark/offline.py --model "$model" --ablations all \
  --systems minisgl transformers --no-progress "${ablations[@]}" --out "$out/ablations.json"
part online "$(left 0)" python benchmark/online.py --model "$model" --no-progress \
  "${online[@]}" --server-log "$out/server.log" --out "$out/online.json"
echo
printf '%s\n' "${status[@]}"
