#!/usr/bin/env bash
# `sppo bench systems` in miniature: the tiny model on its 4 ranks under a 12 MiB budget a
# rank, lengths up to 16K, the common length run once, on a fixed profile (no measuring).
# Checks the JSON's shape (the three systems, each its longest and its step measured), that
# each system's ranks peaked at its plan's prediction to the byte, and that --svg draws the
# three.
#
#   bash tests/bench_systems.sh [path/to/sppo]        (default: build/sppo)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sppo=$(realpath "${1:-$root/build/sppo}")
work=$(mktemp -d "${TMPDIR:-/tmp}/sppo-bench-systems-test-XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
# A100's rates at fp32, one thread a rank, one node of the four ranks.
python3 - "$root/profiles/a100-80gb.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p.update(name="cpu-test", precision="f32", threads=1, devices_per_node=4, memory_reserve_bytes=0)
json.dump(p, open("cpu4.json", "w"))
PY
"$sppo" bench systems --model tiny --device-memory 12MiB --cap 16K --measure-cap 4K --reps 1 --hardware cpu4.json \
  --svg systems.svg --json >systems.json
python3 - <<'PY'
import json
j = json.load(open("systems.json"))
assert j["ranks"] == 4 and j["common_seq_len"] > 0, j
assert set(j["systems"]) == {"sppo", "megatron", "deepspeed"}, j["systems"].keys()
for name, s in j["systems"].items():
    assert s["max_seq_len"] >= j["common_seq_len"], (name, s)
    assert s["simulated_step_s"] > 0 and s["layout"], (name, s)
    assert s["measured_step_s"] > 0, (name, s)
    assert s["measured_peak_device_bytes_per_rank"] == s["predicted_peak_device_bytes_per_rank"], (name, s)
    assert max(s["measured_peak_device_bytes_per_rank"]) <= j["device_budget_bytes"], (name, s)
print("bench systems: common length", j["common_seq_len"],
      {k: (v["max_seq_len"], v["layout"]) for k, v in j["systems"].items()})
PY
grep -q "<svg" systems.svg && grep -q "megatron" systems.svg
