// `sppo import` and `sppo export`: Hugging Face checkpoints in and out (io/hf.h).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/check.h"
#include "core/config.h"
#include "core/layout.h"
#include "io/checkpoint.h"
#include "io/hf.h"

namespace sppo::cli {

namespace {

// The checkpoint tensors of model c, views into `params` (num_params floats).
std::vector<io::CheckpointTensor> tensors_of(const ModelConfig& c, std::vector<float>& params) {
  std::vector<io::CheckpointTensor> weights;
  float* at = params.data();
  for (const TensorSpec& t : parameter_specs(c)) {
    weights.push_back({t.name, t.shape, at});
    at += t.numel();
  }
  return weights;
}

void add_import(CLI::App& app, Commands& out) {
  struct Import {
    std::string dir, out;
  };
  auto o = std::make_shared<Import>();
  auto* cmd = app.add_subcommand(
      "import", "Write an sppo checkpoint (the model, no optimizer state) from a Hugging Face model directory");
  cmd->add_option("hf_dir", o->dir, "Directory with config.json and model*.safetensors")->required();
  cmd->add_option("--out", o->out, "The checkpoint directory to write (train --init reads it)")->required();
  out.push_back({cmd, [o](const Invocation&) {
                   SPPO_CHECK(io::is_hf_dir(o->dir), "hf")
                       << o->dir << " is not a Hugging Face model directory (a config.json with \"architectures\")";
                   const ModelConfig c = io::hf_read_config(o->dir);
                   std::vector<float> params(std::size_t(c.num_params()));
                   io::hf_read_weights(o->dir, c, params.data());  // every tensor checked before anything is written
                   const nlohmann::json state = {{"step", 0},
                                                 {"config", to_json(c)},
                                                 {"data_position", nlohmann::json::object()},
                                                 {"imported_from", std::filesystem::absolute(o->dir).string()}};
                   io::save_checkpoint(o->out, tensors_of(c, params), {}, state);
                   std::printf("imported %s: %s, %.3g parameters -> %s\n", o->dir.c_str(), to_json(c).dump().c_str(),
                               double(c.num_params()), o->out.c_str());
                   return 0;
                 }});
}

void add_export(CLI::App& app, Commands& out) {
  struct Export {
    std::string checkpoint, out, format = "hf", dtype = "checkpoint", positions, shard = "5GB";
  };
  auto o = std::make_shared<Export>();
  auto* cmd = app.add_subcommand("export", "Write a checkpoint's model in another format");
  cmd->add_option("checkpoint", o->checkpoint, "An sppo checkpoint directory (train --save)")->required();
  cmd->add_option("--format", o->format, "hf: Hugging Face's config.json and safetensors")->capture_default_str();
  cmd->add_option("--out", o->out, "Directory to write")->required();
  cmd->add_option("--dtype", o->dtype, "Weights' type: checkpoint (fp32, as the checkpoint holds them), fp32, or bf16")
      ->capture_default_str();
  cmd->add_option("--max-positions", o->positions,
                  "max_position_embeddings to write (default: the longest --seq-len the checkpoint was "
                  "trained at, if longer than the model's; kept for dynamic and yarn scaling, which scale "
                  "from it)");
  cmd->add_option("--shard-size", o->shard, "Largest safetensors shard, e.g. 5GB")->capture_default_str();
  out.push_back({cmd, [o](const Invocation&) {
                   SPPO_CHECK(o->format == "hf", "options") << "--format '" << o->format << "': the formats are: hf";
                   SPPO_CHECK(o->dtype == "checkpoint" || o->dtype == "fp32" || o->dtype == "bf16", "options")
                       << "--dtype '" << o->dtype << "': use checkpoint, fp32 or bf16";
                   std::string from;
                   const io::CheckpointState st = io::parse_checkpoint_state(
                       io::read_checkpoint_state(o->checkpoint, &from), o->checkpoint + "/state.json");
                   const ModelConfig& c = st.config;
                   SPPO_CHECK(c.llama(), "options")
                       << o->checkpoint << " holds a GPT model; --format hf writes Llama-family models";
                   std::vector<float> params(std::size_t(c.num_params()));
                   io::load_checkpoint_weights(o->checkpoint, tensors_of(c, params));
                   i64 positions = o->positions.empty() ? 0 : parse_count(o->positions, "--max-positions");
                   if (o->positions.empty() && st.json.contains("options") && st.json["options"].contains("--seq-len"))
                     positions = parse_count(st.json["options"]["--seq-len"].get<std::string>(), "--seq-len");
                   io::hf_write(o->out, c, params.data(), o->dtype == "bf16" ? "bfloat16" : "float32", positions,
                                parse_bytes(o->shard, "--shard-size"));
                   std::printf("exported %s (step %d) to %s\n", from.c_str(), st.step, o->out.c_str());
                   return 0;
                 }});
}

}  // namespace

void add_model_commands(CLI::App& app, Commands& out) {
  add_import(app, out);
  add_export(app, out);
}

}  // namespace sppo::cli
