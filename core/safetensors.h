// safetensors: the checkpoint format of Laplace (and of Hugging Face).
//
// Layout: an 8-byte little-endian u64 N, then N bytes of a UTF-8 JSON object,
// then the data section. The JSON maps each tensor name to
//   {"dtype": "F32", "shape": [9216, 3072], "data_offsets": [begin, end]}
// (offsets relative to the start of the data section) plus an optional
// "__metadata__" object of string -> string. Tensor names follow docs/model.md §2
// ("model.layers.0.wqkvg.weight", ...).
//
// The reader maps the file and validates the whole header up front, so that
// every later access is in bounds; a malformed file gives a Status naming the
// file and the problem, never a crash, an out-of-bounds read or a hang.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/file_util.h"
#include "core/status.h"
#include "core/tensor.h"

namespace laplace {

// Largest header accepted, as in the reference implementation (guards against
// a corrupt length making us parse, or allocate for, gigabytes of "JSON").
constexpr uint64_t kSafeTensorsMaxHeader = 100'000'000;

struct SafeTensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // at most kMaxDims entries (checked on open)
  uint64_t begin = 0, end = 0;  // byte offsets within the data section

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
  std::string shape_str() const;  // "[9216, 3072] F32"
};

// Immutable after open(): const methods may be called from several threads.
class SafeTensorsReader {
 public:
  SafeTensorsReader() = default;
  SafeTensorsReader(SafeTensorsReader&&) noexcept = default;
  SafeTensorsReader& operator=(SafeTensorsReader&&) noexcept = default;

  // Maps and validates `path`; *out is replaced only on success.
  // Errors: not_found / io_error (the file), corrupt (anything wrong in the
  // header or layout), unsupported (a tensor of more than kMaxDims dimensions).
  static Status open(const std::string& path, SafeTensorsReader* out);

  const std::string& path() const { return file_.path(); }
  // All tensors, sorted by begin offset (ties by end, then name).
  const std::vector<SafeTensorInfo>& tensors() const { return tensors_; }
  // nullptr if absent.
  const SafeTensorInfo* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Raw bytes of a tensor inside the mapping (valid while this reader lives);
  // `info` as for view().
  const uint8_t* bytes(const SafeTensorInfo& info) const;

  // A contiguous, read-only CPU view of the mapped bytes (do not write through
  // it), valid while this reader lives. `info` must come from tensors()/find()
  // of this reader (or be a copy of such an entry).
  // Fails (invalid_argument) if the bytes are not aligned for the dtype, which
  // happens only in files whose header length or layout ignores alignment
  // (files from Python's safetensors and from safetensors_write with tensors
  // ordered by decreasing dtype size are aligned); read_into works regardless.
  Status view(const SafeTensorInfo& info, Tensor* out) const;

  // Copies tensor `name` into dst (CPU, contiguous, defined unless empty) after
  // checking that the shapes are equal; on mismatch the error reads
  //   "<file>: model.layers.0.wqkvg.weight: expected shape [9216, 3072] F32,
  //    file has [9216, 3000] F32".
  // Equal dtypes are copied bit for bit. Conversions when dst's dtype differs:
  //   BF16 -> F32 (exact), F32 -> F64 (exact), F64 -> F32 (rounded to nearest),
  //   F32 -> BF16 (rounded to nearest even).
  // Any other pair is an error (unsupported). Missing name: not_found.
  Status read_into(const std::string& name, Tensor dst) const;

 private:
  MappedFile file_;
  uint64_t data_start_ = 0;  // 8 + N
  std::vector<SafeTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

struct NamedTensor {
  std::string name;
  Tensor tensor;  // CPU, contiguous
};

// Writes a safetensors file atomically (temp file + rename, see
// write_file_atomic). Tensors are laid out in the given order; the header is
// compact JSON exactly as Python's safetensors writes it ("__metadata__" first,
// then the tensors in layout order, fields dtype, shape, data_offsets), padded
// with spaces to a multiple of 8 bytes. "__metadata__" holds `metadata` with
// "format" set to "pt" (a caller's "format" value is replaced). `mode`: the
// file's permissions (before the umask; 0600 for files only their owner may read); `tidy`:
// as write_file_atomic's.
// Errors: invalid_argument (empty, duplicate or reserved names, invalid UTF-8,
// a tensor that is not CPU/contiguous), io_error / not_found (the file).
Status safetensors_write(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata, unsigned mode = 0666,
                         bool tidy = true);

}  // namespace laplace
