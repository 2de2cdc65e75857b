#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/fileutil.h"
#include "io/metrics.h"

namespace sppo::io {
namespace {

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::istringstream in(read_file(path));
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(IoMetrics, OneFlushedObjectPerLine) {
  TempDir tmp("sppo-io-test");
  const std::string path = tmp.file("m.jsonl");
  JsonlWriter w(path, JsonlWriter::Mode::Truncate);
  w.write({{"step", 1}, {"loss", 2.5}, {"note", "multi\nline"}});
  // Visible before close: flushed per line.
  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["loss"], 2.5);
  EXPECT_EQ(lines[0]["note"], "multi\nline");
  w.write({{"step", 2}});
  w.close();
  EXPECT_EQ(read_lines(path).size(), 2u);
  EXPECT_THROW(w.write({{"step", 3}}), Error);
}

TEST(IoMetrics, AppendKeepsAndTruncateDiscards) {
  TempDir tmp("sppo-io-test");
  const std::string path = tmp.file("m.jsonl");
  { JsonlWriter(path, JsonlWriter::Mode::Truncate).write({{"step", 1}}); }
  { JsonlWriter(path, JsonlWriter::Mode::Append).write({{"step", 2}}); }
  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1]["step"], 2);
  { JsonlWriter(path, JsonlWriter::Mode::Truncate).write({{"step", 9}}); }
  lines = read_lines(path);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["step"], 9);
}

TEST(IoMetrics, Errors) {
  TempDir tmp("sppo-io-test");
  JsonlWriter w(tmp.file("m.jsonl"), JsonlWriter::Mode::Truncate);
  EXPECT_THROW(w.write(nlohmann::json::array({1, 2})), Error);
  const std::string bad = tmp.file("no/such/dir/m.jsonl");
  try {
    JsonlWriter x(bad, JsonlWriter::Mode::Append);
    ADD_FAILURE() << "opened a file in a missing directory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sppo::io
