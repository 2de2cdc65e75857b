#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/fileutil.h"
#include "support/expect_error.h"

namespace sppo::io {
namespace {

using ::sppo::testing::error_of;

namespace fs = std::filesystem;

// A model's tensors in owned memory, described as CheckpointTensors.
struct Tensors {
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::vector<float>> data;

  void add(const std::string& name, std::vector<std::int64_t> shape, std::mt19937_64& rng) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::normal_distribution<float> dist;
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = dist(rng);
    names.push_back(name), shapes.push_back(std::move(shape)), data.push_back(std::move(v));
  }
  // Same names and shapes, buffers filled with `fill`.
  Tensors like(float fill) const {
    Tensors t = *this;
    for (auto& v : t.data) std::fill(v.begin(), v.end(), fill);
    return t;
  }
  std::vector<CheckpointTensor> views() {
    std::vector<CheckpointTensor> out;
    for (std::size_t i = 0; i < names.size(); ++i) out.push_back({names[i], shapes[i], data[i].data()});
    return out;
  }
};

struct Model {
  Tensors weights, optimizer;
  nlohmann::json state;
};

Model make_model(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model m;
  m.weights.add("embedding", {64, 16}, rng);
  m.weights.add("layer.0.qkv.w", {48, 16}, rng);
  m.weights.add("layer.0.qkv.b", {48}, rng);
  m.weights.add("ln_f.g", {16}, rng);
  for (std::size_t i = 0; i < m.weights.names.size(); ++i) {
    m.optimizer.add(m.weights.names[i] + ".m", m.weights.shapes[i], rng);
    m.optimizer.add(m.weights.names[i] + ".v", m.weights.shapes[i], rng);
  }
  m.state = {{"step", seed * 100},
             {"data_position", {{"kind", "repeat"}, {"sequence", 17}}},
             {"rng", "12345 67890"},
             {"config", {{"vocab", 64}, {"hidden", 16}, {"layers", 1}, {"heads", 2}}},
             {"schedule_steps", 200},
             {"optimizer_steps", seed * 100 - 1},
             {"options", {{"--seq-len", "4096"}, {"--recompute", false}}}};
  return m;
}

void save(const std::string& dir, Model& m) {
  save_checkpoint(dir, m.weights.views(), m.optimizer.views(), m.state);
}

// Loads into fresh buffers and checks they equal `m`.
void expect_loads_as(const std::string& dir, const Model& m) {
  Tensors w = m.weights.like(0), o = m.optimizer.like(0);
  const nlohmann::json state = load_checkpoint(dir, w.views(), o.views());
  EXPECT_EQ(state, m.state);
  EXPECT_EQ(w.data, m.weights.data);
  EXPECT_EQ(o.data, m.optimizer.data);
}

// Attempts a load that must fail; checks the message and that no buffer changed.
void expect_refused(const std::string& dir, const Model& m, std::initializer_list<const char*> parts) {
  Tensors w = m.weights.like(-3), o = m.optimizer.like(-3);
  const std::string msg = error_of([&] { load_checkpoint(dir, w.views(), o.views()); });
  EXPECT_FALSE(msg.empty()) << "load accepted a bad checkpoint";
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "lacks \"" << p << "\": " << msg;
  EXPECT_EQ(w.data, m.weights.like(-3).data) << "weights changed by a refused load";
  EXPECT_EQ(o.data, m.optimizer.like(-3).data) << "optimizer state changed by a refused load";
}

void flip_byte(const std::string& path, std::uint64_t offset) {
  std::string bytes = read_file(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x10);
  write_file_atomic(path, bytes);
}

void truncate_file(const std::string& path, std::uint64_t drop) {
  std::string bytes = read_file(path);
  write_file_atomic(path, std::string_view(bytes.data(), bytes.size() - drop));
}

class IoCheckpoint : public ::testing::Test {
 protected:
  TempDir tmp{"sppo-io-test"};
  std::string dir = tmp.file("run/ckpt");
  Model model = make_model(1);
};

TEST_F(IoCheckpoint, RoundTrip) {
  EXPECT_FALSE(checkpoint_exists(dir));
  save(dir, model);
  EXPECT_TRUE(checkpoint_exists(dir));
  for (const char* f : {kCheckpointModelFile, kCheckpointOptimizerFile, kCheckpointStateFile, kCheckpointManifestFile})
    EXPECT_TRUE(fs::is_regular_file(fs::path(dir) / f)) << f;
  expect_loads_as(dir, model);
  expect_loads_as(dir + "/", model);
  EXPECT_EQ(read_checkpoint_state(dir), model.state);
  EXPECT_EQ(verify_checkpoint(dir), dir);
  // Only the checkpoint remains beside it: no temporaries.
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.file("run")), fs::directory_iterator()), 1);
}

TEST_F(IoCheckpoint, SavingAgainReplacesAndCleansUp) {
  save(dir, model);
  Model next = make_model(2);
  save(dir, next);
  expect_loads_as(dir, next);
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.file("run")), fs::directory_iterator()), 1);
}

TEST_F(IoCheckpoint, TruncatedFilesAreRefused) {
  save(dir, model);
  for (const char* f : {kCheckpointModelFile, kCheckpointOptimizerFile, kCheckpointStateFile}) {
    SCOPED_TRACE(f);
    const std::string path = (fs::path(dir) / f).string();
    const std::string good = read_file(path);
    truncate_file(path, 4);
    expect_refused(dir, model, {f, "truncated"});
    write_file_atomic(path, good);
    expect_loads_as(dir, model);
  }
}

TEST_F(IoCheckpoint, FlippedBytesAreRefused) {
  save(dir, model);
  for (const char* f : {kCheckpointModelFile, kCheckpointOptimizerFile, kCheckpointStateFile}) {
    const std::string path = (fs::path(dir) / f).string();
    const std::string good = read_file(path);
    for (std::uint64_t off : {std::uint64_t{0}, std::uint64_t{good.size() / 2}, std::uint64_t{good.size() - 1}}) {
      SCOPED_TRACE(std::string(f) + " byte " + std::to_string(off));
      flip_byte(path, off);
      expect_refused(dir, model, {f, "checksum", "corrupted"});
      write_file_atomic(path, good);
    }
  }
  expect_loads_as(dir, model);
}

TEST_F(IoCheckpoint, MissingManifestOrFileIsRefused) {
  save(dir, model);
  const fs::path manifest = fs::path(dir) / kCheckpointManifestFile;
  const std::string manifest_bytes = read_file(manifest.string());
  fs::remove(manifest);
  EXPECT_FALSE(checkpoint_exists(dir));
  expect_refused(dir, model, {"manifest.json", "incomplete"});
  write_file_atomic(manifest.string(), manifest_bytes);

  const fs::path opt = fs::path(dir) / kCheckpointOptimizerFile;
  const std::string opt_bytes = read_file(opt.string());
  fs::remove(opt);
  expect_refused(dir, model, {"optimizer.safetensors", "missing"});
  write_file_atomic(opt.string(), opt_bytes);
  expect_loads_as(dir, model);

  expect_refused(tmp.file("elsewhere"), model, {"elsewhere", "does not exist"});
}

TEST_F(IoCheckpoint, NameAndShapeMismatchesAreRefusedBeforeAnyWrite) {
  save(dir, model);
  {
    Model fewer = model;  // the checkpoint holds a tensor this model lacks
    fewer.weights.names.pop_back(), fewer.weights.shapes.pop_back(), fewer.weights.data.pop_back();
    expect_refused(dir, fewer, {"model.safetensors", "does not have", "'ln_f.g'"});
  }
  {
    Model more = model;  // this model has a tensor the checkpoint lacks
    std::mt19937_64 rng(9);
    more.optimizer.add("extra.m", {3}, rng);
    expect_refused(dir, more, {"optimizer.safetensors", "lacks", "'extra.m'"});
  }
  {
    Model reshaped = model;
    reshaped.weights.shapes[1] = {16, 48};
    expect_refused(dir, reshaped, {"'layer.0.qkv.w'", "[48, 16]", "[16, 48]"});
  }
}

TEST_F(IoCheckpoint, InterruptedSaveDoesNotAffectTheLastGoodOne) {
  save(dir, model);
  // A save that died while writing: a partial temporary directory beside the checkpoint.
  const fs::path partial = dir + ".tmp-123";
  fs::create_directories(partial);
  write_file_atomic((partial / kCheckpointModelFile).string(), std::string_view("garbage"));
  expect_loads_as(dir, model);
  // The next save succeeds, and a temporary of a process that no longer runs is removed
  // (pid 123 is alive only in unusual environments; then it is left alone).
  Model next = make_model(3);
  save(dir, next);
  expect_loads_as(dir, next);
}

TEST_F(IoCheckpoint, CrashBetweenRenamesFallsBackToOld) {
  save(dir, model);
  // The state after step (1) of Note [Checkpoint crash windows]: DIR moved aside, the new
  // checkpoint not yet published.
  const std::string old = dir + ".old-4242";
  fs::rename(dir, old);
  fs::create_directories(dir + ".tmp-4242");
  EXPECT_TRUE(checkpoint_exists(dir));
  Tensors w = model.weights.like(0), o = model.optimizer.like(0);
  std::string from;
  EXPECT_EQ(load_checkpoint(dir, w.views(), o.views(), &from), model.state);
  EXPECT_EQ(from, old);
  EXPECT_EQ(w.data, model.weights.data);
  // Saving again publishes DIR and removes the leftovers.
  save(dir, model);
  EXPECT_FALSE(fs::exists(old));
  expect_loads_as(dir, model);
}

TEST_F(IoCheckpoint, CorruptOldIsNotAFallback) {
  save(dir, model);
  const std::string old = dir + ".old-4242";
  fs::rename(dir, old);
  flip_byte((fs::path(old) / kCheckpointModelFile).string(), 100);
  expect_refused(dir, model, {"ckpt.old-4242", "model.safetensors", "checksum"});
}

TEST_F(IoCheckpoint, RefusesToSaveOverSomethingElse) {
  fs::create_directories(dir);
  write_file_atomic(dir + "/notes.txt", std::string_view("mine"));
  EXPECT_ERROR_WITH(save(dir, model), "notes.txt", "would delete");
  EXPECT_EQ(read_file(dir + "/notes.txt"), "mine");

  const std::string file = tmp.file("plain");
  write_file_atomic(file, std::string_view("x"));
  EXPECT_ERROR_WITH(save(file, model), "not a directory");

  const std::string half = tmp.file("half");
  fs::create_directories(half);
  write_file_atomic(half + "/" + kCheckpointModelFile, std::string_view("x"));
  EXPECT_ERROR_WITH(save(half, model), "no manifest.json");
}

TEST_F(IoCheckpoint, FailedSaveLeavesThePreviousCheckpoint) {
  save(dir, model);
  Model bad = make_model(5);
  bad.weights.names[1] = bad.weights.names[0];  // duplicate name: the writer refuses
  EXPECT_ERROR_WITH(save(dir, bad), "twice");
  expect_loads_as(dir, model);
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.file("run")), fs::directory_iterator()), 1);
}

// state.json whose checksums match but whose content is wrong: rewritten with a manifest
// that lists the new size and checksum, as a user editing a checkpoint would leave it.
void rewrite_state(const std::string& dir, const std::string& text) {
  const std::string path = dir + "/" + kCheckpointStateFile;
  write_file_atomic(path, text);
  nlohmann::json manifest = nlohmann::json::parse(read_file(dir + "/" + kCheckpointManifestFile));
  const FileDigest d = digest_file(path);
  manifest["files"][kCheckpointStateFile] = {{"size", d.size}, {"xxh64", hex64(d.xxh64)}};
  write_file_atomic(dir + "/" + kCheckpointManifestFile, manifest.dump(2));
}

TEST_F(IoCheckpoint, StateWithBadFieldsIsRefusedNamingFileAndField) {
  save(dir, model);
  struct Case {
    nlohmann::json state;
    const char* field;
  };
  nlohmann::json no_config = model.state;
  no_config.erase("config");
  nlohmann::json no_position = model.state;
  no_position.erase("data_position");
  nlohmann::json no_step = model.state;
  no_step.erase("step");
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json j = model.state;
    j[key] = std::move(v);
    return j;
  };
  const Case cases[] = {
      {no_config, "lacks \"config\""},
      {no_position, "lacks \"data_position\""},
      {no_step, "lacks \"step\""},
      {with("step", "two"), "\"step\" is \"two\""},
      {with("step", -5), "\"step\" is -5"},
      {with("step", 2.5), "\"step\" is 2.5"},
      {with("step", 4294967296LL), "\"step\" is 4294967296"},
      {with("config", "tiny"), "\"config\" is not an object"},
      {with("config", {{"hidden", 16}}), "\"config\" is not a usable model config"},
      {with("config", {{"vocab", 64}, {"hidden", 15}, {"layers", 1}, {"heads", 2}}), "\"config\""},
      {with("data_position", 3), "\"data_position\" is not an object"},
      {nlohmann::json::array({1, 2}), "must hold a JSON object"},
      {with("schedule_steps", "two hundred"), "\"schedule_steps\" must be an integer in [1, "},
      {with("schedule_steps", 0), "\"schedule_steps\" must be an integer in [1, "},
      {with("optimizer_steps", 101), "\"optimizer_steps\" must be an integer in [0, 100] (got 101)"},
      {with("optimizer_steps", -1), "\"optimizer_steps\" must be an integer in [0, 100]"},
      {with("options", "--seq-len 4096"), "\"options\" is not an object"},
      {with("options", {{"--seq-len", 4096}}), "\"options\" holds --seq-len = 4096"},
  };
  for (const Case& c : cases) {
    rewrite_state(dir, c.state.dump());
    expect_refused(dir, model, {"state.json", c.field});
    EXPECT_ERROR_WITH(read_checkpoint_state(dir), "state.json", c.field);
  }
  rewrite_state(dir, model.state.dump());
  expect_loads_as(dir, model);
}

TEST_F(IoCheckpoint, ParsedStateHasTheFields) {
  const CheckpointState s = parse_checkpoint_state(model.state, "state.json");
  EXPECT_EQ(s.step, 100);
  EXPECT_EQ(s.config.hidden, 16);
  EXPECT_EQ(s.data_position["sequence"], 17);
  EXPECT_EQ(s.json, model.state);
  // A state built in memory holds signed integers; they are accepted as well.
  nlohmann::json signed_step = model.state;
  signed_step["step"] = int{7};
  signed_step["optimizer_steps"] = int{6};
  EXPECT_EQ(parse_checkpoint_state(signed_step, "state.json").step, 7);
}

TEST_F(IoCheckpoint, SavingAStateItCouldNotLoadIsRefused) {
  Model bad = make_model(6);
  bad.state.erase("config");
  EXPECT_ERROR_WITH(save(dir, bad), "state.json", "lacks \"config\"");
  EXPECT_FALSE(fs::exists(dir));
}

}  // namespace
}  // namespace sppo::io
