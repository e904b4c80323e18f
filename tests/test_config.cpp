// Config parsing, validation and the size arithmetic of docs/model.md §5–§7.
#include <gtest/gtest.h>

#include <cmath>

#include "model/config.h"

namespace laplace {
namespace {

const char* kTiny = R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2,
  "num_heads": 2, "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})";

TEST(Config, Laplace3bSizesMatchSpec) {
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-3b.json", &c).is_ok());
  EXPECT_EQ(c.qkvg_rows(), 9216);
  EXPECT_EQ(c.body_params(), 2717908992LL);
  EXPECT_EQ(c.total_params(), 3284740608LL);
  EXPECT_EQ(c.state_bytes_per_sequence(), 29491200LL);
  EXPECT_NEAR(c.train_flops_per_token(), 1.813e10, 0.001e10);
  auto d = c.decays();
  ASSERT_EQ(d.size(), 16u);
  EXPECT_DOUBLE_EQ(d[0], 1.0 - 1.0 / 32.0);
  EXPECT_DOUBLE_EQ(d[15], 1.0 - std::ldexp(1.0, -20));
}

TEST(Config, TinyPresetIsValid) {
  Config c;
  ASSERT_TRUE(config_load(std::string(LAPLACE_SOURCE_DIR) + "/configs/laplace-tiny.json", &c).is_ok());
  EXPECT_EQ(c.ffn_size, 4 * c.hidden_size);
}

TEST(Config, DefaultsAndRoundTrip) {
  Config c;
  ASSERT_TRUE(config_from_json(kTiny, &c).is_ok());
  EXPECT_EQ(c.conv_size, 4);
  EXPECT_EQ(c.chunk_size, 128);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_FALSE(c.tie_embeddings);
  Config back;
  ASSERT_TRUE(config_from_json(c.to_json(), &back).is_ok());
  EXPECT_EQ(back.to_json(), c.to_json());
}

// decay_exponents spreads a few heads' memories (λ_h = 1 − 2^(−e_h)) and survives the round trip; the
// default is 5 + h.
TEST(Config, DecayExponents) {
  Config c;
  ASSERT_TRUE(config_from_json(kTiny, &c).is_ok());
  EXPECT_DOUBLE_EQ(c.decays()[1], 1.0 - std::ldexp(1.0, -6));
  EXPECT_EQ(c.to_json().find("decay_exponents"), std::string::npos);
  c.decay_exponents = {5, 20};
  ASSERT_TRUE(c.validate().is_ok());
  EXPECT_DOUBLE_EQ(c.decays()[0], 1.0 - 1.0 / 32.0);
  EXPECT_DOUBLE_EQ(c.decays()[1], 1.0 - std::ldexp(1.0, -20));
  Config back;
  ASSERT_TRUE(config_from_json(c.to_json(), &back).is_ok());
  EXPECT_EQ(back.decay_exponents, (std::vector<int64_t>{5, 20}));
  EXPECT_EQ(back.decays(), c.decays());
}

TEST(Config, TiedEmbeddingsDropTheHead) {
  Config c;
  ASSERT_TRUE(config_from_json(kTiny, &c).is_ok());
  const int64_t untied = c.total_params();
  c.tie_embeddings = true;
  EXPECT_EQ(untied - c.total_params(), c.vocab_size * c.hidden_size);
}

struct BadCase {
  const char* json;
  const char* needle;
};

TEST(Config, BadValuesGiveClearErrors) {
  const BadCase cases[] = {
      {"", "not valid JSON"},
      {"{", "not valid JSON"},
      {"[1,2]", "JSON object"},
      {R"({"vocab_size": 10})", "model_type"},
      {R"({"model_type": "llama", "vocab_size": 10})", "model_type"},
      {R"({"model_type": "laplace", "hidden_size": 64})", "vocab_size"},
      {R"({"model_type": "laplace", "vocab_size": "many", "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})", "vocab_size"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 0, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})", "hidden_size"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": -1, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})", "num_layers"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16.5, "head_v_dim": 32, "ffn_size": 256})", "head_k_dim"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "norm_eps": -1})", "norm_eps"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "tie_embeddings": "yes"})", "tie_embeddings"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "chunk_size": 0})", "chunk_size"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 64,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})", "num_heads"},
      {R"({"model_type": "laplace", "vocab_size": 99999999999999, "hidden_size": 64, "num_layers": 2,
           "num_heads": 2, "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256})", "vocab_size"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "eos_token_id": 256})", "eos_token_id"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "decay_exponents": [5]})", "has 1 entries; num_heads is 2"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "decay_exponents": [5, 0]})", "holds 0, outside [1, 44]"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "decay_exponents": [5, 2.5]})", "array of integers"},
      {R"({"model_type": "laplace", "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
           "head_k_dim": 16, "head_v_dim": 32, "ffn_size": 256, "decay_exponents": 5})", "array of integers"},
  };
  for (const auto& bc : cases) {
    Config c;
    Status st = config_from_json(bc.json, &c);
    EXPECT_FALSE(st.is_ok()) << bc.json;
    EXPECT_NE(st.message().find(bc.needle), std::string::npos) << st.message() << " / wanted " << bc.needle;
  }
}

TEST(Config, MissingFileIsNotFound) {
  Config c;
  Status st = config_load("/nonexistent/config.json", &c);
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_NE(st.message().find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace laplace
