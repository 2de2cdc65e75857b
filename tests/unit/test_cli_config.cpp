// --config FILE (cli/config_file.h): options from a TOML file, the command line winning;
// train writes its run's options back as config.toml, into each checkpoint and beside the
// metrics, and --config of that file repeats the run bit for bit.
#include <gtest/gtest.h>

#include "io/fileutil.h"
#include "support/mpi_run.h"

namespace sppo {
namespace {

using testing::read_json;
using testing::read_jsonl;
using testing::run_command;

using io::read_file;

class Config : public testing::CommandTest {
 protected:
  Config() : CommandTest("sppo-config") {}
  void write(const std::string& name, const std::string& text) const { io::write_file_atomic(path(name), text); }
};

// Every kind of value: a string, an integer, a float, a flag, a size with a suffix.
TEST_F(Config, EveryValueKindRoundTripsAndRepeatsTheRun) {
  write("run.toml",
        "# a run\n"
        "model = \"llama-tiny\"\n"
        "layers = 2\n"
        "seq-len = \"128\"\n"
        "subseqs = \"2\"\n"
        "offload = \"0.5\"\n"
        "device-memory = \"1GiB\"\n"
        "steps = 4\n"
        "lr = 0.002\n"
        "quiet = true\n"
        "seed = 9\n");
  const std::string run = sppo() + " train --config " + path("run.toml");
  auto r = run_command(run + " --save " + path("a") + " --metrics " + path("a.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string written = read_file(path("a/config.toml"));
  for (const char* line : {"layers = 2\n", "lr = 0.002\n", "model = 'llama-tiny'\n", "offload = 0.5\n",
                           "quiet = true\n", "seed = 9\n", "seq-len = 128\n", "steps = 4\n", "warmup = 20\n",
                           "weight-decay = 0.1\n", "device-memory = '1GiB'\n"})
    EXPECT_NE(written.find(line), std::string::npos) << line << " is not in\n" << written;
  EXPECT_EQ(read_file(path("config.toml")), written) << "config.toml beside the metrics";
  // The written file repeats the run exactly.
  r = run_command(sppo() + " train --config " + path("a/config.toml") + " --save " + path("b") + " --metrics " +
                  path("b.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_file(path("b/model.safetensors")), read_file(path("a/model.safetensors")));
  // The command line wins over the file; resuming keeps the run's config.toml.
  r = run_command(run + " --steps 2 --save " + path("c") + " --metrics " + path("c.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_jsonl(path("c.jsonl")).size(), 3u);  // two steps and the summary
  r = run_command(run + " --stop-after 2 --save " + path("d"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(sppo() + " train --resume " + path("d") + " --quiet --save " + path("d"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_file(path("d/model.safetensors")), read_file(path("a/model.safetensors")));
  EXPECT_NE(read_file(path("d/config.toml")).find("steps = 4\n"), std::string::npos);
}

// grads and plan read --config too; a config.toml sppo did not write is left alone.
TEST_F(Config, GradsAndPlanReadItAndAUsersFileIsKept) {
  write("grads.toml", "model = \"tiny\"\nseq-len = 64\nout = \"" + path("g") + "\"\n");
  auto r = run_command(sppo() + " grads --config " + path("grads.toml"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_json(path("g/result.json"))["seq_len"].get<int>(), 64);
  write("plan.toml", "model = \"gpt-7b\"\nseq-len = \"256K\"\ngpus = 8\njson = true\n");
  r = run_command(sppo() + " plan --config " + path("plan.toml") + " --gpus 16 2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto plan = nlohmann::json::parse(r.output);
  EXPECT_EQ(plan["seq_len"].get<i64>(), 256 * 1024);
  EXPECT_EQ(plan["gpus"].get<int>(), 16);
  write("config.toml", "steps = 1\n");
  r = run_command(sppo() + " train --model tiny --seq-len 64 --config " + path("config.toml") + " --metrics " +
                  path("m.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_file(path("config.toml")), "steps = 1\n");
  EXPECT_NE(r.output.find("left alone"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace sppo
