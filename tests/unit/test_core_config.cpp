// Size and count parsing (exact, checked arithmetic) and model configs read from JSON:
// every refusal names the option or field and says what works.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/layout.h"
#include "support/expect_error.h"

namespace sppo {
namespace {

TEST(ParseCount, AcceptsWholeNumbersWithSuffixes) {
  EXPECT_EQ(parse_count("65536", "--seq-len"), 65536);
  EXPECT_EQ(parse_count("64K", "--seq-len"), 65536);
  EXPECT_EQ(parse_count("64k", "--seq-len"), 65536);
  EXPECT_EQ(parse_count("1M", "--seq-len"), 1048576);
  EXPECT_EQ(parse_count("2G", "--seq-len"), i64{2} << 30);
  EXPECT_EQ(parse_count("1.5K", "--seq-len"), 1536);
  EXPECT_EQ(parse_count("0.25M", "--seq-len"), 262144);
  EXPECT_EQ(parse_count("0", "--seq-len"), 0);
  EXPECT_EQ(parse_count("7.000", "--seq-len"), 7);
  EXPECT_EQ(parse_count("1024G", "--seq-len"), kMaxCount);
  EXPECT_EQ(parse_count("1099511627776", "--seq-len"), kMaxCount);
}

TEST(ParseCount, RefusesWhatIsNotAWholeNumber) {
  for (const char* bad : {"", "abc", "12Q", "1e3", "1.3K", "0.5", "K", ".", "64KiB", " 64", "0x10", "inf", "nan"})
    EXPECT_ERROR_WITH(parse_count(bad, "--seq-len"), "--seq-len", "not a whole number", "64K");
  EXPECT_ERROR_WITH(parse_count("-5", "--seq-len"), "--seq-len '-5' is negative");
  EXPECT_ERROR_WITH(parse_count("-1K", "--subseqs"), "--subseqs", "negative");
}

TEST(ParseCount, TooLargeNamesTheLimit) {
  for (const char* big : {"9223372036854775807", "1099511627777", "1025G", "999999999999999999999G",
                          "18446744073709551616", "99999999999999999999999999999999999999999999"})
    EXPECT_ERROR_WITH(parse_count(big, "--seq-len"), "--seq-len", "too large", "1099511627776");
}

TEST(ParseBytes, AcceptsSizes) {
  EXPECT_EQ(parse_bytes("512MiB", "--device-memory"), i64{512} << 20);
  EXPECT_EQ(parse_bytes("512M", "--device-memory"), i64{512} << 20);
  EXPECT_EQ(parse_bytes("2GiB", "--device-memory"), i64{2} << 30);
  EXPECT_EQ(parse_bytes("1.5GB", "--device-memory"), 1500000000);
  EXPECT_EQ(parse_bytes("1.5KiB", "--device-memory"), 1536);
  EXPECT_EQ(parse_bytes("100", "--device-memory"), 100);
  EXPECT_EQ(parse_bytes("100B", "--device-memory"), 100);
  EXPECT_EQ(parse_bytes("1.9B", "--device-memory"), 1);  // fractions of a byte are dropped
  EXPECT_EQ(parse_bytes("3TB", "--device-memory"), 3000000000000);
  EXPECT_EQ(parse_bytes("1048576TiB", "--device-memory"), kMaxBytes);
  EXPECT_EQ(parse_bytes("0.000000000001TB", "--device-memory"), 1);
}

TEST(ParseBytes, RefusesWhatIsNotAPositiveSize) {
  for (const char* bad : {"", "lots", "0", "0B", "0.1B", "-1GiB", "-0", "12XB", "1e9", "GiB",
                          "0.000000000000000001TB", "0.0000000000000000001TB"})
    EXPECT_ERROR_WITH(parse_bytes(bad, "--device-memory"), "--device-memory", "not a positive size", "512MiB");
}

TEST(ParseBytes, TooLargeNamesTheLimit) {
  for (const char* big : {"999999999999999999999GiB", "1048577TiB", "9223372036854775807", "18446744073709551616B",
                          "1152921504606846977"})
    EXPECT_ERROR_WITH(parse_bytes(big, "--budget"), "--budget", "too large", "1152921504606846976");
}

TEST(ModelConfigJson, RefusesWrongTypesAndAbsurdSizes) {
  const nlohmann::json good = {{"vocab", 64}, {"hidden", 64}, {"layers", 2}, {"heads", 4}};
  EXPECT_EQ(model_config_from_json(good).hidden, 64);
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json j = good;
    j[key] = std::move(v);
    return j;
  };
  EXPECT_ERROR_WITH(model_config_from_json(with("vocab", 1e300)), "\"vocab\" must be an integer");
  EXPECT_ERROR_WITH(model_config_from_json(with("hidden", 64.5)), "\"hidden\" must be an integer");
  EXPECT_ERROR_WITH(model_config_from_json(with("layers", "2")), "\"layers\" must be an integer");
  EXPECT_ERROR_WITH(model_config_from_json(with("heads", 4294967300LL)), "\"heads\" must be an integer");
  EXPECT_ERROR_WITH(model_config_from_json(with("rope_theta", "big")), "\"rope_theta\" must be a number");
  EXPECT_ERROR_WITH(model_config_from_json(with("hidden", 1 << 22)), "at most");
  nlohmann::json huge = with("hidden", 65536);
  huge["layers"] = 60000;
  huge["heads"] = 512;
  EXPECT_ERROR_WITH(model_config_from_json(huge), "parameters");
  // Once took seconds: the search for head counts that work ran up to H.
  EXPECT_ERROR_WITH(model_config_from_json(with("hidden", 444444442)), "at most");
  nlohmann::json odd = with("hidden", 1048574);  // 2 x 524287 (prime): few head counts work
  odd["heads"] = 3;
  EXPECT_ERROR_WITH(model_config_from_json(odd), "--heads 524287");
  nlohmann::json missing = good;
  missing.erase("heads");
  EXPECT_ERROR_WITH(model_config_from_json(missing), "lacks \"heads\"");
}

// The presets of the released models count the published parameters exactly (their
// config.json shapes; the small ones tie their LM head to the embedding).
TEST(Presets, CountThePublishedParameters) {
  const std::pair<const char*, i64> released[] = {{"llama-3-8b", 8030261248},   {"qwen2.5-7b", 7615616512},
                                                  {"llama-3.2-1b", 1235814400}, {"llama-3.2-3b", 3212749824},
                                                  {"qwen2.5-0.5b", 494032768},  {"qwen2.5-1.5b", 1543714304}};
  for (const auto& [name, params] : released) EXPECT_EQ(preset(name).num_params(), params) << name;
  EXPECT_TRUE(preset("llama-3.2-1b").tied_embeddings());
  EXPECT_FALSE(preset("llama-3-8b").tied_embeddings());
  EXPECT_TRUE(preset("tiny").tied_embeddings());  // GPT's head is its embedding
}

// Qwen3: heads of 128 whatever H is, q_norm and k_norm [128] a layer, the three small ones
// tied. Their counts from the published config.json shapes, the tied head counted once (as
// transformers' num_parameters() does): 2,031,739,904 for Qwen3-1.7B would count its
// embedding twice (V H = 311,164,928 more), as an untied head would.
TEST(Presets, Qwen3CountsTheirShapes) {
  const std::pair<const char*, i64> released[] = {{"qwen3-0.6b", 596049920}, {"qwen3-1.7b", 1720574976},
                                                  {"qwen3-4b", 4022468096},  {"qwen3-8b", 8190735360},
                                                  {"qwen3-32b", 32762123264}};
  for (const auto& [name, params] : released) {
    const ModelConfig c = preset(name);
    EXPECT_EQ(c.num_params(), params) << name;
    EXPECT_EQ(c.head_size(), 128) << name;
    EXPECT_TRUE(c.qk_norm) << name;
    EXPECT_EQ(total_bytes(parameter_specs(c)) / 4, params) << name;
  }
  EXPECT_EQ(preset("qwen3-0.6b").q_width(), 2048);  // 16 heads of 128 on H 1024
  EXPECT_EQ(preset("qwen3-32b").q_width(), 8192);   // 64 of 128 on H 5120
  EXPECT_TRUE(preset("qwen3-4b").tied_embeddings());
  EXPECT_FALSE(preset("qwen3-8b").tied_embeddings());
  const ModelConfig tiny = preset("qwen3-tiny");
  EXPECT_NE(tiny.head_size(), tiny.hidden / tiny.heads);
  EXPECT_LT(tiny.kv_head_count(), tiny.heads);
  EXPECT_TRUE(tiny.tied_embeddings() && tiny.qk_norm);
}

// A head size of its own and query/key norms survive the config's JSON; a GPT block and
// impossible sizes are refused naming the field.
TEST(ModelConfigJson, HeadSizeAndQueryKeyNorms) {
  const ModelConfig c = preset("qwen3-tiny");
  const nlohmann::json j = to_json(c);
  EXPECT_EQ(j["head_dim"], c.head_dim);
  EXPECT_EQ(j["qk_norm"], true);
  const ModelConfig back = model_config_from_json(j);
  EXPECT_EQ(back.head_size(), c.head_size());
  EXPECT_TRUE(back.qk_norm);
  EXPECT_EQ(back.num_params(), c.num_params());
  EXPECT_FALSE(to_json(preset("llama-tiny")).contains("head_dim"));
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json x = j;
    x[key] = std::move(v);
    return x;
  };
  EXPECT_ERROR_WITH(model_config_from_json(with("head_dim", 7)), "head_dim 7 must be even");
  EXPECT_ERROR_WITH(model_config_from_json(with("head_dim", 4096)), "\"head_dim\" must be an integer");
  EXPECT_ERROR_WITH(model_config_from_json(with("qk_norm", "yes")), "\"qk_norm\" must be true or false");
  ModelConfig gpt = preset("tiny");
  gpt.head_dim = 32;
  EXPECT_ERROR_WITH(gpt.validate(), "head_dim 32 belongs to Llama-family models");
  gpt.head_dim = 0;
  gpt.qk_norm = true;
  EXPECT_ERROR_WITH(gpt.validate(), "qk_norm");
  ModelConfig wide = preset("qwen3-tiny");
  wide.heads = 1 << 14;
  wide.kv_heads = 2;
  wide.head_dim = 128;
  EXPECT_ERROR_WITH(wide.validate(), "make queries 2097152 wide");
}

// A Llama-family model's tied head survives the config's JSON; absent, the head is its own.
TEST(ModelConfigJson, TiedEmbeddingsRoundTrip) {
  ModelConfig c = preset("llama-tiny");
  EXPECT_FALSE(to_json(c).contains("tie_embeddings"));
  c.tie_embeddings = true;
  const nlohmann::json j = to_json(c);
  EXPECT_EQ(j["tie_embeddings"], true);
  const ModelConfig back = model_config_from_json(j);
  EXPECT_TRUE(back.tied_embeddings());
  EXPECT_EQ(back.num_params(), c.num_params());
  EXPECT_EQ(c.num_params(), preset("llama-tiny").num_params() - i64(c.vocab) * c.hidden);
  nlohmann::json bad = j;
  bad["tie_embeddings"] = "yes";
  EXPECT_ERROR_WITH(model_config_from_json(bad), "\"tie_embeddings\" must be true or false");
}

// --recompute-tensors: tensor or group names close over their groups (one forward step
// makes a group); k, v and x are refused naming what does recompute them; the text form
// is the groups in forward order.
TEST(RecomputeTensors, NamesCloseOverTheirGroups) {
  const auto& g = recompute_groups();
  EXPECT_EQ(parse_recompute_tensors(""), 0u);
  EXPECT_EQ(parse_recompute_tensors("none"), 0u);
  EXPECT_EQ(parse_recompute_tensors("ln1_out"), g[0].tensors);
  EXPECT_EQ(parse_recompute_tensors("ln2_rstd,q"), g[4].tensors | g[1].tensors);
  EXPECT_EQ(parse_recompute_tensors("lse"), g[2].tensors);
  EXPECT_EQ(parse_recompute_tensors("fc_pre,fc_pre"), g[5].tensors);
  SavedSet all = 0;
  for (const auto& group : g) all |= group.tensors;
  // all: the block's tensors; head_grad, the last stage's, is named alone.
  EXPECT_EQ(parse_recompute_tensors("all"), all & ~(1u << kSavedHeadGrad));
  EXPECT_EQ(parse_recompute_tensors("all,head_grad"), all);
  EXPECT_EQ(recompute_tensors_text(parse_recompute_tensors("head_grad")), "head_grad");
  EXPECT_FALSE(in_set(all, kSavedX) || in_set(all, kSavedK) || in_set(all, kSavedV));
  EXPECT_EQ(recompute_tensors_text(parse_recompute_tensors("x_mid,ln1_mean")), "ln1,x_mid");
  EXPECT_EQ(recompute_tensors_text(0), "none");
  for (SavedSet s : recompute_levels()) EXPECT_EQ(parse_recompute_tensors(recompute_tensors_text(s)), s);
  // Each level recomputes more than the one before.
  for (std::size_t k = 1; k < recompute_levels().size(); ++k)
    EXPECT_EQ(recompute_levels()[k] & recompute_levels()[k - 1], recompute_levels()[k - 1]);
  EXPECT_ERROR_WITH(parse_recompute_tensors("k"), "--kv-cache recompute");
  EXPECT_ERROR_WITH(parse_recompute_tensors("ln1,v"), "--kv-cache recompute");
  EXPECT_ERROR_WITH(parse_recompute_tensors("x"), "always kept");
  EXPECT_ERROR_WITH(parse_recompute_tensors("fc_post"), "no saved tensor 'fc_post'");
  EXPECT_ERROR_WITH(parse_recompute_tensors("fc_post"), "ln1_mean, ln1_rstd, ln1_out, q");
}

}  // namespace
}  // namespace sppo
