#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/data.h"
#include "io/fileutil.h"
#include "support/expect_error.h"
#include "support/megatron.h"

namespace sppo::io {
namespace {

using ::sppo::testing::error_of;
using ::sppo::testing::le_bytes;
using ::sppo::testing::put;
using ::sppo::testing::write_megatron;

std::vector<std::int32_t> take(TokenSource& src, std::int64_t count) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(count));
  src.next(v.data(), count);
  return v;
}


// ---- RepeatTask ----------------------------------------------------------------------

TEST(IoRepeatTask, SecondHalfCopiesFirstHalf) {
  EXPECT_EQ(repeat_start(1), 0);  // count 2: [a, a]
  EXPECT_EQ(repeat_start(7), 3);  // count 8: 4 random, 4 copies; target 3 predicts token 4
  EXPECT_EQ(repeat_start(8), 4);  // count 9: 5 random, 4 copies
  EXPECT_EQ(repeat_prefix_length(9), 5);
  for (std::int64_t S : {1, 2, 7, 8, 63, 100, 1001}) {
    RepeatTask task(13, 5);
    for (int k = 0; k < 3; ++k) {
      const auto seq = take(task, S + 1);
      const std::int64_t half = repeat_prefix_length(S + 1);
      for (std::int32_t t : seq) ASSERT_TRUE(t >= 0 && t < 13);
      // Every target from repeat_start(S) on is a copy of a token half a sequence back.
      for (std::int64_t i = repeat_start(S); i < S; ++i)
        ASSERT_EQ(seq[i + 1], seq[i + 1 - half]) << "S " << S << " target " << i;
      // ...and the random part is not degenerate.
      if (half >= 32) {
        std::map<std::int32_t, int> seen;
        for (std::int64_t i = 0; i < half; ++i) ++seen[seq[i]];
        EXPECT_GT(seen.size(), 5u);
      }
    }
  }
}

TEST(IoRepeatTask, SymbolsAreUniform) {
  RepeatTask task(4, 9);
  std::map<std::int32_t, int> counts;
  const std::int64_t S = 1999;  // 1000 random symbols per sequence
  for (int k = 0; k < 20; ++k) {
    const auto seq = take(task, S + 1);
    for (std::int64_t i = 0; i < repeat_prefix_length(S + 1); ++i) ++counts[seq[i]];
  }
  ASSERT_EQ(counts.size(), 4u);
  for (auto [sym, c] : counts) EXPECT_NEAR(c, 5000, 300) << "symbol " << sym;
}

TEST(IoRepeatTask, DeterministicAndResumable) {
  RepeatTask a(64, 1234), b(64, 1234), other(64, 1235);
  std::vector<std::vector<std::int32_t>> stream;
  for (int k = 0; k < 8; ++k) {
    stream.push_back(take(a, 33));
    EXPECT_EQ(take(b, 33), stream.back()) << "same seed, sequence " << k;
    EXPECT_NE(take(other, 33), stream.back()) << "different seed, sequence " << k;
  }
  // Resume: a fresh task seeking to the position after sequence 4 replays 5..7.
  RepeatTask c(64, 1234);
  for (int k = 0; k < 5; ++k) take(c, 33);
  const std::string saved = c.position().dump();
  RepeatTask resumed(64, 1234);
  resumed.seek(nlohmann::json::parse(saved));
  EXPECT_EQ(resumed.sequence_index(), 5);
  for (int k = 5; k < 8; ++k) EXPECT_EQ(take(resumed, 33), stream[k]) << "sequence " << k;
  // seek(position()) is a no-op; seeking back replays.
  resumed.seek(resumed.position());
  EXPECT_EQ(resumed.sequence_index(), 8);
  resumed.seek(nlohmann::json::parse(saved));
  EXPECT_EQ(take(resumed, 33), stream[5]);
  // Positions from another seed are refused.
  EXPECT_ERROR_WITH(other.seek(c.position()), "seed");
}

TEST(IoRepeatTask, StreamIsPinned) {
  // The stream must not change between builds or platforms: resumed runs depend on it.
  RepeatTask task(64, 1);
  const auto seq = take(task, 9);
  const std::vector<std::int32_t> first5(seq.begin(), seq.begin() + 5);
  RepeatTask again(64, 1);
  EXPECT_EQ(take(again, 9), seq);
  EXPECT_EQ(first5, (std::vector<std::int32_t>{28, 21, 47, 25, 16}));
}

// ---- file sources --------------------------------------------------------------------

class IoDataFiles : public ::testing::Test {
 protected:
  TempDir tmp{"sppo-io-test"};
};

TEST_F(IoDataFiles, BytesWindowsHaveStrideSAndWrap) {
  const std::string path = tmp.file("t.txt");
  write_file_atomic(path, std::string_view("abcdefghij"));
  auto src = open_data(path, 256, 0);
  EXPECT_EQ(src->vocab_hint(), 256);
  auto as_str = [](const std::vector<std::int32_t>& v) { return std::string(v.begin(), v.end()); };
  EXPECT_EQ(as_str(take(*src, 4)), "abcd");
  EXPECT_EQ(as_str(take(*src, 4)), "defg");
  EXPECT_EQ(as_str(take(*src, 4)), "ghij");
  EXPECT_EQ(as_str(take(*src, 4)), "jabc");  // wraps at the end of the file
  EXPECT_EQ(src->position()["offset"], 2);
  EXPECT_EQ(as_str(take(*src, 4)), "cdef");
  EXPECT_EQ(src->max_token(), 'j');
}

TEST_F(IoDataFiles, RawTokenWindowsAndResume) {
  std::vector<std::uint16_t> u16(1000);
  for (std::size_t i = 0; i < u16.size(); ++i) u16[i] = static_cast<std::uint16_t>(i * 7 % 1000);
  write_file_atomic(tmp.file("d.u16"), le_bytes(u16));
  std::vector<std::uint32_t> u32(500);
  for (std::size_t i = 0; i < u32.size(); ++i) u32[i] = static_cast<std::uint32_t>(100000 + i);
  write_file_atomic(tmp.file("d.u32"), le_bytes(u32));

  auto a = open_data(tmp.file("d.u16"), 1000, 0);
  auto b = open_data(tmp.file("d.u32"), 100500, 0);
  EXPECT_NE(a->describe().find("uint16"), std::string::npos) << a->describe();
  EXPECT_NE(b->describe().find("uint32"), std::string::npos) << b->describe();
  const std::int64_t S = 64;
  std::vector<std::vector<std::int32_t>> stream_a, stream_b;
  for (int k = 0; k < 40; ++k) {  // 40 * 64 > 1000: wraps twice
    stream_a.push_back(take(*a, S + 1));
    stream_b.push_back(take(*b, S + 1));
    for (std::int64_t j = 0; j <= S; ++j) {
      ASSERT_EQ(stream_a[k][j], u16[(k * S + j) % u16.size()]) << "u16 window " << k << " token " << j;
      ASSERT_EQ(stream_b[k][j], static_cast<std::int32_t>(u32[(k * S + j) % u32.size()])) << "u32 window " << k;
    }
  }
  auto resumed = open_data(tmp.file("d.u16"), 1000, 0);
  for (int k = 0; k < 17; ++k) take(*resumed, S + 1);
  const auto pos = resumed->position();
  auto fresh = open_data(tmp.file("d.u16"), 1000, 0);
  fresh->seek(nlohmann::json::parse(pos.dump()));
  for (int k = 17; k < 40; ++k) EXPECT_EQ(take(*fresh, S + 1), stream_a[k]) << "window " << k;
  // A position of another source is refused.
  EXPECT_ERROR_WITH(b->seek(pos), "another source");
  EXPECT_EQ(b->max_token(), 100499);
  EXPECT_EQ(a->max_token(), 999);
}

// Labels (--labels): windows like the data's, -100 written through, any other id outside
// the vocabulary named; raw .i32/.i64 and a signed Megatron pair; a position of the data
// is not a position of its labels.
TEST_F(IoDataFiles, LabelsReadLikeTheDataWithMinus100Kept) {
  std::vector<std::int64_t> labels(100);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = i % 3 == 0 ? -100 : std::int64_t(i % 50);
  write_file_atomic(tmp.file("l.i64"), le_bytes(labels));
  std::vector<std::int32_t> narrow(labels.begin(), labels.end());
  write_file_atomic(tmp.file("l.i32"), le_bytes(narrow));
  write_megatron<std::int32_t>(tmp.file("lm"), 4, {{{narrow.begin(), narrow.begin() + 40}}, {{narrow.begin() + 40, narrow.end()}}}, 3);
  for (const std::string& path : {tmp.file("l.i64"), tmp.file("l.i32"), tmp.file("lm")}) {
    auto src = open_labels(path, 50);
    EXPECT_EQ(src->size(), 100) << path;
    EXPECT_EQ(src->max_token(), 49) << path;
    src->check_vocab(50);
    for (int k = 0; k < 4; ++k) {  // windows of 33 with stride 32: the fourth wraps
      const auto w = take(*src, 33);
      for (int j = 0; j < 33; ++j) ASSERT_EQ(w[j], narrow[(k * 32 + j) % 100]) << path << " window " << k;
    }
    EXPECT_ERROR_WITH(src->check_vocab(40), "label 40 at token offset 40");
  }
  EXPECT_ERROR_WITH(open_labels(tmp.file("l.i64"), 50)->seek(open_data(tmp.file("l.i64"), 0, 0, {0, "u16"})->position()),
                    "another source");
  std::vector<std::int32_t> bad = narrow;
  bad[7] = -5;
  write_file_atomic(tmp.file("bad.i32"), le_bytes(bad));
  EXPECT_ERROR_WITH(take(*open_labels(tmp.file("bad.i32"), 50), 33), "label -5 at token offset 7");
  write_file_atomic(tmp.file("l.u16"), le_bytes(std::vector<std::uint16_t>(10, 1)));
  EXPECT_ERROR_WITH(open_labels(tmp.file("l.u16"), 50), "the file name says no label type");
}

TEST_F(IoDataFiles, OutOfRangeTokensAreNamedByOffsetAndValue) {
  std::vector<std::uint16_t> u16(100, 3);
  u16[70] = 5000;
  const std::string path = tmp.file("bad.u16");
  write_file_atomic(path, le_bytes(u16));
  auto src = open_data(path, 1000, 0);
  EXPECT_EQ(src->max_token(), 5000);
  EXPECT_ERROR_WITH(src->check_vocab(1000), "bad.u16", "token id 5000", "token offset 70", "byte offset 140");
  src->check_vocab(5001);
  // Windows before the bad token are served; the one containing it is refused.
  for (int k = 0; k < 6; ++k) take(*src, 11);  // tokens [0, 61)
  const auto before = src->position();
  std::vector<std::int32_t> out(11, -1);
  EXPECT_ERROR_WITH(src->next(out.data(), 11), "token id 5000", "token offset 70");
  EXPECT_EQ(src->position(), before) << "a refused window must not advance the position";
  // Without a vocabulary, anything that fits int32 is accepted.
  auto any = open_raw_tokens(path, TokenDType::U16, 0);
  EXPECT_EQ(any->vocab_hint(), 5001);
  for (int k = 0; k < 12; ++k) take(*any, 11);
}

TEST_F(IoDataFiles, RawFileSizeMustBeAMultipleOfTheElement) {
  write_file_atomic(tmp.file("odd.u32"), std::string(10, '\0'));
  EXPECT_ERROR_WITH(open_data(tmp.file("odd.u32"), 10, 0), "odd.u32", "10 bytes", "multiple of 4");
  write_file_atomic(tmp.file("empty.u16"), std::string_view(""));
  EXPECT_ERROR_WITH(open_data(tmp.file("empty.u16"), 10, 0), "empty.u16", "no tokens");
}

TEST_F(IoDataFiles, MegatronDatasetConcatenatesDocuments) {
  const std::vector<std::vector<std::vector<std::int32_t>>> docs = {
      {{1, 2, 3}, {4, 5}}, {{6}}, {{7, 8, 9, 10}, {}, {11, 12}}};
  std::vector<std::int32_t> flat;
  for (const auto& d : docs)
    for (const auto& s : d) flat.insert(flat.end(), s.begin(), s.end());
  for (std::size_t gap : {0u, 3u}) {
    SCOPED_TRACE("gap " + std::to_string(gap));
    const std::string prefix = tmp.file("corpus" + std::to_string(gap));
    write_megatron<std::int32_t>(prefix, 4, docs, gap);
    for (const std::string& spec : {prefix + ".bin", prefix + ".idx", prefix}) {
      auto src = open_data(spec, 50, 0);
      EXPECT_NE(src->describe().find("3 documents, 12 int32 tokens"), std::string::npos) << src->describe();
      for (int k = 0; k < 10; ++k) {
        const auto w = take(*src, 5);
        for (int j = 0; j < 5; ++j) ASSERT_EQ(w[j], flat[(k * 4 + j) % flat.size()]) << spec << " window " << k;
      }
      EXPECT_EQ(src->max_token(), 12);
    }
  }
  // uint16 tokens (dtype code 8).
  write_megatron<std::uint16_t>(tmp.file("small"), 8, {{{65535, 1}}, {{2}}}, 1);
  auto src = open_megatron(tmp.file("small"), 0);
  EXPECT_EQ(take(*src, 3), (std::vector<std::int32_t>{65535, 1, 2}));
  EXPECT_ERROR_WITH(open_megatron(tmp.file("small"), 1000)->check_vocab(1000), "token id 65535", "token offset 0");
}

// The document index gives --pack its boundaries: where each window's documents begin,
// the wrap to the data's start among them; empty documents begin nowhere.
TEST_F(IoDataFiles, MegatronDocumentStartsPerWindow) {
  // Documents of 5, 1 and 6 tokens (one empty between them): they begin at 0, 5 and 6.
  write_megatron<std::int32_t>(tmp.file("docs"), 4, {{{1, 2, 3}, {4, 5}}, {}, {{6}}, {{7, 8, 9, 10}, {}, {11, 12}}}, 2);
  auto src = open_data(tmp.file("docs"), 50, 0);
  ASSERT_TRUE(src->has_documents());
  // Windows of 5 tokens with stride 4: at offsets 0, 4, 8 (wrapping after 12), 0.
  const std::vector<std::vector<std::int64_t>> want = {{}, {1, 2}, {4}, {}};
  for (std::size_t k = 0; k < want.size(); ++k) {
    take(*src, 5);
    EXPECT_EQ(src->last_document_starts(), want[k]) << "window " << k;
  }
  // One document: only the wrap begins one.
  write_megatron<std::int32_t>(tmp.file("one"), 4, {{{1, 2, 3}}}, 0);
  auto one = open_data(tmp.file("one"), 50, 0);
  ASSERT_TRUE(one->has_documents());
  take(*one, 3);
  EXPECT_TRUE(one->last_document_starts().empty());
  take(*one, 3);  // ids 3, 1, 2: past the end, the data begins again
  EXPECT_EQ(one->last_document_starts(), (std::vector<std::int64_t>{1}));
  // A raw token file has no index: --pack needs --doc-sep there.
  write_file_atomic(tmp.file("raw.u16"), le_bytes(std::vector<std::uint16_t>{1, 2, 3, 4}));
  EXPECT_FALSE(open_data(tmp.file("raw.u16"), 50, 0)->has_documents());
}

TEST_F(IoDataFiles, MegatronCorruptionIsRefused) {
  const std::string prefix = tmp.file("m");
  write_megatron<std::int32_t>(prefix, 4, {{{1, 2, 3}}, {{4}}}, 0);
  const std::string idx = read_file(prefix + ".idx");
  auto with_idx = [&](std::string bytes) {
    write_file_atomic(prefix + ".idx", bytes);
    return error_of([&] { open_data(prefix + ".bin", 10, 0); });
  };
  auto has = [](const std::string& msg, const char* part) {
    return msg.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                               : ::testing::AssertionFailure() << "\"" << part << "\" not in: " << msg;
  };
  std::string bad = idx;
  bad[0] = 'X';
  EXPECT_TRUE(has(with_idx(bad), "MMIDIDX"));
  bad = idx;
  bad[17] = 6;  // float64 tokens
  EXPECT_TRUE(has(with_idx(bad), "dtype code 6"));
  EXPECT_TRUE(has(with_idx(idx.substr(0, idx.size() - 4)), "truncated"));
  bad = idx;
  const std::int64_t far = 1 << 20;
  std::memcpy(bad.data() + 34 + 2 * 4, &far, 8);  // pointer of sequence 0
  EXPECT_TRUE(has(with_idx(bad), "sequence 0"));
  write_file_atomic(prefix + ".idx", idx);
  open_data(prefix + ".bin", 10, 0);
}

TEST_F(IoDataFiles, FactoryDispatchAndErrors) {
  auto r = open_data("", 50257, 7);
  EXPECT_EQ(r->vocab_hint(), kDefaultRepeatAlphabet);
  EXPECT_EQ(open_data("repeat", 16, 7)->vocab_hint(), 16);
  EXPECT_EQ(open_data("repeat:5", 16, 7)->vocab_hint(), 5);
  DataOptions opt;
  opt.alphabet = 9;
  EXPECT_EQ(open_data("repeat", 16, 7, opt)->vocab_hint(), 9);
  EXPECT_ERROR_WITH(open_data("repeat:99", 16, 7), "alphabet 99", "vocabulary size 16");
  EXPECT_ERROR_WITH(open_data("repeat:x", 16, 7), "positive integer");

  const std::string missing = tmp.file("nope.u16");
  EXPECT_ERROR_WITH(open_data(missing, 16, 0), missing.c_str(), "does not exist", "accepted", ".u16", "Megatron");

  std::vector<std::uint32_t> toks = {1, 2, 3, 4};
  write_file_atomic(tmp.file("raw.bin"), le_bytes(toks));
  EXPECT_ERROR_WITH(open_data(tmp.file("raw.bin"), 16, 0), "raw.idx", "u16 or u32");
  opt.token_dtype = "u32";
  EXPECT_EQ(take(*open_data(tmp.file("raw.bin"), 16, 0, opt), 4), (std::vector<std::int32_t>{1, 2, 3, 4}));
  opt.token_dtype = "u16";
  EXPECT_EQ(take(*open_data(tmp.file("raw.bin"), 16, 0, opt), 4), (std::vector<std::int32_t>{1, 0, 2, 0}));
  opt.token_dtype = "f32";
  EXPECT_ERROR_WITH(open_data(tmp.file("raw.bin"), 16, 0, opt), "f32", "u16 or u32");

  write_file_atomic(tmp.file("notes.md"), std::string_view("hi!"));
  EXPECT_EQ(take(*open_data(tmp.file("notes.md"), 256, 0), 3), (std::vector<std::int32_t>{'h', 'i', '!'}));
  // Bytes beyond a small vocabulary are refused.
  EXPECT_ERROR_WITH(take(*open_data(tmp.file("notes.md"), 105, 0), 3), "token id 105", "token offset 1");
  EXPECT_ERROR_WITH(take(*open_data(tmp.file("notes.md"), 256, 0), 1), "at least 2");
}

TEST_F(IoDataFiles, DataShorterThanOneSequenceIsRefused) {
  std::vector<std::uint32_t> toks = {1, 2, 3};
  write_file_atomic(tmp.file("t3.u32"), le_bytes(toks));
  auto src = open_data(tmp.file("t3.u32"), 16, 0);
  EXPECT_ERROR_WITH(src->check_length(33), "t3.u32", "holds 3 tokens", "33", "--seq-len 2 or less");
  EXPECT_ERROR_WITH(take(*src, 33), "t3.u32", "holds 3 tokens", "33");
  src->check_length(3);
  EXPECT_EQ(take(*src, 3), (std::vector<std::int32_t>{1, 2, 3}));
  open_data("repeat", 16, 0)->check_length(std::int64_t{1} << 40);  // the built-in task has no end
}

TEST(IoDataSpec, RepeatAlphabetZeroIsRefused) {
  EXPECT_ERROR_WITH(open_data("repeat:0", 64, 7), "repeat:0", "at least 1", "repeat:32");
  EXPECT_ERROR_WITH(open_data("repeat:0", 16, 7), "repeat:16");
  EXPECT_EQ(open_data("repeat:1", 64, 7)->vocab_hint(), 1);
}

TEST(IoRepeatTask, SeekRefusesMalformedPositions) {
  RepeatTask task(8, 3);
  take(task, 9);
  const nlohmann::json good = task.position();
  for (const char* key : {"kind", "alphabet", "seed", "sequence"}) {
    for (const nlohmann::json& v : {nlohmann::json("x"), nlohmann::json(-1), nlohmann::json::array(),
                                    nlohmann::json(nullptr), nlohmann::json(1.5)}) {
      nlohmann::json bad = good;
      bad[key] = v;
      EXPECT_ERROR_WITH(task.seek(bad), "data position");
    }
    nlohmann::json missing = good;
    missing.erase(key);
    EXPECT_ERROR_WITH(task.seek(missing), "data position");
  }
  EXPECT_ERROR_WITH(task.seek(nlohmann::json("repeat")), "data position");
  task.seek(nlohmann::json::parse(good.dump()));  // as read back from state.json
  EXPECT_EQ(task.sequence_index(), 1);
}

}  // namespace
}  // namespace sppo::io
