#!/usr/bin/env bash
# docs/launch.md as a newcomer runs it: every command of its ```sh blocks runs as written, in
# order, in one shell (variables carry from line to line), in a fresh folder laid out like
# the repository root (build/sppo). Its ```text blocks need GPUs, several nodes or a second
# build, and are not run. Commands that use srun or sbatch run on a one-node Slurm cluster
# started here (tests/slurm/cluster.sh) where this machine can run one.
#
#   bash tests/launch_guide.sh [SPPO_BINARY]     (default: build/sppo)
#
# Exit 0 when every command succeeds; 1 naming each one that failed (with its output's last
# lines); 77 when the rest succeeded but the Slurm commands were skipped, saying why.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
sppo=$(readlink -f "${1:-$root/build/sppo}")
[ -x "$sppo" ] || { echo "launch_guide: no sppo binary at $sppo (bash scripts/build.sh)"; exit 1; }
source "$here/slurm/cluster.sh"

work=$(mktemp -d "${TMPDIR:-/tmp}/sppo-launch-guide-XXXXXX")
cleanup() {
  slurm_cluster_down
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/build"
cp "$sppo" "$work/build/sppo"
# The guide's commands as root would need its section on root; CI runs as root.
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

python3 - "$root/docs/launch.md" >"$work/cmds.txt" <<'PY' || { echo "launch_guide: cannot read docs/launch.md"; exit 1; }
import re, sys
block, command = False, ""
for line in open(sys.argv[1], encoding="utf-8").read().splitlines():
    if line.strip() == "```sh":
        block = True
    elif line.strip().startswith("```"):
        block = False
    elif block and line.strip() and not line.strip().startswith("#"):
        command += line.rstrip()
        if command.endswith("\\"):
            command = command[:-1].rstrip() + " "
            continue
        print(re.sub(" +", " ", command.strip()))
        command = ""
PY
[ -s "$work/cmds.txt" ] || { echo "launch_guide: docs/launch.md has no \`\`\`sh blocks"; exit 1; }

why_no_slurm=$(slurm_cluster_why_not)
if [ -z "$why_no_slurm" ] && grep -qE '(^|[ ;&|])(srun|sbatch) ' "$work/cmds.txt"; then
  slurm_cluster_up || exit 1
fi

failed=0 skipped=0 ran=0
cd "$work" || exit 1
while IFS= read -r cmd <&3; do
  if grep -qE '(^|[ ;&|])(srun|sbatch) ' <<<"$cmd" && [ -n "$why_no_slurm" ]; then
    echo "== skipped (no Slurm cluster here: $why_no_slurm): $cmd"
    skipped=$((skipped + 1))
    continue
  fi
  echo "== $cmd"
  ran=$((ran + 1))
  if eval "$cmd" </dev/null >"$work/log" 2>&1; then
    tail -n 2 "$work/log" | sed 's/^/   /'
  else
    echo "FAILED: $cmd"
    tail -n 20 "$work/log" | sed 's/^/   /'
    failed=$((failed + 1))
  fi
done 3<"$work/cmds.txt"

echo
if [ "$failed" -gt 0 ]; then
  echo "launch_guide: $failed of docs/launch.md's commands failed"
  exit 1
fi
if [ "$skipped" -gt 0 ]; then
  echo "launch_guide: $ran commands succeeded; $skipped that need Slurm were skipped: $why_no_slurm"
  exit 77
fi
echo "launch_guide: all $ran commands of docs/launch.md succeeded"
