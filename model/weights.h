// The model's parameters: one Arena carved by a size table with the canonical
// names of docs/model.md §2. The same table carves gradient arenas, so a gradient has the
// name and shape of its parameter.
#pragma once

#include <map>

#include <string>
#include <vector>

#include "core/arena.h"
#include "core/status.h"
#include "model/config.h"
#include "ops/backend.h"

namespace laplace {

struct LayerWeights {
  Tensor norm1_w, norm1_b;  // [D], [D]
  Tensor conv_w;            // [D, K]
  Tensor wqkvg;             // [H(2dk+2dv), D]
  Tensor onorm_w;           // [dv]
  Tensor wo;                // [D, H·dv]
  Tensor norm2_w, norm2_b;  // [D], [D]
  Tensor w12;               // [2F, D]
  Tensor w3;                // [D, F]
};

struct ModelWeights {
  Tensor embed;                      // [V, D]
  std::vector<LayerWeights> layers;  // L
  Tensor norm_w, norm_b;             // [D]
  Tensor lm_head;                    // [V, D]; aliases embed when tied
};

// The size table, in canonical order. lm_head is absent when embeddings are tied.
std::vector<TensorSpec> weight_specs(const Config& c, DType dtype);

// Views of an arena created from weight_specs(c, ·).
ModelWeights weights_bind(const Config& c, const Arena& arena);

// True for the four body matrices per layer that Muon optimises.
bool is_body_matrix(const std::string& name);
// Row blocks orthogonalised separately (docs/training.md §6): q,k,v,g of W_qkvg; a,b of W_12.
std::vector<int64_t> muon_blocks(const Config& c, const std::string& name);
// Parameters that AdamW decays (embedding and head).
bool is_decayed_by_adamw(const std::string& name);

// Deterministic initialisation from a seed, on the host's cores then copied to the arena's
// device: matrices N(0, 0.02), W_o and W_3 scaled by 1/√(2L), norm weights 1, biases
// 0, onorm 1, conv N(0, 1/√K). Each tensor's normal values are Box–Muller pairs of a
// SplitMix64 stream keyed by the seed and the tensor's name (core/rng.h), so they do not
// depend on the thread count (`threads`; 0: OpenMP's), and a 3B model initialises in seconds.
void weights_init(const Config& c, Backend& be, const Arena& arena, uint64_t seed, int threads = 0);

// A model file's metadata: {"format": "pt", "laplace_config": the config's JSON,
// "laplace_precision": the weights' dtype ("f32", "bf16", "f64"; model/quantize.h's FP8 files
// say "fp8_e4m3_rows")}.
std::map<std::string, std::string> model_file_metadata(const Config& c, DType weights);
// safetensors with the canonical names and model_file_metadata, written atomically, each
// tensor in the arena's dtype.
Status weights_save(const std::string& path, const Config& c, Backend& be, const Arena& arena);
// Loads every tensor of the arena by name, converting dtypes where needed. Missing
// tensors, wrong shapes and unexpected extra tensors are errors; so is a file of FP8
// weights (model/quantize.h), which no path that loads through here can compute with.
Status weights_load(const std::string& path, Backend& be, const Arena& arena);

}  // namespace laplace
