// Bad input stops before any work with one "[component] message" line that names the
// option and what would work, and exit status 2.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>
#include <sys/wait.h>

namespace {

struct Outcome {
  int status = -1;
  std::string output;
};

Outcome run(const std::string& args) {
  const std::string cmd = std::string(SPPO_BINARY_DIR) + "/sppo " + args + " 2>&1";
  Outcome o;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return o;
  std::array<char, 4096> buf;
  while (std::fgets(buf.data(), int(buf.size()), p)) o.output += buf.data();
  const int rc = pclose(p);
  o.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return o;
}

// Exit status 2: bad input; 3: the run does not fit its memory.
void expect_refused(const std::string& args, const std::string& must_mention, int status = 2) {
  const Outcome o = run("train " + args + " --steps 1 --quiet");
  EXPECT_EQ(o.status, status) << args << "\n" << o.output;
  EXPECT_NE(o.output.find(must_mention), std::string::npos) << args << ": message lacks '" << must_mention << "':\n" << o.output;
  EXPECT_EQ(o.output.find("step 1/"), std::string::npos) << args << ": work started before the refusal";
}

TEST(CliErrors, BadModelShapes) {
  expect_refused("--hidden 30 --heads 4", "--heads");
  expect_refused("--hidden 24 --heads 8", "even");
  expect_refused("--model nope", "presets are");
  expect_refused("--layers -3", "--layers");
  expect_refused("--vocab -1", "--vocab");
}

TEST(CliErrors, BadLengthsAndSizes) {
  expect_refused("--seq-len 1", "--seq-len");
  expect_refused("--seq-len 12Q", "--seq-len");
  expect_refused("--seq-len 64 --subseqs 65", "--subseqs");
  expect_refused("--seq-len 64 --subseqs 0", "--subseqs");
  expect_refused("--device-memory lots", "--device-memory");
  expect_refused("--offload sometimes", "--offload");
  expect_refused("--partition random", "--partition");
  expect_refused("--recompute --subseqs 4", "--recompute");
  expect_refused("--seq-len 4096 --subseqs 4 --device-memory 1MiB", "--device-memory", 3);
  expect_refused("--backend metal", "--backend");
  expect_refused("--precision fp8", "--precision");
  expect_refused("--precision bf16 --backend cpu", "fp32");
}

TEST(CliErrors, BadData) {
  expect_refused("--data /nonexistent/corpus.u16", "/nonexistent/corpus.u16");
  const std::string path = std::string(SPPO_BINARY_DIR) + "/cli_errors_tokens.u16";
  {
    std::ofstream f(path, std::ios::binary);
    const unsigned short ids[] = {1, 2, 3, 500, 4, 5, 6, 7};
    f.write(reinterpret_cast<const char*>(ids), sizeof ids);
  }
  expect_refused("--model tiny --seq-len 4 --data " + path, "500");
  std::remove(path.c_str());
}

TEST(CliErrors, HelpAndGoodRunExitZero) {
  EXPECT_EQ(run("train --help").status, 0);
  const Outcome ok = run("train --model tiny --seq-len 16 --steps 1 --quiet");
  EXPECT_EQ(ok.status, 0) << ok.output;
}

}  // namespace
