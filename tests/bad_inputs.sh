#!/usr/bin/env bash
# Bad inputs, as a tired user types them, against the command line. Each must:
#   - exit 2 (bad input) or 3 (does not fit): no crash, no uncaught exception;
#   - print a message naming the option, value or file at fault;
#   - start no work (no training step, no benchmark table);
#   - overwrite no file (every file in the working directory is unchanged, none is added).
# Prints "N passed, M failed" and exits 1 when any failed.
#
#   bash tests/bad_inputs.sh [path/to/sppo] [path/to/rewrite_state]
# (defaults: build/sppo and build/tests/rewrite_state; ctest passes both.)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sppo=$(realpath "${1:-$root/build/sppo}")
rewrite_state=$(realpath "${2:-$root/build/tests/rewrite_state}")
[ -x "$sppo" ] || { echo "no sppo at $sppo; build it first (bash scripts/build.sh)"; exit 2; }
[ -x "$rewrite_state" ] || { echo "no rewrite_state at $rewrite_state; build the tests first"; exit 2; }

meta=$(mktemp -d "${TMPDIR:-/tmp}/sppo-bad-inputs-XXXXXX")
work=$meta/work
mkdir -p "$work"
trap 'rm -rf "$meta"' EXIT
cd "$work"

# ---- fixtures -------------------------------------------------------------------------
le32() { for v in "$@"; do printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x' $((v & 255)) $((v >> 8 & 255)) $((v >> 16 & 255)) $((v >> 24 & 255)))"; done; }
le16() { for v in "$@"; do printf "$(printf '\\x%02x\\x%02x' $((v & 255)) $((v >> 8 & 255)))"; done; }
le32 1 2 3 >t3.u32                       # 3 tokens
le16 1 2 3 500 4 5 6 7 >big_ids.u16      # id 500, beyond the tiny model's vocabulary of 64
printf '0123456789' >odd.u32             # 10 bytes: not whole uint32 tokens
: >empty.u16
le32 1 2 3 4 >raw.bin                    # a .bin without its .idx
printf 'MMIDIDX\0\0' >lonely.idx         # an .idx without its .bin
mkdir -p corpus_dir
printf 'not json {' >garbage.json
echo '{}' >empty.json
echo '[1, 2, 3]' >array.json
echo '{"name": "x"}' >bad_profile.json
"$sppo" plan --model tiny --seq-len 4096 --gpus 1 --gpus-per-node 1 --hardware a100-80gb --json >plan_tiny.json
"$sppo" plan --model gpt-7b --seq-len 64K --gpus 8 --json >plan_7b.json
sed 's/"budget_bytes":[0-9]*/"budget_bytes":1073741824/' plan_7b.json >plan_over_budget.json
sed 's/"kv_host_layers":\[\]/"kv_host_layers":[99]/' plan_tiny.json >plan_kv_layer.json
sed 's/"recompute_tensors":"none"/"recompute_tensors":"fc_post"/' plan_tiny.json >plan_recompute.json
sed 's/"optimizer_state":"device"/"optimizer_state":"gpu"/' plan_tiny.json >plan_optimizer.json
sed 's/"mlp_tile_rows":0/"mlp_tile_rows":-3/' plan_tiny.json >plan_tiles.json
sed 's/"lengths":\[4096\]/"lengths":[4000]/' plan_tiny.json >plan_bad_lengths.json
sed 's/"lengths":\[4096\]/"lengths":[5000,-904]/; s/"alpha":\[0.0\]/"alpha":[0.0,0.0]/; s/"subseqs":1/"subseqs":2/' \
  plan_tiny.json >plan_negative_length.json
sed 's/"cp":1/"cp":2147483647/; s/"pp":1/"pp":2147483647/' plan_tiny.json >plan_overflow.json
"$sppo" train --model tiny --seq-len 32 --steps 2 --save ckpt --quiet
model_config='{"vocab":64,"hidden":64,"layers":2,"heads":4}'
position='{"kind":"repeat","alphabet":32,"seed":1234,"sequence":2}'
base_state="\"config\":$model_config,\"data_position\":$position"
for bad in no_config step_two step_negative schedule_text updates_ahead option_number option_save; do
  cp -r ckpt "ckpt_$bad"
done
"$rewrite_state" ckpt_no_config "{\"step\":2,\"data_position\":$position}"
"$rewrite_state" ckpt_step_two "{\"step\":\"two\",$base_state}"
"$rewrite_state" ckpt_step_negative "{\"step\":-5,$base_state}"
"$rewrite_state" ckpt_schedule_text "{\"step\":2,$base_state,\"schedule_steps\":\"ten\"}"
"$rewrite_state" ckpt_updates_ahead "{\"step\":2,$base_state,\"optimizer_steps\":5}"
"$rewrite_state" ckpt_option_number "{\"step\":2,$base_state,\"options\":{\"--seq-len\":32}}"
"$rewrite_state" ckpt_option_save "{\"step\":2,$base_state,\"options\":{\"--save\":\"elsewhere\"}}"
cp -r ckpt ckpt_corrupt
printf '\x55' | dd of=ckpt_corrupt/model.safetensors bs=1 seek=300 conv=notrunc status=none
echo "keep me" >notes.txt

# ---- the check ------------------------------------------------------------------------
passed=0 failed=0
snapshot() { (cd "$work" && find . -printf '%p %s %T@\n' | sort && find . -type f -exec md5sum {} + | sort); }

# expect WHAT_IT_MUST_NAME sppo-arguments...
expect() {
  local must=$1
  shift
  snapshot >"$meta/before"
  local out rc
  out=$(timeout 300 "$sppo" "$@" 2>&1)
  rc=$?
  snapshot >"$meta/after"
  local why=""
  if [ "$rc" -ne 2 ] && [ "$rc" -ne 3 ]; then why="exit status $rc, not 2 or 3"
  elif ! grep -qF -- "$must" <<<"$out"; then why="the message does not name '$must'"
  elif grep -qE '^step [0-9]+/|^done: |^loss [0-9]|^\| [0-9]' <<<"$out"; then why="work started before the refusal"
  elif ! cmp -s "$meta/before" "$meta/after"; then why="files changed: $(diff "$meta/before" "$meta/after" | grep '^[<>]' | head -3 | tr '\n' ' ')"
  fi
  if [ -z "$why" ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAILED: sppo $*"
    echo "  $why"
    sed 's/^/  | /' <<<"$out" | tail -n 5
  fi
}

# ---- the issue's cases that io/, core/, the planner and plan/simulate fix --------------
expect "t3.u32 (3 tokens) holds 3 tokens, fewer than the 33" train --model tiny --seq-len 32 --steps 1 --data t3.u32
expect "repeat:0" train --model tiny --seq-len 32 --steps 1 --data repeat:0
expect "--seq-len '9223372036854775807' is too large; the largest accepted is" train --model tiny --seq-len 9223372036854775807
expect "--device-memory '999999999999999999999GiB' is too large" train --model tiny --device-memory 999999999999999999999GiB
expect "--budget '99999999999999999999TB' is too large" plan --budget 99999999999999999999TB
expect "missing field(s) \"hardware\"" simulate empty.json
expect "the longest sequence it plans on 8 devices is" plan --seq-len 999999999999
expect "plan_over_budget.json: the simulated peak" simulate plan_over_budget.json
expect "--dry-run checks a plan before its run" train --model tiny --dry-run
expect "over the device budget of 1.00 GiB (the plan's budget_bytes)" train --plan plan_over_budget.json --dry-run
expect "--zero 2 shards the gradients over the ranks that hold the same layers" train --model tiny --seq-len 32 --steps 1 --zero 2
expect "--zero 3 shards the weights and gradients over the ranks that hold the same layers" train --model tiny --seq-len 32 --steps 1 --zero 3
expect "--zero 4 is not a ZeRO stage this build runs; use 0 (nothing sharded), 1" train --model tiny --seq-len 32 --steps 1 --zero 4
expect "--zero must be 0, 1, 2, 3 or auto (got '4')" plan --zero 4
expect "--weights host keeps each rank's whole master on its host: it runs without ZeRO" plan --weights host --zero 3
expect "one device has none to shard over; use --zero auto, 0 or 1, or more --gpus" plan --model tiny --seq-len 4K --gpus 1 --zero 3
expect "--seq-len 999999999999" bench layer --seq-len 999999999999
expect "state.json lacks \"config\"" train --model tiny --seq-len 32 --steps 4 --resume ckpt_no_config
expect "state.json: \"step\" is \"two\"" train --model tiny --seq-len 32 --steps 4 --resume ckpt_step_two
expect "state.json: \"step\" is -5" train --model tiny --seq-len 32 --steps 4 --resume ckpt_step_negative
expect "state.json: \"schedule_steps\" must be an integer" train --model tiny --resume ckpt_schedule_text
expect "state.json: \"optimizer_steps\" must be an integer in [0, 2]" train --model tiny --resume ckpt_updates_ahead
expect "state.json: \"options\" holds --seq-len = 32" train --model tiny --resume ckpt_option_number
expect "records the option '--save'" train --model tiny --resume ckpt_option_save

# ---- more of the same kind ------------------------------------------------------------
# model shapes
expect "nope" train --model nope
expect "--heads" train --model tiny --hidden 30 --heads 4
expect "even" train --model tiny --hidden 24 --heads 8
expect "--layers" train --model tiny --layers -3
expect "--vocab" train --model tiny --vocab -1
# counts and sizes
expect "--seq-len" train --model tiny --seq-len 1
expect "--seq-len '12Q'" train --model tiny --seq-len 12Q
expect "--seq-len '-5' is negative" train --model tiny --seq-len -5
expect "--seq-len '1.3K' is not a whole number" train --model tiny --seq-len 1.3K
expect "--subseqs" train --model tiny --seq-len 64 --subseqs 0
expect "--subseqs" train --model tiny --seq-len 64 --subseqs 65
expect "--subseqs 'many'" train --model tiny --seq-len 64 --subseqs many
expect "--device-memory 'lots'" train --model tiny --device-memory lots
expect "--device-memory '0'" train --model tiny --device-memory 0
expect "--device-memory '-1GiB'" train --model tiny --device-memory -1GiB
expect "a percentage above 0 and at most 100 (e.g. 90%)" train --model tiny --device-memory 120%
expect "a percentage above 0 and at most 100 (e.g. 90%)" train --model tiny --device-memory 0%
expect "a percentage above 0 and at most 100 (e.g. 90%)" train --model tiny --device-memory lots%
expect "--device-memory" train --model tiny --seq-len 4096 --subseqs 4 --device-memory 1MiB
expect "--host-memory 'lots'" train --model tiny --host-memory lots
expect "over the --host-memory budget" train --model tiny --seq-len 4096 --subseqs 4 --offload full --host-memory 1KiB
expect "over the --host-memory budget" grads --model tiny --seq-len 1024 --subseqs 4 --offload 0.5 --host-memory 1KiB --out g
expect "over the --host-memory budget" grads --model tiny --seq-len 1024 --subseqs 4 --kv-cache host --host-memory 1KiB --out g
expect "--kv-cache 'sometimes'" train --model tiny --kv-cache sometimes
expect "--kv-cache 'sometimes' is unknown; use device, host, recompute or auto" plan --kv-cache sometimes
expect "--backward-order 'sideways' is unknown; use subseq, layer or auto" train --model tiny --backward-order sideways
expect "--backward-order 'sideways' is unknown; use subseq, layer or auto" plan --backward-order sideways
expect "names layer 99" train --plan plan_kv_layer.json
expect "--kv-cache host" train --model tiny --recompute --kv-cache host
expect "no saved tensor 'fc_post'" train --model tiny --recompute-tensors fc_post
expect "no saved tensor 'fc_post'" grads --model tiny --recompute-tensors ln1,fc_post --out g
expect "no saved tensor 'fc_post'" plan --model gpt-7b --recompute-tensors fc_post
expect "--kv-cache recompute" train --model tiny --recompute-tensors k
expect "--kv-cache recompute recomputes K/V from a rank's whole rows" train --model tiny --kv-cache recompute --recompute
expect "--recompute already recomputes whole blocks" train --model tiny --recompute --recompute-tensors fc_pre
expect "\"recompute_tensors\"" train --plan plan_recompute.json
expect "--optimizer-state 'sideways' is unknown; use device" train --model tiny --optimizer-state sideways
expect "--weights 'sideways' is unknown; use device" train --model tiny --weights sideways
expect "--weights 'sideways' is unknown; use device" grads --model tiny --weights sideways --out g
expect "it needs --optimizer-state host" train --model tiny --weights host
expect "it needs --optimizer-state host" train --model tiny --weights host --optimizer-state device
expect "it does not run with --recompute" train --model tiny --weights host --optimizer-state host --recompute
expect "--residual-grads 'sideways' is unknown; use device or host" train --model tiny --residual-grads sideways
expect "it needs --backward-order layer" train --model tiny --residual-grads host --backward-order subseq
expect "it needs --backward-order layer" grads --model tiny --residual-grads host --backward-order subseq --out g
expect "it does not run with --recompute" grads --model tiny --weights host --recompute --out g
expect "--rebuild-inputs names layer 7, not a layer of the model's 2; use none, odd" train --model tiny --rebuild-inputs 7
expect "'x' is not a layer; use none, odd" grads --model tiny --rebuild-inputs x --kv-cache device --out g
expect "name where the others keep theirs, --kv-cache device, host or recompute" train --model tiny --rebuild-inputs odd
expect "only the layer-major backward orders so: use --backward-order layer" train --model tiny --rebuild-inputs odd --kv-cache device --backward-order subseq
expect "layer 0: the first layer's input has no layer below" train --model tiny --rebuild-inputs 0 --kv-cache device
expect "layer 2: the layer below (1) must keep its input" train --model medium --rebuild-inputs 1,2 --kv-cache device
expect "the layer below streams its K/V from the host" train --model tiny --rebuild-inputs odd --kv-cache host
expect "drop --rebuild-inputs" train --model tiny --rebuild-inputs odd --kv-cache device --recompute
expect "the weights and gradients) on its fullest rank, over the --host-memory budget" train --model tiny --seq-len 256 --weights host --optimizer-state host --host-memory 64KiB
expect "--optimizer-state host moves AdamW's m and v" train --model medium --seq-len 4096 --device-memory 20MiB --steps 1
expect "--optimizer-state 'sideways' is unknown; use device, host or auto" plan --optimizer-state sideways
expect "\"optimizer_state\": optimizer_state 'gpu' is unknown; use device or host" train --plan plan_optimizer.json
expect "--mlp-tile-rows must be 0 (off) or a positive number of rows (got -4)" train --model tiny --mlp-tile-rows -4
expect "--mlp-tile-rows must be 0 (off) or a positive number of rows (got -1)" grads --model tiny --mlp-tile-rows -1 --out g
expect "--mlp-tile-rows" train --model tiny --mlp-tile-rows many
expect "--mlp-tile-rows runs the MLP of whole rows a tile at a time; it runs without --tp and --recompute" train --model tiny --recompute --mlp-tile-rows 64
expect "\"mlp_tile_rows\"" train --plan plan_tiles.json
expect "--offload 'sometimes'" train --model tiny --offload sometimes
expect "--offload '1.5'" train --model tiny --offload 1.5
expect "--partition" train --model tiny --partition random
expect "--recompute" train --model tiny --recompute --subseqs 4
expect "--steps" train --model tiny --steps 0
expect "--steps" train --model tiny --steps abc
expect "--lr" train --model tiny --lr -1
expect "--bogus" train --model tiny --bogus
# data
expect "/nonexistent/corpus.u16" train --model tiny --data /nonexistent/corpus.u16
expect "corpus_dir" train --model tiny --data corpus_dir
expect "odd.u32" train --model tiny --data odd.u32
expect "token id 500" train --model tiny --seq-len 4 --data big_ids.u16
expect "empty.u16" train --model tiny --data empty.u16
expect "raw.bin" train --model tiny --data raw.bin
expect "lonely.idx" train --model tiny --data lonely.idx
expect "f32" train --model tiny --data t3.u32 --data-dtype f32
expect "alphabet 99" train --model tiny --data repeat:99
expect "repeat:x" train --model tiny --data repeat:x
# checkpoints
expect "/nonexistent/ckpt" train --model tiny --resume /nonexistent/ckpt
expect "model.safetensors" train --model tiny --seq-len 32 --steps 4 --resume ckpt_corrupt
expect "--hidden \"128\" differs from the checkpoint's \"64\"" train --model tiny --hidden 128 --seq-len 32 --steps 4 --resume ckpt
expect "notes.txt" train --model tiny --resume notes.txt
expect "/nonexistent/init" grads --model tiny --out grads_out --init /nonexistent/init
expect "--out" grads --model tiny
# plans and profiles
expect "--plan /nonexistent/plan.json" train --model tiny --plan /nonexistent/plan.json
expect "garbage.json" train --model tiny --plan garbage.json
expect "--seq-len" train --model tiny --seq-len 2048 --plan plan_tiny.json
expect "/nonexistent/profile.json" train --model tiny --hardware /nonexistent/profile.json --offload adaptive
expect "bad_profile.json" train --model tiny --hardware bad_profile.json --offload adaptive
expect "/nonexistent/plan.json" simulate /nonexistent/plan.json
expect "garbage.json" simulate garbage.json
expect "JSON object" simulate array.json
expect "lengths sum to 4000" simulate plan_bad_lengths.json
expect "lengths[1] = -904" simulate plan_negative_length.json
expect "tp * ulysses * cp * pp * dp" simulate plan_overflow.json
expect "nope" simulate plan_tiny.json --hardware nope
expect "/nonexistent/dir/x.svg" simulate plan_tiny.json --svg /nonexistent/dir/x.svg
expect "nope" plan --model nope
expect "--gpus" plan --gpus 0
expect "--gpus 12" plan --gpus 12 --gpus-per-node 8
expect "--system" plan --system other
expect "--offload" plan --offload sometimes
expect "--msp" plan --msp maybe
expect "nope" plan --hardware nope
expect "--budget 'lots'" plan --budget lots
expect "--host-budget 'lots'" plan --host-budget lots
expect "budget" plan --model gpt-65b --seq-len 1M --gpus 4
# benchmarks
expect "--heads" bench layer --hidden 30 --heads 4
expect "--reps" bench layer --reps 0
expect "--seq-len" bench layer --seq-len 1
expect "nope" bench memory --model nope
expect "--device-memory" bench memory --device-memory 0
expect "--seq-len" bench offload --seq-len 0
expect "--subseqs" bench offload --subseqs 0
expect "--reps" bench attention --backend cpu --reps 0
expect "--heads" bench attention --backend cpu --heads -1
expect "--steps" bench cores --steps 1
expect "--reps" bench cores --reps 0
expect "nope" bench cores --model nope
expect "--seq-len" bench cores --seq-len 0
# backends
expect "--backend 'nope'" train --model tiny --backend nope
expect "--precision 'fp64'" train --model tiny --precision fp64
expect "--precision bf16" train --model tiny --backend cpu --precision bf16
expect "--backend 'nope'" bench attention --backend nope
# attention kernels: an unknown word, a kind named twice, cuDNN where there is no CUDA backend
expect "--attention 'causal,flash': 'flash' is unknown" train --model tiny --attention causal,flash
expect "names the kernels twice" grads --model tiny --attention own,cudnn --out grads_out
expect "names the mask twice" train --model tiny --attention causal,bidirectional
expect "--attention cudnn" train --model tiny --backend cpu --attention cudnn
expect "--attention cudnn" bench attention --backend cpu --attention cudnn
expect "attention kernels 'sdpa'" bench layer --attention sdpa
expect "--chunk" bench attention --backend cpu --chunk 0
# several ranks: an unknown transport, NCCL on the CPU, a GPU picked on the CPU
expect "--comm 'tcp'" train --model tiny --comm tcp
expect "--comm nccl connects GPUs" train --model tiny --backend cpu --comm nccl
expect "--device 1 picks a GPU" grads --model tiny --backend cpu --device 1 --out grads_out
expect "--backend 'gpu'" profile --backend gpu --out profile_out.json
expect "--threads" profile --threads -2 --out profile_out.json

# ---- the trainer's up-front checks ---------------------------------------------------
expect "shorten --seq-len" train --model tiny --seq-len 999999999999
expect "--out notes.txt is a file" grads --model tiny --seq-len 32 --out notes.txt
expect "--save notes.txt is a file" train --model tiny --seq-len 32 --steps 2 --save notes.txt
expect "--trace /nonexistent/t.json" train --model tiny --seq-len 32 --steps 2 --trace /nonexistent/t.json
expect "--svg /nonexistent/t.svg" train --model tiny --seq-len 32 --steps 2 --svg /nonexistent/t.svg
expect "--metrics /nonexistent/m.jsonl" train --model tiny --seq-len 32 --steps 2 --metrics /nonexistent/m.jsonl
expect "--seq-len \"64\" differs from the checkpoint's \"32\"" train --model tiny --seq-len 64 --steps 4 --resume ckpt
expect "--threads" train --model tiny --seq-len 32 --steps 1 --threads -3
expect "--warmup" train --model tiny --seq-len 32 --steps 1 --warmup -5
expect "--lr-schedule 'step'" train --model tiny --seq-len 32 --steps 1 --lr-schedule step
expect "--decay-steps is the decay of --lr-schedule wsd" train --model tiny --seq-len 32 --steps 10 --decay-steps 3
expect "--decay-steps 5 or less" train --model tiny --seq-len 32 --steps 10 --warmup 5 --lr-schedule wsd --decay-steps 8
expect "--min-lr 0.5" train --model tiny --seq-len 32 --steps 1 --lr 0.01 --min-lr 0.5
expect "--min-lr" train --model tiny --seq-len 32 --steps 1 --min-lr -0.1
expect "--tensorboard" train --model tiny --seq-len 32 --steps 1 --tensorboard /etc/hostname/tb
expect "--recompute needs" train --model tiny --seq-len 4096 --recompute --device-memory 8MiB
# Sequence parallelism and bidirectional models.
expect "--cp 2 x --dp 1 = 2 ranks" train --model tiny --seq-len 32 --steps 1 --cp 2
expect "--cp must be 1 to 8" train --model tiny --seq-len 32 --steps 1 --cp 0
expect "--pp 1 x --tp 2 x --dp 1 = 2 ranks" train --model tiny --seq-len 32 --steps 1 --tp 2
expect "--tp must be 1 to 8" train --model tiny --seq-len 32 --steps 1 --tp 0
expect "--pp 1 x --ulysses 4 x --dp 1 = 4 ranks" train --model tiny --seq-len 32 --steps 1 --ulysses 4
expect "--pp 1 x --ulysses 2 x --cp 2 x --dp 1 = 4 ranks" grads --model tiny --seq-len 32 --ulysses 2 --cp 2 --out ulysses-grads
expect "--ulysses must be 1 to 64" train --model tiny --seq-len 32 --steps 1 --ulysses 0
expect "use one of them" train --model tiny --seq-len 32 --steps 1 --ulysses 2 --tp 2
expect "use one of --ulysses 1, 2, 4" train --model llama-tiny --seq-len 32 --steps 1 --ulysses 3
expect "--msp must be on or off" train --model tiny --seq-len 32 --steps 1 --msp maybe
expect "--msp on splits subsequences over pipeline stages" train --model tiny --seq-len 32 --steps 1 --subseqs 4 --msp on
expect "--msp-reach 1: use 0 (every idle stage group) or 2 or more" train --model tiny --seq-len 32 --steps 1 --msp-reach 1
expect "--ring 'spiral'" train --model tiny --seq-len 32 --steps 1 --ring spiral
expect "--ring rsa is the two-pass" train --model tiny --seq-len 32 --steps 1 --ring rsa
expect "--attention 'sideways'" train --model tiny --seq-len 32 --steps 1 --attention sideways
expect "--objective 'cloze'" train --model tiny --seq-len 32 --steps 1 --objective cloze
expect "--attention bidirectional sees the next token" train --model tiny --seq-len 32 --steps 1 --attention bidirectional
expect "--objective mlm trains a bidirectional model" train --model tiny --seq-len 32 --steps 1 --objective mlm
expect "--attention bidirectional sees the whole sequence" train --model tiny --seq-len 32 --steps 1 --attention bidirectional --objective mlm --subseqs 4
# Drawing a run's loss curve.
printf '{"step":1,"loss":4.0}\n' >run.jsonl
expect "cannot open the metrics file missing.jsonl" plot missing.jsonl --out loss.svg
expect "empty.json line 1 has no integer \"step\"" plot empty.json --out loss.svg
expect "garbage.json holds no step record" plot garbage.json --out loss.svg
expect "--out run.jsonl should name an .svg file" plot run.jsonl --out run.jsonl
expect "array.json line 1 is not a JSON object" plot array.json --out loss.svg
# Llama-family models and Hugging Face checkpoints (the weights' checks: tests/hf/check_hf.py).
mkdir -p hf_gpt2 hf_noweights hf_window hf_rope not_hf
echo '{"architectures": ["GPT2LMHeadModel"], "vocab_size": 64}' >hf_gpt2/config.json
llama_cfg='"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4'
echo "{\"architectures\": [\"LlamaForCausalLM\"], $llama_cfg}" >hf_noweights/config.json
echo "{\"architectures\": [\"MistralForCausalLM\"], $llama_cfg, \"sliding_window\": 16}" >hf_window/config.json
echo "{\"architectures\": [\"LlamaForCausalLM\"], $llama_cfg, \"rope_scaling\": {\"rope_type\": \"longrope\", \"factor\": 4}}" >hf_rope/config.json
expect "architecture GPT2LMHeadModel is not supported" import hf_gpt2 --out imported
expect "neither model.safetensors nor model.safetensors.index.json" import hf_noweights --out imported
expect "\"sliding_window\": sliding-window attention is not supported" train --init hf_window --seq-len 32 --steps 1
expect "longrope" import hf_rope --out imported
expect "not a Hugging Face model directory" import not_hf --out imported
# Qwen3's config fields sppo cannot honour, refused from config.json before any weight is read.
qwen3_cfg='"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2'
qwen3() { mkdir -p "$1" && echo "{\"architectures\": [\"Qwen3ForCausalLM\"], $qwen3_cfg, $2}" >"$1/config.json"; }
qwen3 hf_qwen3_window '"head_dim": 16, "use_sliding_window": true, "sliding_window": 4096'
qwen3 hf_qwen3_odd '"head_dim": 15'
qwen3 hf_qwen3_huge '"head_dim": 4096'
qwen3 hf_qwen3_wide '"head_dim": 1024, "num_attention_heads": 2048, "num_key_value_heads": 2'
qwen3 hf_qwen3_rope '"head_dim": 16, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}'
qwen3 hf_qwen3_bias '"head_dim": 16, "attention_bias": true'
qwen3 hf_qwen3_layers '"head_dim": 16, "layer_types": ["full_attention", "sliding_attention"]'
expect "\"use_sliding_window\": true: sliding-window attention is not supported" import hf_qwen3_window --out imported
expect "head_dim 15 must be even" import hf_qwen3_odd --out imported
expect "\"head_dim\" must be an integer in [1, 1024]" import hf_qwen3_huge --out imported
expect "make queries 2097152 wide" import hf_qwen3_wide --out imported
expect "rope_scaling type 'longrope' is not supported" import hf_qwen3_rope --out imported
expect "\"attention_bias\": true" train --init hf_qwen3_bias --seq-len 32 --steps 1
expect "\"layer_types\" names \"sliding_attention\"" import hf_qwen3_layers --out imported
expect "--rope-scaling applies to Llama-family models" train --model tiny --seq-len 32 --steps 1 --rope-scaling linear:2
expect "rope_scaling type 'ntk' is not supported" train --model llama-tiny --seq-len 32 --steps 1 --rope-scaling ntk:2
expect "--rope-scaling 'yarn'" train --model llama-tiny --seq-len 32 --steps 1 --rope-scaling yarn
expect "rope_scaling factor must be at least 1" train --model llama-tiny --seq-len 32 --steps 1 --rope-scaling linear:0.5
expect "--rope-theta must be positive" train --model llama-tiny --seq-len 32 --steps 1 --rope-theta -5
expect "--init starts a new run" train --model tiny --seq-len 32 --steps 4 --init hf_window --resume ckpt
expect "holds the model" train --model small --seq-len 32 --steps 1 --init ckpt
expect "holds a GPT model" export ckpt --format hf --out hf_out
expect "--format 'gguf'" export ckpt --format gguf --out hf_out
expect "--dtype 'fp8'" export ckpt --format hf --dtype fp8 --out hf_out
expect "--pack packs documents that --doc-sep ID ends" train --model llama-tiny --seq-len 32 --steps 1 --pack
expect "--doc-sep 99 is not a token id" train --model llama-tiny --seq-len 32 --steps 1 --doc-sep 99 --pack
expect "--pack keeps each document's causal attention to itself" train --model tiny --seq-len 32 --steps 1 --doc-sep 0 --pack --attention bidirectional --objective mlm
# --config files: a bad key, a bad value, a file that does not parse, each naming its line.
printf 'model = "tiny"\nseq-len = 32\nstepz = 3\n' >bad_key.toml
printf 'model = "tiny"\nsteps = "many"\n' >bad_value.toml
printf 'model = "tiny"\nsteps = \n' >bad_toml.toml
printf '[train]\nsteps = 3\n' >section.toml
expect "bad_key.toml line 3: stepz is not an option of sppo train" train --config bad_key.toml
expect "bad_value.toml line 2: steps = many" train --config bad_value.toml
expect "bad_toml.toml line 2:" train --config bad_toml.toml
expect "section.toml line 1: train is a section" train --config section.toml
expect "bad_key.toml line 3: stepz is not an option of sppo grads" grads --config bad_key.toml --out g
expect "line 3: stepz is not an option of sppo plan" plan --config bad_key.toml
expect "cannot read --config missing.toml" train --config missing.toml
expect "sppo grads needs --out DIR" grads --model tiny --seq-len 32
# Labels beside the data (--labels).
le16 $(seq 1 40) >d40.u16
le32 $(seq 1 39) >l39.i32
le32 -100 2 3 4 5 99 $(seq 7 40) >l40bad.i32
le32 $(for k in $(seq 1 40); do echo -100; done) >l40none.i32
le32 $(seq 1 40) >l40.i32
cp l40.i32 l40.txt
labeled=(train --model tiny --seq-len 32 --steps 1 --data d40.u16)
expect "holds 39 labels, but --data d40.u16 holds 40 tokens" "${labeled[@]}" --labels l39.i32
expect "label 99 at token offset 5" "${labeled[@]}" --labels l40bad.i32
expect "is -100 everywhere" "${labeled[@]}" --labels l40none.i32
expect "the file name says no label type" "${labeled[@]}" --labels l40.txt
expect "--labels missing.i32 is not a file" "${labeled[@]}" --labels missing.i32
expect "the built-in task has its own" train --model tiny --seq-len 32 --steps 1 --labels l40.i32
expect "--labels gives a causal model's next-token targets" "${labeled[@]}" --labels l40.i32 --attention bidirectional --objective mlm
expect '--labels "l40.i32" differs from the checkpoint' train --resume ckpt --labels l40.i32 --steps 4
# Held-out data (train --eval-data) and sppo eval.
expect "--eval-data t3.u32 holds 3 tokens, fewer than one sequence of --seq-len 32" train --model tiny --seq-len 32 \
  --steps 1 --eval-data t3.u32
expect "--eval-labels l39.i32 holds 39 labels, but --eval-data d40.u16 holds 40 tokens" train --model tiny \
  --seq-len 32 --steps 1 --eval-data d40.u16 --eval-labels l39.i32
expect "sppo eval needs --init CKPT" eval --model tiny --seq-len 32
expect "--data t3.u32 holds 3 tokens, fewer than one sequence of --seq-len 32" eval --init ckpt --seq-len 32 \
  --data t3.u32 --out eval_out
expect "holds 39 labels, but --data d40.u16 holds 40 tokens" eval --init ckpt --seq-len 32 --data d40.u16 \
  --labels l39.i32 --out eval_out
expect "--kv-cache host keeps the K/V of finished subsequences off the device" eval --init ckpt --seq-len 64K \
  --device-memory 4MiB --kv-cache device --subseqs 1 --out eval_out
expect "--offload" eval --init ckpt --seq-len 32 --offload full
# srun of two tasks without an MPI plugin (srun --mpi=none): each would train alone as rank 0.
SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=0 SLURM_LOCALID=0 \
  expect "srun started 2 tasks without an MPI plugin" train --model tiny --seq-len 32 --steps 1 --save srun_ckpt

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
