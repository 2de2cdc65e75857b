// Checkpoints: one directory per checkpoint, replaced atomically.
//
//   DIR/model.safetensors      weights, by parameter name (F32)
//   DIR/optimizer.safetensors  AdamW state, by convention "<param>.m" and "<param>.v" (F32)
//   DIR/state.json             a JSON object: "step" (completed steps, an integer in
//                              [0, 2^31)), "config" (the model config, core/config.h),
//                              "data_position" (an object, io/data.h), and whatever else the
//                              trainer records; of that, "schedule_steps" (>= 1),
//                              "optimizer_steps" (<= step) and "options" ({flag: string or
//                              true/false}) are checked where present
//   DIR/manifest.json          written LAST: {"format": "sppo-checkpoint", "version": 1,
//                              "files": {"<name>": {"size": bytes, "xxh64": "<16 hex>"}}}
//
// Loading verifies the manifest first (every file present, sizes and checksums equal) and
// then that the caller's tensor lists match the files exactly (names, shapes, F32) before
// a single byte lands in a caller buffer, so a refused checkpoint leaves the buffers as
// they were. Every refusal names the file and what mismatched.
//
// Note [Checkpoint crash windows]
// save_checkpoint(DIR) writes every file into DIR.tmp-<pid> (fsynced, manifest last), then:
//   (1) rename DIR -> DIR.old-<pid>      (only if DIR exists)
//   (2) rename DIR.tmp-<pid> -> DIR
//   (3) fsync the parent; remove DIR.old-<pid>, other DIR.old-*, and DIR.tmp-* left by
//       processes that no longer run.
// A crash before (1) leaves DIR intact plus a stray DIR.tmp-<pid>, which loading ignores.
// A crash between (1) and (2) leaves no DIR, but a complete DIR.old-<pid>: loading DIR then
// falls back to the newest verified DIR.old-* and says so through `loaded_from`. (The new
// DIR.tmp-<pid> is complete too, but it is not trusted: it was never published.)
// A crash during (3) leaves DIR complete plus leftovers that the next save removes.
// If DIR exists but is not a checkpoint (no manifest.json, or files a checkpoint does not
// have), saving refuses instead of moving it aside and deleting it.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config.h"

namespace sppo::io {

// A tensor in caller memory: numel(shape) contiguous floats at `data`. Save reads it;
// load writes it.
struct CheckpointTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  float* data = nullptr;
};

inline constexpr const char* kCheckpointModelFile = "model.safetensors";
inline constexpr const char* kCheckpointOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kCheckpointStateFile = "state.json";
inline constexpr const char* kCheckpointManifestFile = "manifest.json";
// The options of the run that wrote it, as TOML (`sppo train --config` reads it); optional.
inline constexpr const char* kCheckpointConfigFile = "config.toml";

// The fields of state.json every checkpoint has, read and checked.
struct CheckpointState {
  int step = 0;                  // optimizer steps completed
  ModelConfig config;            // validated (ModelConfig::validate)
  nlohmann::json data_position;  // an object; the data source's seek() checks the rest
  nlohmann::json json;           // the whole state.json, other fields included
};

// Checks `state` as state.json of a checkpoint (see the layout above) and returns its
// fields. Throws sppo::Error naming `file` and the field at fault. load_checkpoint and
// read_checkpoint_state call it, and save_checkpoint refuses a state it would reject.
CheckpointState parse_checkpoint_state(const nlohmann::json& state, const std::string& file);

// `state` must pass parse_checkpoint_state. `config`: config.toml's text (none when empty).
void save_checkpoint(const std::string& dir, const std::vector<CheckpointTensor>& weights,
                     const std::vector<CheckpointTensor>& optimizer, const nlohmann::json& state,
                     const std::string& config = {});

// Fills the caller's buffers and returns the saved state. Names and shapes must match the
// checkpoint exactly: a tensor missing from either side is an error. `loaded_from`, when
// given, receives the directory actually read (differs from `dir` after a fallback to a
// DIR.old-* left by an interrupted save).
nlohmann::json load_checkpoint(const std::string& dir, const std::vector<CheckpointTensor>& weights,
                               const std::vector<CheckpointTensor>& optimizer,
                               std::string* loaded_from = nullptr);
// The weights alone (`train --init`, `grads --init`), whatever optimizer state the
// checkpoint holds, with the same checks.
nlohmann::json load_checkpoint_weights(const std::string& dir, const std::vector<CheckpointTensor>& weights,
                                       std::string* loaded_from = nullptr);

// Verifies the manifest and returns state.json without touching tensors: what a trainer
// reads first to rebuild its model and optimizer from the saved config. The state passed
// parse_checkpoint_state.
nlohmann::json read_checkpoint_state(const std::string& dir, std::string* loaded_from = nullptr);
// The checkpoint's config.toml (verified as the rest), or "" when it has none.
std::string read_checkpoint_config(const std::string& dir);

// For crash-consistency tests: when set, save_checkpoint calls hook(k, what) at each of its
// steps in order (k = 0, 1, ...; `what` names the step, see Note [Checkpoint crash
// windows]), so that a test can kill the process at every point of a save. Null: off.
using SaveStepHook = void (*)(int step, const char* what);
void set_save_step_hook(SaveStepHook hook);

// Throws unless every file of the checkpoint is present with the size and checksum its
// manifest lists. Returns the directory verified (see `loaded_from`).
std::string verify_checkpoint(const std::string& dir);

// True if DIR (or a fallback DIR.old-*) holds a manifest. Cheap: checksums are not read.
bool checkpoint_exists(const std::string& dir);

}  // namespace sppo::io
