// Model configuration: the HF-style config.json of docs/model.md §1 ("model_type": "laplace").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace laplace {

struct Config {
  int64_t vocab_size = 0;   // V
  int64_t hidden_size = 0;  // D
  int64_t num_layers = 0;   // L
  int64_t num_heads = 0;    // H
  int64_t head_k_dim = 0;   // dk
  int64_t head_v_dim = 0;   // dv
  int64_t ffn_size = 0;     // F
  int64_t conv_size = 4;    // K
  int64_t chunk_size = 128; // C
  double norm_eps = 1e-5;
  bool tie_embeddings = false;
  // Optional, used by the tokenizer/generation once a tokenizer is attached.
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  // Optional "decay_exponents" [H]: λ_h = 1 − 2^(−e_h) instead of the default e_h = 5 + h. The
  // default gives head h a memory of about 2^(5+h) tokens: 32 … 2^20 for laplace-3b's 16 heads,
  // but only 32 … 256 for 4 heads, too short for any use of context past a few thousand tokens
  // (a token 8,192 back weighs (1 − 2⁻⁸)^8192 ≈ e⁻³² in the slowest head). A model with few heads
  // can spread the same range instead, e.g. [5, 10, 15, 20]. Empty: the default.
  std::vector<int64_t> decay_exponents;

  int64_t qkvg_rows() const { return num_heads * (2 * head_k_dim + 2 * head_v_dim); }
  int64_t qk_dim() const { return num_heads * head_k_dim; }   // H·dk
  int64_t v_dim() const { return num_heads * head_v_dim; }    // H·dv

  // Parameters of the 4 body matrices per layer (what Muon optimises; docs/model.md §6).
  int64_t body_params() const;
  // All parameters (embedding, head unless tied, norms, conv).
  int64_t total_params() const;
  // Bytes of one sequence's decode state: L × (H·dk·dv + K·D) fp32 values (docs/model.md §5).
  int64_t state_bytes_per_sequence() const;
  // Training FLOPs per token, docs/model.md §7: 6·(body + V·D) + L·3·H·(C(dk+dv) + 4·dk·dv).
  double train_flops_per_token() const;

  // λ_h = 1 − 2^(−e_h), e_h = 5 + h unless decay_exponents is given (fixed per head; docs/model.md §3).
  std::vector<double> decays() const;

  Status validate() const;
  std::string to_json() const;  // pretty-printed config.json
};

// Parses and validates config.json text. Unknown keys are ignored; missing required
// keys, wrong types and out-of-range values are errors naming the field.
Status config_from_json(const std::string& text, Config* out);
Status config_load(const std::string& path, Config* out);

}  // namespace laplace
