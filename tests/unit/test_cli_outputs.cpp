// Output paths are checked before any work: a run that could not write its checkpoint,
// metrics, trace or export at the end is refused at the start, with exit 2, a message
// naming the option, and nothing trained or written.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "io/fileutil.h"
#include "support/mpi_run.h"

namespace sppo {
namespace {

TEST(Outputs, UnwritablePathsAreRefusedBeforeTraining) {
  io::TempDir tmp("sppo-outputs");
  const std::string file = tmp.path() + "/a-file";
  std::ofstream(file) << "not a directory\n";
  const std::string run = testing::sppo_binary() + " train --model tiny --seq-len 32 --steps 50 ";
  const std::pair<std::string, std::string> cases[] = {
      {run + "--save " + file, "--save"},
      {run + "--save /nonexistent/ck", "--save"},
      {run + "--trace /nonexistent/t.json", "--trace"},
      {run + "--svg /nonexistent/t.svg", "--svg"},
      {run + "--metrics " + tmp.path(), "--metrics"},
      {run + "--save-every 5", "--save-every"},
      {testing::sppo_binary() + " grads --model tiny --seq-len 32 --out " + file, "--out"},
  };
  for (const auto& [command, option] : cases) {
    const auto r = testing::run_command(command);
    EXPECT_EQ(r.status, 2) << command << "\n" << r.output;
    EXPECT_NE(r.output.find(option), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << "trained before refusing: " << command;
  }
  EXPECT_EQ(testing::run_command("cat " + file).output, "not a directory\n") << "the file was overwritten";
}

}  // namespace
}  // namespace sppo
