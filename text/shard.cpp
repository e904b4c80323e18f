#include "text/shard.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/check.h"

namespace laplace {

static_assert(std::endian::native == std::endian::little, "shards are little endian; big-endian hosts unsupported");

namespace {

template <class T>
int64_t first_at_or_above(const T* p, int64_t n, uint64_t bound) {
  // Fast path: a branch-free max over blocks, then locate the first offender.
  constexpr int64_t kBlock = 1 << 16;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    T m = 0;
    for (int64_t i = b; i < e; ++i) m = std::max(m, p[i]);
    if (static_cast<uint64_t>(m) >= bound) {
      for (int64_t i = b; i < e; ++i) {
        if (static_cast<uint64_t>(p[i]) >= bound) return i;
      }
    }
  }
  return -1;
}

}  // namespace

int32_t shard_version_for_vocab(int64_t vocab_size) {
  return vocab_size <= 65536 ? kShardVersionU16 : kShardVersionU32;
}

Status shard_write(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size) {
  return shard_write(path, tokens.data(), static_cast<int64_t>(tokens.size()), vocab_size);
}

Status shard_write(const std::string& path, const uint32_t* tokens, int64_t n, int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_size > (int64_t{1} << 31)) {
    return Status::invalid_argument("shard " + path + ": vocab_size " + std::to_string(vocab_size) +
                                    " must be in [1, 2^31] (ids are int32)");
  }
  if (n < 0) return Status::invalid_argument("shard " + path + ": negative token count");
  const int64_t bad = first_at_or_above(tokens, n, static_cast<uint64_t>(vocab_size));
  if (bad >= 0) {
    return Status::invalid_argument("shard " + path + ": token " + std::to_string(tokens[bad]) + " at position " +
                                    std::to_string(bad) + " is >= vocab_size " + std::to_string(vocab_size));
  }
  const int32_t version = shard_version_for_vocab(vocab_size);
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = version;
  const uint64_t count = static_cast<uint64_t>(n);
  header[2] = static_cast<int32_t>(static_cast<uint32_t>(count & 0xffffffffu));
  header[3] = static_cast<int32_t>(static_cast<uint32_t>(count >> 32));
  return write_file_atomic(path, [&](std::FILE* f) -> Status {
    LAPLACE_RETURN_IF_ERROR(write_all(f, header, sizeof(header)));
    if (version == kShardVersionU32) return write_all(f, tokens, static_cast<size_t>(n) * 4);
    constexpr int64_t kChunk = 1 << 16;
    std::vector<uint16_t> buf(static_cast<size_t>(std::min<int64_t>(n, kChunk)));
    for (int64_t b = 0; b < n; b += kChunk) {
      const int64_t e = std::min(n, b + kChunk);
      for (int64_t i = b; i < e; ++i) buf[i - b] = static_cast<uint16_t>(tokens[i]);
      LAPLACE_RETURN_IF_ERROR(write_all(f, buf.data(), static_cast<size_t>(e - b) * 2));
    }
    return Status::ok();
  });
}

ShardReader::ShardReader(ShardReader&& o) noexcept
    : file_(std::move(o.file_)), version_(o.version_), count_(o.count_), body_(o.body_) {
  o.version_ = 0;
  o.count_ = 0;
  o.body_ = nullptr;
}

ShardReader& ShardReader::operator=(ShardReader&& o) noexcept {
  if (this != &o) {
    file_ = std::move(o.file_);
    version_ = o.version_;
    count_ = o.count_;
    body_ = o.body_;
    o.version_ = 0;
    o.count_ = 0;
    o.body_ = nullptr;
  }
  return *this;
}

Status ShardReader::open(const std::string& path, int64_t vocab_size, ShardReader* out) {
  MappedFile f;
  LAPLACE_RETURN_IF_ERROR(MappedFile::open(path, &f).with_context("opening token shard"));
  const uint64_t fsize = f.size();
  auto bad = [&](const std::string& what) { return Status::corrupt("token shard " + path + ": " + what); };
  if (fsize < static_cast<uint64_t>(kShardHeaderBytes)) {
    return bad("file is " + std::to_string(fsize) + " bytes, shorter than the " + std::to_string(kShardHeaderBytes) +
               "-byte header");
  }
  int32_t h[kShardHeaderInts];
  std::memcpy(h, f.data(), sizeof(h));
  if (h[0] == kShardMagicLlama3) {
    if (h[1] != kShardVersionLlama3) {
      return bad("unsupported version " + std::to_string(h[1]) + " for magic " + std::to_string(kShardMagicLlama3) +
                 " (llm.c Llama-3 shards are version 7 = uint32 tokens)");
    }
  } else if (h[0] != kShardMagic) {
    return bad("bad magic " + std::to_string(h[0]) + " (expected " + std::to_string(kShardMagic) +
               "); not an llm.c/laplace token shard");
  } else if (h[1] != kShardVersionU16 && h[1] != kShardVersionU32) {
    return bad("unsupported version " + std::to_string(h[1]) + " (expected 1 = uint16 tokens or 2 = uint32 tokens)");
  }
  for (int i = 4; i < kShardHeaderInts; ++i) {
    if (h[i] != 0) return bad("header int " + std::to_string(i) + " is " + std::to_string(h[i]) + ", expected 0");
  }
  const uint64_t count = static_cast<uint64_t>(static_cast<uint32_t>(h[2])) |
                         (static_cast<uint64_t>(static_cast<uint32_t>(h[3])) << 32);
  const uint64_t tok_bytes = h[1] == kShardVersionU16 ? 2 : 4;
  if (count > (uint64_t{1} << 60)) return bad("implausible token count " + std::to_string(count));
  const uint64_t expect = static_cast<uint64_t>(kShardHeaderBytes) + count * tok_bytes;
  if (fsize != expect) {
    return bad("file size " + std::to_string(fsize) + " bytes does not match the header: expected " +
               std::to_string(expect) + " bytes (1024 + " + std::to_string(count) + " tokens x " +
               std::to_string(tok_bytes) + " bytes); the file is " + (fsize < expect ? "truncated" : "too long"));
  }
  const uint8_t* body = f.data() + kShardHeaderBytes;
  const int64_t n = static_cast<int64_t>(count);
  const bool need_scan = vocab_size > 0 && !(h[1] == kShardVersionU16 && vocab_size >= 65536);
  if (need_scan) {
    int64_t pos = -1;
    uint32_t value = 0;
    if (h[1] == kShardVersionU16) {
      // The map is page aligned and the header is 1024 bytes, so the body is aligned.
      const auto* p = reinterpret_cast<const uint16_t*>(body);
      pos = first_at_or_above(p, n, static_cast<uint64_t>(vocab_size));
      if (pos >= 0) value = p[pos];
    } else {
      const auto* p = reinterpret_cast<const uint32_t*>(body);
      pos = first_at_or_above(p, n, static_cast<uint64_t>(vocab_size));
      if (pos >= 0) value = p[pos];
    }
    if (pos >= 0) {
      return bad("token " + std::to_string(value) + " at position " + std::to_string(pos) + " is >= vocab_size " +
                 std::to_string(vocab_size) + " (shard made with a different tokenizer?)");
    }
  }
  out->file_ = std::move(f);
  out->version_ = h[1];
  out->count_ = n;
  out->body_ = count > 0 ? body : nullptr;
  return Status::ok();
}

uint32_t ShardReader::token(int64_t i) const {
  LAPLACE_CHECK(i >= 0 && i < count_, "ShardReader::token: index out of range");
  if (version_ == kShardVersionU16) return reinterpret_cast<const uint16_t*>(body_)[i];
  return reinterpret_cast<const uint32_t*>(body_)[i];
}

void ShardReader::read(int64_t begin, int64_t n, int32_t* out) const {
  LAPLACE_CHECK(begin >= 0 && n >= 0 && begin <= count_ && n <= count_ - begin, "ShardReader::read: range out of bounds");
  if (n == 0) return;
  if (version_ == kShardVersionU16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(body_) + begin;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(p[i]);
  } else {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(body_) + begin;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(p[i]);
  }
}

}  // namespace laplace
