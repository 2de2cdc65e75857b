#include "io/checkpoint.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "core/check.h"
#include "core/json_fields.h"
#include "io/fileutil.h"
#include "io/safetensors.h"

namespace sppo::io {

namespace fs = std::filesystem;

namespace {

constexpr const char* kComponent = "checkpoint";
constexpr const char* kFormat = "sppo-checkpoint";
constexpr int kVersion = 1;
constexpr std::size_t kMaxNamesListed = 5;  // names quoted in one mismatch message

SaveStepHook g_save_step_hook = nullptr;

// Marks step `k` of a save for the crash-consistency tests (set_save_step_hook).
void save_step(int k, const char* what) {
  if (g_save_step_hook != nullptr) g_save_step_hook(k, what);
}

const char* const kCheckpointFiles[] = {kCheckpointModelFile, kCheckpointOptimizerFile, kCheckpointStateFile,
                                        kCheckpointManifestFile, kCheckpointConfigFile};

// "ckpt/" and "ckpt" name the same checkpoint; siblings are formed from the last component.
fs::path normalize(const std::string& dir) {
  SPPO_CHECK(!dir.empty(), kComponent) << "checkpoint directory is empty; pass a path";
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  const std::string base = p.filename().string();
  SPPO_CHECK(!base.empty() && base != "." && base != "..", kComponent)
      << "checkpoint path '" << dir << "' must name a directory of its own (e.g. runs/ckpt)";
  return p;
}

fs::path parent_of(const fs::path& p) { return p.has_parent_path() ? p.parent_path() : fs::path("."); }

// Siblings `<base><tag><pid>` of `p` (tag ".old-" or ".tmp-"), with their pids.
std::vector<std::pair<fs::path, long>> siblings(const fs::path& p, const std::string& tag) {
  std::vector<std::pair<fs::path, long>> out;
  const std::string prefix = p.filename().string() + tag;
  std::error_code ec;
  for (fs::directory_iterator it(parent_of(p), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        digits.size() > 9)
      continue;
    out.emplace_back(it->path(), std::stol(digits));
  }
  return out;
}

bool process_alive(long pid) { return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  SPPO_CHECK(!ec, kComponent) << "cannot remove " << p.string() << ": " << ec.message();
}

void rename_checked(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  SPPO_CHECK(!ec, kComponent) << "cannot rename " << from.string() << " to " << to.string()
                              << ": " << ec.message();
}

nlohmann::json parse_json_file(const fs::path& path) {
  const std::string text = read_file(path.string());
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e999
    SPPO_CHECK(false, kComponent) << path.string() << " is not valid JSON: " << e.what();
  }
  __builtin_unreachable();
}

// DIR itself if it holds a manifest, else the newest DIR.old-* that does (see
// Note [Checkpoint crash windows]). Empty if neither exists.
fs::path locate(const fs::path& p) {
  std::error_code ec;
  if (fs::exists(p / kCheckpointManifestFile, ec)) return p;
  if (fs::exists(p, ec)) return {};
  fs::path best;
  fs::file_time_type best_time;
  for (const auto& [old, pid] : siblings(p, ".old-")) {
    if (!fs::exists(old / kCheckpointManifestFile, ec)) continue;
    auto t = fs::last_write_time(old / kCheckpointManifestFile, ec);
    if (ec) continue;
    if (best.empty() || t > best_time) best = old, best_time = t;
  }
  return best;
}

fs::path locate_or_throw(const std::string& dir) {
  const fs::path p = normalize(dir);
  const fs::path found = locate(p);
  if (!found.empty()) return found;
  std::error_code ec;
  const auto tmps = siblings(p, ".tmp-");
  const std::string partial =
      tmps.empty() ? "" : " (" + tmps.front().first.string() + " is an unfinished save, not used)";
  SPPO_CHECK(fs::exists(p, ec), kComponent)
      << "no checkpoint at " << p.string() << ": the directory does not exist" << partial;
  SPPO_CHECK(false, kComponent)
      << p.string() << " has no " << kCheckpointManifestFile
      << ": the checkpoint is incomplete (an interrupted copy?) and cannot be trusted" << partial;
  __builtin_unreachable();
}

void verify_dir(const fs::path& d) {
  const fs::path manifest_path = d / kCheckpointManifestFile;
  const nlohmann::json manifest = parse_json_file(manifest_path);
  SPPO_CHECK(manifest.is_object() && manifest.contains("format") && manifest["format"] == kFormat, kComponent)
      << manifest_path.string() << " is not an sppo checkpoint manifest (\"format\" must be \""
      << kFormat << "\")";
  SPPO_CHECK(manifest.contains("version") && manifest["version"] == kVersion, kComponent)
      << manifest_path.string() << ": manifest version "
      << (manifest.contains("version") ? manifest["version"].dump() : "(none)")
      << " is not supported (this build reads version " << kVersion << ")";
  SPPO_CHECK(manifest.contains("files") && manifest["files"].is_object(), kComponent)
      << manifest_path.string() << ": missing object \"files\"";
  const auto& files = manifest["files"];
  for (const char* required : {kCheckpointModelFile, kCheckpointOptimizerFile, kCheckpointStateFile})
    SPPO_CHECK(files.contains(required), kComponent)
        << manifest_path.string() << " does not list " << required;
  for (const auto& [name, entry] : files.items()) {
    const fs::path file = d / name;
    SPPO_CHECK(name.find('/') == std::string::npos && name != "." && name != "..", kComponent)
        << manifest_path.string() << ": file name '" << name << "' must be a plain name";
    SPPO_CHECK(entry.is_object() && entry.contains("size") && entry["size"].is_number_unsigned() &&
                   entry.contains("xxh64") && entry["xxh64"].is_string(),
               kComponent)
        << manifest_path.string() << ": entry for " << name << " needs \"size\" and \"xxh64\"";
    std::error_code ec;
    SPPO_CHECK(fs::is_regular_file(file, ec), kComponent)
        << file.string() << " is missing (listed in " << kCheckpointManifestFile
        << "); the checkpoint is incomplete";
    const std::uint64_t want_size = entry["size"].get<std::uint64_t>();
    const std::uint64_t have_size = fs::file_size(file, ec);
    SPPO_CHECK(!ec, kComponent) << "cannot stat " << file.string() << ": " << ec.message();
    SPPO_CHECK(have_size == want_size, kComponent)
        << file.string() << " is " << have_size << " bytes but the manifest says " << want_size
        << (have_size < want_size ? " (truncated)" : " (grown)");
    const FileDigest got = digest_file(file.string());
    SPPO_CHECK(got.size == want_size, kComponent)
        << file.string() << " changed size while being verified";
    const std::string want_hash = entry["xxh64"].get<std::string>();
    SPPO_CHECK(hex64(got.xxh64) == want_hash, kComponent)
        << file.string() << " has checksum xxh64 " << hex64(got.xxh64) << " but the manifest says "
        << want_hash << " (the file is corrupted)";
  }
}

std::string list_names(const std::vector<std::string>& names) {
  std::ostringstream os;
  for (std::size_t i = 0; i < names.size() && i < kMaxNamesListed; ++i) os << (i ? ", " : "") << "'" << names[i] << "'";
  if (names.size() > kMaxNamesListed) os << " and " << names.size() - kMaxNamesListed << " more";
  return os.str();
}

// Names, shapes and dtypes of the file equal the caller's list, exactly.
void match_tensors(const SafetensorsReader& r, const std::vector<CheckpointTensor>& want) {
  std::set<std::string> wanted;
  std::vector<std::string> missing, extra;
  for (const auto& t : want) {
    SPPO_CHECK(wanted.insert(t.name).second, kComponent)
        << "tensor '" << t.name << "' is passed twice for " << r.path();
    const TensorInfo* info = r.find(t.name);
    if (info == nullptr) {
      missing.push_back(t.name);
      continue;
    }
    SPPO_CHECK(info->shape == t.shape, kComponent)
        << r.path() << ": tensor '" << t.name << "' has shape " << shape_str(info->shape)
        << " but the model expects " << shape_str(t.shape)
        << " (was the checkpoint saved with another config?)";
    SPPO_CHECK(info->dtype == DType::F32, kComponent)
        << r.path() << ": tensor '" << t.name << "' is " << dtype_name(info->dtype)
        << "; checkpoints hold F32";
    SPPO_CHECK(info->nbytes() == 0 || t.data != nullptr, kComponent)
        << "tensor '" << t.name << "' has a null buffer";
  }
  for (const auto& info : r.tensors())
    if (!wanted.count(info.name)) extra.push_back(info.name);
  SPPO_CHECK(missing.empty(), kComponent)
      << r.path() << " lacks " << missing.size() << " tensor(s) the model has: " << list_names(missing)
      << " (was the checkpoint saved with another config?)";
  SPPO_CHECK(extra.empty(), kComponent)
      << r.path() << " holds " << extra.size() << " tensor(s) the model does not have: "
      << list_names(extra) << " (was the checkpoint saved with another config?)";
}

std::vector<TensorView> views(const std::vector<CheckpointTensor>& ts) {
  std::vector<TensorView> v;
  v.reserve(ts.size());
  for (const auto& t : ts) v.push_back({t.name, DType::F32, t.shape, t.data});
  return v;
}

// Saving over DIR moves it aside and deletes it, so DIR must hold nothing but a checkpoint.
void check_replaceable(const fs::path& p) {
  std::error_code ec;
  if (!fs::exists(p, ec)) return;
  SPPO_CHECK(fs::is_directory(p, ec), kComponent)
      << p.string() << " exists and is not a directory; choose another checkpoint path";
  const std::set<std::string> known(std::begin(kCheckpointFiles), std::end(kCheckpointFiles));
  bool empty = true;
  for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
    empty = false;
    const std::string name = it->path().filename().string();
    SPPO_CHECK(known.count(name) != 0, kComponent)
        << p.string() << " holds '" << name << "', which is not part of a checkpoint; saving "
        << "would delete it. Move it away or choose another checkpoint path";
  }
  SPPO_CHECK(!ec, kComponent) << "cannot list " << p.string() << ": " << ec.message();
  SPPO_CHECK(empty || fs::exists(p / kCheckpointManifestFile, ec), kComponent)
      << p.string() << " exists but has no " << kCheckpointManifestFile
      << ", so it is not a complete checkpoint; remove it or choose another path";
}

}  // namespace

CheckpointState parse_checkpoint_state(const nlohmann::json& state, const std::string& file) {
  SPPO_CHECK(state.is_object(), kComponent)
      << file << " must hold a JSON object with \"step\", \"config\" and \"data_position\", not "
      << state.type_name();
  CheckpointState s;
  const auto step = state.find("step");
  SPPO_CHECK(step != state.end(), kComponent) << file << " lacks \"step\" (the steps completed)";
  constexpr std::uint64_t kMaxStep = std::numeric_limits<int>::max();
  // Parsed JSON holds non-negative integers as unsigned; a json built in memory from an int
  // holds a signed one.
  const bool whole = step->is_number_unsigned() ? step->get<std::uint64_t>() <= kMaxStep
                     : step->is_number_integer()
                         ? step->get<std::int64_t>() >= 0 && std::uint64_t(step->get<std::int64_t>()) <= kMaxStep
                         : false;
  SPPO_CHECK(whole, kComponent)
      << file << ": \"step\" is " << step->dump() << "; it must be a whole number of steps in [0, "
      << kMaxStep << "]";
  s.step = static_cast<int>(step->get<std::uint64_t>());
  const auto config = state.find("config");
  SPPO_CHECK(config != state.end() && config->is_object(), kComponent)
      << file << (config == state.end() ? " lacks \"config\"" : ": \"config\" is not an object")
      << "; it must hold the model config {vocab, hidden, layers, heads, ...}";
  try {
    s.config = model_config_from_json(*config);
  } catch (const Error& e) {
    SPPO_CHECK(false, kComponent) << file << ": \"config\" is not a usable model config: " << e.what();
  }
  const auto position = state.find("data_position");
  SPPO_CHECK(position != state.end() && position->is_object(), kComponent)
      << file << (position == state.end() ? " lacks \"data_position\"" : ": \"data_position\" is not an object")
      << "; it must hold where the data stream continues";
  s.data_position = *position;
  // What the trainer records besides (train/trainer.cpp), checked where present so that
  // resuming reads them without surprises: the learning-rate schedule's length, the
  // optimizer updates so far (skipped steps make fewer than `step`), and the options
  // that change the numbers, as flag -> value.
  const std::string where = file + ": ";
  json_integer_field(state, "schedule_steps", 1, 1, kMaxStep, kComponent, where);
  json_integer_field(state, "optimizer_steps", 0, 0, s.step, kComponent, where);
  if (const auto options = state.find("options"); options != state.end()) {
    SPPO_CHECK(options->is_object(), kComponent)
        << file << ": \"options\" is not an object; it must map flags to their values";
    for (auto it = options->begin(); it != options->end(); ++it)
      SPPO_CHECK(it.value().is_string() || it.value().is_boolean(), kComponent)
          << file << ": \"options\" holds " << it.key() << " = " << it.value().dump()
          << "; every value must be a string or true/false";
  }
  s.json = state;
  return s;
}

void save_checkpoint(const std::string& dir, const std::vector<CheckpointTensor>& weights,
                     const std::vector<CheckpointTensor>& optimizer, const nlohmann::json& state,
                     const std::string& config) {
  const fs::path p = normalize(dir);
  parse_checkpoint_state(state, (p / kCheckpointStateFile).string());
  const fs::path parent = parent_of(p);
  std::error_code ec;
  fs::create_directories(parent, ec);
  SPPO_CHECK(!ec, kComponent) << "cannot create " << parent.string() << ": " << ec.message();
  check_replaceable(p);

  const std::string pid = std::to_string(::getpid());
  const fs::path tmp = p.string() + ".tmp-" + pid;
  const fs::path old = p.string() + ".old-" + pid;
  save_step(0, "start");
  if (fs::exists(tmp, ec)) remove_tree(tmp);
  SPPO_CHECK(fs::create_directory(tmp, ec) && !ec, kComponent)
      << "cannot create " << tmp.string() << ": " << ec.message();
  save_step(1, "temporary directory created");

  try {
    nlohmann::json files = nlohmann::json::object();
    auto record = [&](const char* name, const FileDigest& d) {
      files[name] = {{"size", d.size}, {"xxh64", hex64(d.xxh64)}};
    };
    record(kCheckpointModelFile, write_safetensors((tmp / kCheckpointModelFile).string(), views(weights)));
    save_step(2, "model written");
    record(kCheckpointOptimizerFile,
           write_safetensors((tmp / kCheckpointOptimizerFile).string(), views(optimizer)));
    save_step(3, "optimizer written");
    record(kCheckpointStateFile, write_file_atomic((tmp / kCheckpointStateFile).string(), state.dump(2) + "\n"));
    save_step(4, "state written");
    if (!config.empty()) record(kCheckpointConfigFile, write_file_atomic((tmp / kCheckpointConfigFile).string(), config));
    const nlohmann::json manifest = {{"format", kFormat}, {"version", kVersion}, {"files", files}};
    write_file_atomic((tmp / kCheckpointManifestFile).string(), manifest.dump(2) + "\n");
    save_step(5, "manifest written");
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }

  // Publish; see Note [Checkpoint crash windows].
  const bool had_previous = fs::exists(p, ec);
  if (had_previous) {
    if (fs::exists(old, ec)) remove_tree(old);  // left by an earlier process with our pid
    rename_checked(p, old);
  }
  save_step(6, "previous checkpoint moved aside");
  try {
    rename_checked(tmp, p);
  } catch (...) {
    std::error_code ignored;
    if (had_previous) fs::rename(old, p, ignored);
    fs::remove_all(tmp, ignored);
    throw;
  }
  save_step(7, "published");
  fsync_dir(parent.string());
  save_step(8, "parent directory synced");

  for (const auto& [stale, stale_pid] : siblings(p, ".old-")) remove_tree(stale);
  save_step(9, "previous checkpoints removed");
  for (const auto& [stale, stale_pid] : siblings(p, ".tmp-"))
    if (!process_alive(stale_pid)) remove_tree(stale);
  save_step(10, "done");
}

void set_save_step_hook(SaveStepHook hook) { g_save_step_hook = hook; }

std::string verify_checkpoint(const std::string& dir) {
  const fs::path d = locate_or_throw(dir);
  verify_dir(d);
  return d.string();
}

nlohmann::json read_checkpoint_state(const std::string& dir, std::string* loaded_from) {
  const std::string d = verify_checkpoint(dir);
  if (loaded_from != nullptr) *loaded_from = d;
  const fs::path file = fs::path(d) / kCheckpointStateFile;
  nlohmann::json state = parse_json_file(file);
  parse_checkpoint_state(state, file.string());
  return state;
}

std::string read_checkpoint_config(const std::string& dir) {
  const fs::path file = fs::path(verify_checkpoint(dir)) / kCheckpointConfigFile;
  std::error_code ec;
  if (!fs::exists(file, ec)) return "";
  return read_file(file.string());
}

nlohmann::json load_checkpoint(const std::string& dir, const std::vector<CheckpointTensor>& weights,
                               const std::vector<CheckpointTensor>& optimizer,
                               std::string* loaded_from) {
  const fs::path d = verify_checkpoint(dir);
  const SafetensorsReader model((d / kCheckpointModelFile).string());
  const SafetensorsReader opt((d / kCheckpointOptimizerFile).string());
  match_tensors(model, weights);
  match_tensors(opt, optimizer);
  nlohmann::json state = parse_json_file(d / kCheckpointStateFile);
  parse_checkpoint_state(state, (d / kCheckpointStateFile).string());
  // Everything is checked; only now do caller buffers change.
  for (const auto& t : weights) model.read(t.name, t.shape, t.data);
  for (const auto& t : optimizer) opt.read(t.name, t.shape, t.data);
  if (loaded_from != nullptr) *loaded_from = d.string();
  return state;
}

nlohmann::json load_checkpoint_weights(const std::string& dir, const std::vector<CheckpointTensor>& weights,
                                       std::string* loaded_from) {
  const fs::path d = verify_checkpoint(dir);
  const SafetensorsReader model((d / kCheckpointModelFile).string());
  match_tensors(model, weights);
  nlohmann::json state = parse_json_file(d / kCheckpointStateFile);
  parse_checkpoint_state(state, (d / kCheckpointStateFile).string());
  for (const auto& t : weights) model.read(t.name, t.shape, t.data);
  if (loaded_from != nullptr) *loaded_from = d.string();
  return state;
}

bool checkpoint_exists(const std::string& dir) { return !locate(normalize(dir)).empty(); }

}  // namespace sppo::io
