#include "io/data.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "io/fileutil.h"

namespace sppo::io {

namespace fs = std::filesystem;

namespace {

constexpr const char* kComponent = "data";
constexpr std::int64_t kInt32Limit = std::int64_t{1} << 31;  // ids must fit int32

constexpr const char* kAcceptedFormats =
    "accepted: \"repeat\" or \"repeat:<alphabet>\" (built-in task), a text file (bytes, vocab "
    "256), a raw token file PATH.u16 / PATH.u32, or a Megatron dataset PATH.bin + PATH.idx";

bool has_suffix(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

std::size_t token_size(TokenDType t) {
  switch (t) {
    case TokenDType::U8:
    case TokenDType::I8:
      return 1;
    case TokenDType::I16:
    case TokenDType::U16:
      return 2;
    case TokenDType::I32:
    case TokenDType::U32:
      return 4;
    case TokenDType::I64:
      return 8;
  }
  SPPO_ASSERT(false);
  return 0;
}

const char* token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::U8: return "uint8";
    case TokenDType::I8: return "int8";
    case TokenDType::I16: return "int16";
    case TokenDType::U16: return "uint16";
    case TokenDType::I32: return "int32";
    case TokenDType::U32: return "uint32";
    case TokenDType::I64: return "int64";
  }
  SPPO_ASSERT(false);
  return "";
}

template <typename T>
std::int64_t load_token(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return static_cast<std::int64_t>(v);
}

// Calls f(element index, value) for n elements of type `dtype` at p, stopping when f
// returns false. The switch sits outside the loop.
template <typename F>
void visit_tokens(TokenDType dtype, const unsigned char* p, std::int64_t n, F&& f) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t i = 0; i < n; ++i)
      if (!f(i, load_token<T>(p + i * static_cast<std::int64_t>(sizeof(T))))) return;
  };
  switch (dtype) {
    case TokenDType::U8: return run(std::uint8_t{});
    case TokenDType::I8: return run(std::int8_t{});
    case TokenDType::I16: return run(std::int16_t{});
    case TokenDType::U16: return run(std::uint16_t{});
    case TokenDType::I32: return run(std::int32_t{});
    case TokenDType::U32: return run(std::uint32_t{});
    case TokenDType::I64: return run(std::int64_t{});
  }
}

// A contiguous run of tokens in the mapped file.
struct Segment {
  std::uint64_t byte_offset;  // of its first token in the file
  std::int64_t start;         // token index of its first token in the concatenated stream
  std::int64_t count;
};

// Token windows over segments of one memory-mapped file (see data.h).
class WindowedTokens final : public TokenSource {
 public:
  WindowedTokens(std::string kind, std::string description, std::unique_ptr<MappedFile> file,
                 TokenDType dtype, std::vector<Segment> segments, std::int64_t limit,
                 std::int64_t hint, std::optional<std::vector<std::int64_t>> doc_starts = std::nullopt,
                 bool labels = false)
      : kind_(std::move(kind)),
        description_(std::move(description)),
        file_(std::move(file)),
        dtype_(dtype),
        esize_(static_cast<std::int64_t>(token_size(dtype))),
        segments_(std::move(segments)),
        limit_(limit),
        hint_(hint),
        doc_starts_(std::move(doc_starts)),
        labels_(labels) {
    total_ = segments_.empty() ? 0 : segments_.back().start + segments_.back().count;
    SPPO_CHECK(total_ > 0, kComponent) << file_->path() << " holds no tokens; " << kAcceptedFormats;
  }

  void next(std::int32_t* out, std::int64_t count) override {
    SPPO_CHECK(count >= 2, kComponent) << "a sequence needs at least 2 tokens (S + 1), got " << count;
    check_length(count);
    if (doc_starts_) note_document_starts(count);
    std::int64_t g = offset_;
    for (std::int64_t done = 0; done < count;) {
      const Segment& s = segment_of(g);
      const std::int64_t n = std::min(count - done, s.start + s.count - g);
      const unsigned char* p = base(s, g);
      std::int32_t* dst = out + done;
      std::int64_t bad = -1, bad_value = 0;
      visit_tokens(dtype_, p, n, [&](std::int64_t i, std::int64_t v) {
        if (!valid(v, limit_)) {
          bad = i, bad_value = v;
          return false;
        }
        dst[i] = static_cast<std::int32_t>(v);
        return true;
      });
      if (bad >= 0) fail_token(s, g + bad, bad_value, limit_);
      done += n;
      g = (g + n) % total_;
    }
    offset_ = (offset_ + count - 1) % total_;
  }

  nlohmann::json position() const override {
    return {{"kind", kind_}, {"offset", offset_}, {"tokens", total_}};
  }

  std::int64_t size() const override { return total_; }
  bool has_documents() const override { return doc_starts_.has_value(); }
  std::vector<std::int64_t> last_document_starts() const override { return last_starts_; }

  void seek(const nlohmann::json& pos) override {
    SPPO_CHECK(pos.is_object() && pos.contains("kind") && pos.contains("offset") &&
                   pos.contains("tokens"),
               kComponent)
        << "data position " << pos.dump() << " lacks kind/offset/tokens";
    SPPO_CHECK(pos["kind"] == kind_ && pos["tokens"] == total_, kComponent)
        << "data position " << pos.dump() << " was saved for another source; this one is "
        << describe() << " (resume with the data the run started with)";
    SPPO_CHECK(pos["offset"].is_number_integer() && pos["offset"].get<std::int64_t>() >= 0 &&
                   pos["offset"].get<std::int64_t>() < total_,
               kComponent)
        << "data position offset " << pos["offset"].dump() << " is outside [0, " << total_ << ")";
    offset_ = pos["offset"].get<std::int64_t>();
  }

  std::int64_t vocab_hint() const override { return hint_ > 0 ? hint_ : max_token() + 1; }
  std::string describe() const override { return description_; }

  std::int64_t max_token() const override {
    if (!max_) max_ = scan(kInt32Limit);
    return *max_;
  }

  void check_vocab(std::int64_t vocab) const override {
    SPPO_CHECK(vocab > 0, kComponent) << "vocabulary size must be positive, got " << vocab;
    if (max_ && *max_ < vocab) return;
    scan(std::min(vocab, kInt32Limit));
  }

  void check_length(std::int64_t count) const override {
    SPPO_CHECK(count <= total_, kComponent)
        << description_ << " holds " << total_ << " tokens, fewer than the " << count
        << " one sequence needs (--seq-len + 1); use --seq-len " << total_ - 1
        << " or less, or more data";
  }

 private:
  // The document starts inside the window of `count` tokens at offset_ (the wrap to token 0
  // included; count <= total_, so it wraps at most once).
  void note_document_starts(std::int64_t count) {
    last_starts_.clear();
    auto add = [&](std::int64_t lo, std::int64_t hi, std::int64_t shift) {  // starts in (lo, hi)
      for (auto it = std::upper_bound(doc_starts_->begin(), doc_starts_->end(), lo);
           it != doc_starts_->end() && *it < hi; ++it)
        last_starts_.push_back(*it + shift);
    };
    const std::int64_t end = offset_ + count;
    add(offset_, std::min(end, total_), -offset_);
    if (end > total_) {
      last_starts_.push_back(total_ - offset_);  // token 0 begins the first document again
      add(0, end - total_, total_ - offset_);
    }
  }

  // An id in [0, limit), or a label's kIgnoreLabel.
  bool valid(std::int64_t v, std::int64_t limit) const {
    return (v >= 0 && v < limit) || (labels_ && v == kIgnoreLabel);
  }

  const Segment& segment_of(std::int64_t g) const {
    auto it = std::upper_bound(segments_.begin(), segments_.end(), g,
                               [](std::int64_t x, const Segment& s) { return x < s.start; });
    SPPO_ASSERT(it != segments_.begin());
    return *(it - 1);
  }

  const unsigned char* base(const Segment& s, std::int64_t g) const {
    return file_->data() + s.byte_offset + static_cast<std::uint64_t>((g - s.start) * esize_);
  }

  [[noreturn]] void fail_token(const Segment& s, std::int64_t g, std::int64_t value,
                               std::int64_t limit) const {
    const std::uint64_t byte = s.byte_offset + static_cast<std::uint64_t>((g - s.start) * esize_);
    SPPO_CHECK(false, kComponent)
        << file_->path() << ": " << (labels_ ? "label " : "token id ") << value << " at token offset " << g
        << " (byte offset " << byte << ") is outside [0, " << limit << ")"
        << (labels_ ? " and is not " + std::to_string(kIgnoreLabel) + " (no loss taken)" : "")
        << (limit == kInt32Limit ? "" : "; raise the vocabulary size or check the token dtype ("
                                           + std::string(token_dtype_name(dtype_)) + ")");
    __builtin_unreachable();
  }

  // Max id over all tokens (labels: but kIgnoreLabel); throws at the first id outside [0, limit).
  std::int64_t scan(std::int64_t limit) const {
    std::int64_t mx = labels_ ? kIgnoreLabel : std::numeric_limits<std::int64_t>::min();
    for (const Segment& s : segments_) {
      std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = mx;
      visit_tokens(dtype_, base(s, s.start), s.count, [&](std::int64_t, std::int64_t v) {
        if (labels_ && v == kIgnoreLabel) return true;
        lo = std::min(lo, v), hi = std::max(hi, v);
        return true;
      });
      if (lo < 0 || hi >= limit) {
        visit_tokens(dtype_, base(s, s.start), s.count, [&](std::int64_t i, std::int64_t v) {
          if (!valid(v, limit)) fail_token(s, s.start + i, v, limit);
          return true;
        });
      }
      mx = hi;
    }
    return mx;
  }

  std::string kind_;
  std::string description_;
  std::unique_ptr<MappedFile> file_;
  TokenDType dtype_;
  std::int64_t esize_;
  std::vector<Segment> segments_;  // ascending start, contiguous in token index
  std::int64_t limit_;             // ids must be < limit_
  std::int64_t hint_;              // vocab_hint(); <= 0: max_token() + 1
  std::int64_t total_ = 0;
  std::int64_t offset_ = 0;
  mutable std::optional<std::int64_t> max_;
  // Where documents begin (a document index only): ascending, in (0, total_).
  std::optional<std::vector<std::int64_t>> doc_starts_;
  std::vector<std::int64_t> last_starts_;  // last_document_starts()
  bool labels_ = false;                    // open_labels: kIgnoreLabel is valid too
};

std::int64_t id_limit(std::int64_t vocab) { return vocab > 0 ? std::min(vocab, kInt32Limit) : kInt32Limit; }

// Checked little-endian reads from the .idx mapping.
class IdxCursor {
 public:
  IdxCursor(const MappedFile& f) : f_(f) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, f_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  const unsigned char* take(std::uint64_t bytes) {
    need(bytes);
    const unsigned char* p = f_.data() + pos_;
    pos_ += bytes;
    return p;
  }

 private:
  void need(std::uint64_t bytes) const {
    SPPO_CHECK(bytes <= f_.size() - pos_, kComponent)
        << f_.path() << ": index ends at byte " << f_.size() << " but " << bytes
        << " more bytes are needed at byte " << pos_ << " (truncated .idx?)";
  }
  const MappedFile& f_;
  std::uint64_t pos_ = 0;
};

}  // namespace

TokenSource::~TokenSource() = default;

// ---- RepeatTask ----------------------------------------------------------------------

std::int64_t repeat_prefix_length(std::int64_t count) { return (count + 1) / 2; }
std::int64_t repeat_start(std::int64_t S) { return repeat_prefix_length(S + 1) - 1; }

RepeatTask::RepeatTask(std::int64_t alphabet, std::uint64_t seed) : alphabet_(alphabet), seed_(seed) {
  SPPO_CHECK(alphabet >= 1 && alphabet <= kInt32Limit, kComponent)
      << "repeat task alphabet must be in [1, 2^31], got " << alphabet;
}

void RepeatTask::next(std::int32_t* out, std::int64_t count) {
  SPPO_CHECK(count >= 2, kComponent) << "a sequence needs at least 2 tokens (S + 1), got " << count;
  std::mt19937_64 rng(splitmix64(splitmix64(seed_) ^ static_cast<std::uint64_t>(sequence_)));
  const std::int64_t half = repeat_prefix_length(count);
  for (std::int64_t j = 0; j < half; ++j) {
    // Lemire's multiply-shift: the same ids on every platform, unlike uniform_int_distribution.
    const unsigned __int128 wide = static_cast<unsigned __int128>(rng()) * static_cast<std::uint64_t>(alphabet_);
    out[j] = static_cast<std::int32_t>(static_cast<std::uint64_t>(wide >> 64));
  }
  for (std::int64_t j = half; j < count; ++j) out[j] = out[j - half];
  ++sequence_;
}

nlohmann::json RepeatTask::position() const {
  return {{"kind", "repeat"}, {"alphabet", alphabet_}, {"seed", seed_}, {"sequence", sequence_}};
}

void RepeatTask::seek(const nlohmann::json& pos) {
  // Field by field with explicit types: a position comes from a file a user may have edited.
  auto field = [&](const char* key) -> const nlohmann::json* {
    if (!pos.is_object()) return nullptr;
    const auto it = pos.find(key);
    return it == pos.end() ? nullptr : &*it;
  };
  const nlohmann::json* kind = field("kind");
  const nlohmann::json* sequence = field("sequence");
  SPPO_CHECK(kind != nullptr && *kind == "repeat" && sequence != nullptr, kComponent)
      << "data position " << pos.dump() << " is not a repeat-task position; this source is "
      << describe();
  const nlohmann::json* alphabet = field("alphabet");
  const nlohmann::json* seed = field("seed");
  SPPO_CHECK(alphabet != nullptr && *alphabet == alphabet_ && seed != nullptr && *seed == seed_, kComponent)
      << "data position " << pos.dump() << " was saved with another alphabet or seed; this source is "
      << describe() << " (resume with the seed the run started with)";
  // Parsed JSON holds a non-negative integer as unsigned; one built in memory, as signed.
  const bool whole = sequence->is_number_unsigned()
                         ? sequence->get<std::uint64_t>() <= std::uint64_t(std::numeric_limits<std::int64_t>::max())
                         : sequence->is_number_integer() && sequence->get<std::int64_t>() >= 0;
  SPPO_CHECK(whole, kComponent) << "data position sequence " << sequence->dump()
                                << " must be a non-negative integer";
  sequence_ = sequence->get<std::int64_t>();
}

std::string RepeatTask::describe() const {
  std::ostringstream os;
  os << "repeat task (random string over " << alphabet_ << " symbols, then its copy; seed " << seed_ << ")";
  return os.str();
}

void RepeatTask::check_vocab(std::int64_t vocab) const {
  SPPO_CHECK(alphabet_ <= vocab, kComponent)
      << "repeat task alphabet " << alphabet_ << " exceeds the vocabulary size " << vocab;
}

// ---- file sources --------------------------------------------------------------------

TokenDType parse_token_dtype(const std::string& name) {
  if (name == "u16" || name == "uint16") return TokenDType::U16;
  if (name == "u32" || name == "uint32") return TokenDType::U32;
  SPPO_CHECK(false, kComponent) << "unknown token dtype \"" << name << "\" (use u16 or u32)";
  __builtin_unreachable();
}

std::unique_ptr<TokenSource> open_bytes(const std::string& path, std::int64_t vocab) {
  auto file = std::make_unique<MappedFile>(path);
  const auto n = static_cast<std::int64_t>(file->size());
  std::string description = "bytes of " + path + " (" + std::to_string(n) + " tokens)";
  std::vector<Segment> segs;
  if (n > 0) segs.push_back({0, 0, n});
  return std::make_unique<WindowedTokens>("bytes", description, std::move(file), TokenDType::U8,
                                          std::move(segs), id_limit(vocab), 256);
}

namespace {

std::unique_ptr<TokenSource> open_raw(const std::string& path, TokenDType dtype, std::int64_t vocab, bool labels) {
  auto file = std::make_unique<MappedFile>(path);
  const std::uint64_t esize = token_size(dtype);
  SPPO_CHECK(file->size() % esize == 0, kComponent)
      << path << " is " << file->size() << " bytes, not a multiple of " << esize << " ("
      << token_dtype_name(dtype) << " tokens); is the dtype right?";
  const auto n = static_cast<std::int64_t>(file->size() / esize);
  const char* what = labels ? "labels" : "tokens";
  std::string description = std::string(token_dtype_name(dtype)) + " " + what + " of " + path + " (" +
                            std::to_string(n) + " " + what + ")";
  std::vector<Segment> segs;
  if (n > 0) segs.push_back({0, 0, n});
  return std::make_unique<WindowedTokens>(std::string(what) + "-" + token_dtype_name(dtype), description,
                                          std::move(file), dtype, std::move(segs), id_limit(vocab), vocab,
                                          std::nullopt, labels);
}

std::unique_ptr<TokenSource> open_megatron_pair(const std::string& path, std::int64_t vocab, bool labels) {
  std::string prefix = path;
  if (has_suffix(prefix, ".bin") || has_suffix(prefix, ".idx")) prefix.resize(prefix.size() - 4);
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";

  const MappedFile idx(idx_path);
  IdxCursor c(idx);
  static constexpr unsigned char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  SPPO_CHECK(idx.size() >= sizeof kMagic && std::memcmp(idx.data(), kMagic, sizeof kMagic) == 0, kComponent)
      << idx_path << " does not start with the MMIDIDX magic; it is not a Megatron index";
  c.take(sizeof kMagic);
  const auto version = c.get<std::uint64_t>();
  SPPO_CHECK(version == 1, kComponent) << idx_path << ": index version " << version << " (only 1 is supported)";
  const auto code = c.get<std::uint8_t>();
  TokenDType dtype;
  switch (code) {
    case 1: dtype = TokenDType::U8; break;
    case 2: dtype = TokenDType::I8; break;
    case 3: dtype = TokenDType::I16; break;
    case 4: dtype = TokenDType::I32; break;
    case 5: dtype = TokenDType::I64; break;
    case 8: dtype = TokenDType::U16; break;
    default:
      SPPO_CHECK(false, kComponent) << idx_path << ": dtype code " << int{code}
                                    << " is not an integer token type (supported: 1 uint8, 2 int8, "
                                       "3 int16, 4 int32, 5 int64, 8 uint16)";
      __builtin_unreachable();
  }
  const std::uint64_t esize = token_size(dtype);
  const auto num_seqs = c.get<std::uint64_t>();
  const auto num_docs = c.get<std::uint64_t>();
  SPPO_CHECK(num_seqs <= idx.size() / 12 && num_docs <= idx.size() / 8, kComponent)
      << idx_path << ": counts (" << num_seqs << " sequences, " << num_docs
      << " documents) do not fit in a " << idx.size() << "-byte index (corrupted?)";
  const unsigned char* sizes = c.take(num_seqs * 4);
  const unsigned char* pointers = c.take(num_seqs * 8);
  const unsigned char* doc_idx = c.take(num_docs * 8);

  auto bin = std::make_unique<MappedFile>(bin_path);
  auto seq_size = [&](std::uint64_t i) { return load_token<std::int32_t>(sizes + 4 * i); };
  auto seq_ptr = [&](std::uint64_t i) { return load_token<std::int64_t>(pointers + 8 * i); };
  for (std::uint64_t i = 0; i < num_seqs; ++i) {
    const std::int64_t sz = seq_size(i), ptr = seq_ptr(i);
    SPPO_CHECK(sz >= 0 && ptr >= 0 && static_cast<std::uint64_t>(ptr) <= bin->size() &&
                   static_cast<std::uint64_t>(sz) * esize <= bin->size() - static_cast<std::uint64_t>(ptr),
               kComponent)
        << idx_path << ": sequence " << i << " (" << sz << " tokens at byte " << ptr
        << ") lies outside the " << bin->size() << "-byte " << bin_path << " (mismatched pair?)";
  }

  // doc_idx holds document boundaries as sequence indices: [0, ..., num_seqs].
  std::vector<Segment> segs;
  std::vector<std::int64_t> doc_starts;  // token offsets where documents after the first begin
  std::int64_t total = 0;
  std::int64_t prev = -1;
  for (std::uint64_t d = 0; d < num_docs; ++d) {
    const std::int64_t b = load_token<std::int64_t>(doc_idx + 8 * d);
    SPPO_CHECK(b >= prev && b >= 0 && static_cast<std::uint64_t>(b) <= num_seqs, kComponent)
        << idx_path << ": document boundary " << d << " = " << b
        << " must be non-decreasing and within [0, " << num_seqs << "]";
    if (d > 0) {
      if (total > 0 && (doc_starts.empty() || doc_starts.back() < total)) doc_starts.push_back(total);
      for (std::int64_t s = prev; s < b; ++s) {
        const std::int64_t sz = seq_size(static_cast<std::uint64_t>(s));
        const auto ptr = static_cast<std::uint64_t>(seq_ptr(static_cast<std::uint64_t>(s)));
        if (sz == 0) continue;
        if (!segs.empty() && segs.back().byte_offset + segs.back().count * esize == ptr)
          segs.back().count += sz;  // adjacent in the .bin: one segment
        else
          segs.push_back({ptr, total, sz});
        total += sz;
      }
    }
    prev = b;
  }
  std::ostringstream description;
  description << "Megatron dataset " << prefix << ".{bin,idx} ("
              << (num_docs > 0 ? num_docs - 1 : 0) << " documents, " << total << " "
              << token_dtype_name(dtype) << (labels ? " labels)" : " tokens)");
  while (!doc_starts.empty() && doc_starts.back() >= total) doc_starts.pop_back();  // empty last documents
  return std::make_unique<WindowedTokens>(labels ? "labels-megatron" : "megatron", description.str(), std::move(bin),
                                          dtype, std::move(segs), id_limit(vocab), vocab, std::move(doc_starts),
                                          labels);
}

}  // namespace

std::unique_ptr<TokenSource> open_raw_tokens(const std::string& path, TokenDType dtype, std::int64_t vocab) {
  return open_raw(path, dtype, vocab, false);
}

std::unique_ptr<TokenSource> open_megatron(const std::string& path, std::int64_t vocab) {
  return open_megatron_pair(path, vocab, false);
}

std::unique_ptr<TokenSource> open_labels(const std::string& path, std::int64_t vocab) {
  constexpr const char* kAccepted =
      "labels are one signed integer per token of --data, -100 where no loss is taken: a raw file PATH.i32 "
      "or PATH.i64 (PATH.i16), or a Megatron dataset PATH.bin + PATH.idx of int16/int32/int64";
  std::error_code ec;
  std::string prefix = path;
  if (has_suffix(path, ".bin") || has_suffix(path, ".idx")) prefix.resize(path.size() - 4);
  if (fs::is_regular_file(prefix + ".bin", ec) && fs::is_regular_file(prefix + ".idx", ec))
    return open_megatron_pair(prefix, vocab, true);
  SPPO_CHECK(fs::is_regular_file(path, ec), kComponent) << "--labels " << path << " is not a file; " << kAccepted;
  if (has_suffix(path, ".i16")) return open_raw(path, TokenDType::I16, vocab, true);
  if (has_suffix(path, ".i32")) return open_raw(path, TokenDType::I32, vocab, true);
  if (has_suffix(path, ".i64")) return open_raw(path, TokenDType::I64, vocab, true);
  SPPO_CHECK(false, kComponent) << "--labels " << path << ": the file name says no label type; " << kAccepted;
  __builtin_unreachable();
}

// ---- factory -------------------------------------------------------------------------

std::unique_ptr<TokenSource> open_data(const std::string& spec, std::int64_t vocab, std::uint64_t seed,
                                       const DataOptions& options) {
  if (spec.empty() || spec == "repeat" || spec.rfind("repeat:", 0) == 0) {
    std::int64_t alphabet = options.alphabet;
    if (spec.size() > 7) {
      const std::string arg = spec.substr(7);
      SPPO_CHECK(!arg.empty() && arg.size() <= 10 &&
                     std::all_of(arg.begin(), arg.end(), [](char ch) { return ch >= '0' && ch <= '9'; }),
                 kComponent)
          << "data spec \"" << spec << "\": the alphabet after \"repeat:\" must be a positive integer";
      alphabet = std::stoll(arg);
      SPPO_CHECK(alphabet >= 1, kComponent)
          << "data spec \"" << spec << "\": the alphabet must be at least 1; e.g. \"repeat:"
          << (vocab > 0 ? std::min(vocab, kDefaultRepeatAlphabet) : kDefaultRepeatAlphabet)
          << "\", or \"repeat\" for min(vocabulary, " << kDefaultRepeatAlphabet << ") symbols";
    }
    if (alphabet <= 0) {
      SPPO_CHECK(vocab > 0, kComponent)
          << "the repeat task needs a vocabulary size or an explicit alphabet (\"repeat:<alphabet>\")";
      alphabet = std::min(vocab, kDefaultRepeatAlphabet);
    }
    SPPO_CHECK(vocab <= 0 || alphabet <= vocab, kComponent)
        << "repeat task alphabet " << alphabet << " exceeds the vocabulary size " << vocab
        << "; use repeat:" << vocab << " or less";
    return std::make_unique<RepeatTask>(alphabet, seed);
  }

  std::error_code ec;
  std::string prefix = spec;
  if (has_suffix(spec, ".bin") || has_suffix(spec, ".idx")) prefix.resize(spec.size() - 4);
  const bool pair = fs::is_regular_file(prefix + ".bin", ec) && fs::is_regular_file(prefix + ".idx", ec);
  if (pair) return open_megatron(prefix, vocab);

  SPPO_CHECK(fs::exists(spec, ec), kComponent) << "data file " << spec << " does not exist; " << kAcceptedFormats;
  SPPO_CHECK(fs::is_regular_file(spec, ec), kComponent) << "data path " << spec << " is not a regular file; "
                                                        << kAcceptedFormats;
  SPPO_CHECK(!has_suffix(spec, ".idx"), kComponent)
      << "Megatron index " << spec << " has no " << prefix << ".bin beside it";
  if (!options.token_dtype.empty()) return open_raw_tokens(spec, parse_token_dtype(options.token_dtype), vocab);
  if (has_suffix(spec, ".u16")) return open_raw_tokens(spec, TokenDType::U16, vocab);
  if (has_suffix(spec, ".u32")) return open_raw_tokens(spec, TokenDType::U32, vocab);
  SPPO_CHECK(!has_suffix(spec, ".bin"), kComponent)
      << spec << " has no " << prefix << ".idx beside it, so it is not a Megatron dataset; to read it "
      << "as raw tokens, give the token dtype (u16 or u32)";
  return open_bytes(spec, vocab);
}

}  // namespace sppo::io
