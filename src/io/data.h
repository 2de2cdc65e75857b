// Training data: sources of token sequences whose whole state is a small JSON position,
// so that a run resumed from a checkpoint sees exactly the stream it would have seen.
//
// A step of S tokens consumes one sequence of S + 1 token ids: inputs are ids [0, S),
// targets are ids [1, S + 1) (target i is the token after input i).
//
// Sources:
//  - RepeatTask: the built-in long-range task. Each sequence is a random string of
//    ceil((S+1)/2) symbols followed by its exact copy (cut to S + 1 tokens). Targets
//    [0, repeat_start(S)) are random (best loss ln(alphabet)); targets
//    [repeat_start(S), S) are copies, predictable only by attending back half a sequence.
//    Sequence k is drawn from std::mt19937_64 seeded with a mix of (seed, k), so the
//    position is just k.
//  - token files: a byte-level text file (vocab 256), a raw little-endian uint16/uint32
//    token file, or a Megatron indexed dataset (.bin/.idx, MMIDIDX version 1, documents
//    concatenated in order; their starts are kept for --pack). All are memory-mapped read-only and read as consecutive
//    windows of S + 1 tokens with stride S (consecutive windows share one token, so every
//    token is a target once), wrapping at the end of the data. The position is the token
//    offset of the next window. Ids are checked against the vocabulary per window; an id
//    out of range is an error naming its token offset, byte offset and value.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace sppo::io {

class TokenSource {
 public:
  virtual ~TokenSource();
  // Writes the next sequence of `count` (= S + 1, at least 2) token ids and advances.
  virtual void next(std::int32_t* out, std::int64_t count) = 0;
  // Where the next call to next() starts; seek(position()) is a no-op. Positions carry
  // enough of the source's identity (kind, seed, size) that seeking a different source
  // fails instead of silently producing another stream.
  virtual nlohmann::json position() const = 0;
  virtual void seek(const nlohmann::json& pos) = 0;
  // Smallest vocabulary that covers the source (file sources: the vocabulary they were
  // opened with, or max_token() + 1 when opened without one).
  virtual std::int64_t vocab_hint() const = 0;
  virtual std::string describe() const = 0;
  // Largest token id in the whole source (a full scan for files, done once). A negative id
  // is an error.
  virtual std::int64_t max_token() const = 0;
  // Full scan: throws naming the first id outside [0, vocab) with its offset and value, so
  // that a run can be refused before it starts.
  virtual void check_vocab(std::int64_t vocab) const = 0;
  // Throws unless the source holds at least `count` (= S + 1) tokens: a window longer than
  // the data would repeat it within one sequence. next() checks it too; calling it first
  // refuses a run before it starts.
  virtual void check_length(std::int64_t count) const = 0;
  // Tokens in the whole source (-1: generated, no end).
  virtual std::int64_t size() const { return -1; }
  // Whether the source knows where its documents begin (a Megatron dataset's document
  // index); others mark documents with a separator token (--doc-sep).
  virtual bool has_documents() const { return false; }
  // Where documents begin inside the sequence the last next() wrote: offsets in (0, count),
  // ascending; the wrap from the data's end to its start is one. Empty without an index.
  virtual std::vector<std::int64_t> last_document_starts() const { return {}; }
};

// Number of random symbols in a RepeatTask sequence of `count` tokens: ceil(count / 2).
std::int64_t repeat_prefix_length(std::int64_t count);
// First target index (of S) that is a copy: repeat_prefix_length(S + 1) - 1.
std::int64_t repeat_start(std::int64_t S);

class RepeatTask final : public TokenSource {
 public:
  RepeatTask(std::int64_t alphabet, std::uint64_t seed);
  void next(std::int32_t* out, std::int64_t count) override;
  nlohmann::json position() const override;
  void seek(const nlohmann::json& pos) override;
  std::int64_t vocab_hint() const override { return alphabet_; }
  std::string describe() const override;
  std::int64_t max_token() const override { return alphabet_ - 1; }
  void check_vocab(std::int64_t vocab) const override;
  void check_length(std::int64_t) const override {}  // generates any length

  std::int64_t alphabet() const { return alphabet_; }
  std::uint64_t seed() const { return seed_; }
  std::int64_t sequence_index() const { return sequence_; }

 private:
  std::int64_t alphabet_;
  std::uint64_t seed_;
  std::int64_t sequence_ = 0;  // index of the next sequence
};

// Element type of a raw token file.
enum class TokenDType { U8, I8, I16, U16, I32, U32, I64 };
TokenDType parse_token_dtype(const std::string& name);  // "u16" / "uint16" / "u32" / "uint32"

// `vocab` > 0: ids must lie in [0, vocab); `vocab` <= 0: any id that fits int32.
std::unique_ptr<TokenSource> open_bytes(const std::string& path, std::int64_t vocab = 256);
std::unique_ptr<TokenSource> open_raw_tokens(const std::string& path, TokenDType dtype,
                                             std::int64_t vocab);
// `path` is the .bin, the .idx, or their common prefix.
std::unique_ptr<TokenSource> open_megatron(const std::string& path, std::int64_t vocab);

// Labels beside the data (--labels): one per token, the target of the position before it
// (as Hugging Face's labels are shifted inside the model), or kIgnoreLabel where no loss is
// taken. A labels source is read in windows in step with the data's and holds as many labels
// as the data holds tokens; next() writes kIgnoreLabel through, any other label outside
// [0, vocab) is an error naming its offset.
inline constexpr std::int32_t kIgnoreLabel = -100;
// `path`: a raw signed file PATH.i32 or PATH.i64 (PATH.i16 too), or a Megatron dataset
// PATH.bin + PATH.idx of a signed integer type.
std::unique_ptr<TokenSource> open_labels(const std::string& path, std::int64_t vocab);

struct DataOptions {
  std::int64_t alphabet = 0;  // RepeatTask symbols; 0: min(vocab, kDefaultRepeatAlphabet)
  std::string token_dtype;    // "u16"/"u32": read the path as raw tokens of that type
};

inline constexpr std::int64_t kDefaultRepeatAlphabet = 32;

// spec:
//   "" | "repeat" | "repeat:<alphabet>"   RepeatTask (alphabet in [1, vocab])
//   PATH.idx | PATH.bin | PATH            Megatron, when PATH.idx and PATH.bin both exist
//   PATH.u16 | PATH.u32                   raw tokens (options.token_dtype overrides; it is
//                                         required for a .bin without its .idx)
//   any other PATH                        bytes of the file (vocab 256)
std::unique_ptr<TokenSource> open_data(const std::string& spec, std::int64_t vocab,
                                       std::uint64_t seed, const DataOptions& options = {});

}  // namespace sppo::io
