// Token shards in llm.c's binary format (see docs/data.md):
//
//   header: 256 little-endian int32
//     [0] magic 20240520
//     [1] version: 1 = tokens are uint16, 2 = tokens are uint32
//     [2] token count, low 32 bits (read as uint32)
//     [3] token count, high 32 bits. llm.c writes count < 2^31 in [2] and 0
//         here, so its shards read unchanged; only counts >= 2^31 look
//         different from llm.c's layout (and llm.c cannot read those).
//     [4..255] 0
//   body: `count` tokens, little endian, 2 (v1) or 4 (v2) bytes each.
//
// A file is valid only if its size is exactly 1024 + count * token_bytes.
// The reader also accepts llm.c's Llama-3 shards (magic 20240801, version 7,
// uint32 tokens); the writer only produces versions 1 and 2.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/file_util.h"
#include "core/status.h"

namespace laplace {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersionU16 = 1;
inline constexpr int32_t kShardVersionU32 = 2;
inline constexpr int32_t kShardMagicLlama3 = 20240801;  // llm.c, read only
inline constexpr int32_t kShardVersionLlama3 = 7;       // uint32 tokens
inline constexpr int64_t kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

// The version shard_write picks: 1 (uint16) when vocab_size <= 65536, else 2.
int32_t shard_version_for_vocab(int64_t vocab_size);

// Writes `tokens` to `path` atomically (temp file + rename). Every token must
// be < vocab_size (invalid_argument naming the first offender otherwise).
Status shard_write(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size);
// Same, from a raw array.
Status shard_write(const std::string& path, const uint32_t* tokens, int64_t n, int64_t vocab_size);

// A read-only, memory-mapped shard.
class ShardReader {
 public:
  ShardReader() = default;
  ShardReader(ShardReader&& o) noexcept;
  ShardReader& operator=(ShardReader&& o) noexcept;
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  // Opens and validates `path`: magic, version, header padding, exact file
  // size, and — when vocab_size > 0 — that every token is < vocab_size (one
  // scan at open; skipped for v1 when vocab_size >= 65536). Errors are
  // corrupt (or not_found / io_error from the file system) and name the path.
  // *out is replaced only on success.
  static Status open(const std::string& path, int64_t vocab_size, ShardReader* out);

  int64_t size() const { return count_; }
  // 1 (uint16), 2 (uint32) or 7 (llm.c Llama-3 shard, uint32).
  int32_t version() const { return version_; }
  const std::string& path() const { return file_.path(); }

  // Token i, 0 <= i < size() (checked).
  uint32_t token(int64_t i) const;
  // Copies tokens [begin, begin + n) to out (range checked).
  void read(int64_t begin, int64_t n, int32_t* out) const;

 private:
  MappedFile file_;
  int32_t version_ = 0;
  int64_t count_ = 0;
  const uint8_t* body_ = nullptr;
};

}  // namespace laplace
