#include "core/safetensors.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <new>
#include <set>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace laplace {

namespace {

using json = nlohmann::json;

// Thrown from the parser callback to stop parsing a header that is nested
// deeper than any safetensors header can be (see parse_header).
struct HeaderTooDeep {};

std::string shape_to_string(const int64_t* dims, size_t nd, DType dt) {
  std::string s = "[";
  for (size_t i = 0; i < nd; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  s += "] ";
  s += dtype_name(dt);
  return s;
}

// Copies text from a file into an error message: control bytes (and, unless
// keep_utf8, every non-ASCII byte: the text may be invalid UTF-8) become \xNN,
// so that a message never carries terminal escapes or broken encoding.
std::string printable(std::string_view s, bool keep_utf8) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f || (c >= 0x80 && !keep_utf8)) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

// Quotes a name (valid UTF-8: it came through the JSON parser) for an error
// message; keeps messages bounded even for a multi-megabyte garbage key.
std::string quoted(const std::string& name) {
  constexpr size_t kMax = 200;
  if (name.size() <= kMax) return "'" + printable(name, true) + "'";
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xc0) == 0x80) --cut;  // whole characters only
  return "'" + printable(std::string_view(name).substr(0, cut), true) + "...' (" + std::to_string(name.size()) +
         " bytes)";
}

// A non-negative JSON integer as u64. Floats (even 3.0), negatives, strings,
// etc. are rejected: offsets and dimensions must be exact integers.
bool get_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    int64_t x = v.get<int64_t>();
    if (x < 0) return false;
    *out = static_cast<uint64_t>(x);
    return true;
  }
  return false;
}

// Parses the header bytes into *out. Rejects, besides malformed JSON:
//  - duplicate keys in any object: nlohmann keeps the last one silently, which
//    would hide a duplicated tensor name (two tensors claiming one name);
//  - nesting deeper than header -> entry -> shape/data_offsets: no valid header
//    nests deeper, and refusing early bounds the parse's memory and time.
Status parse_header(const std::string& path, const char* begin, const char* end, json* out) {
  // keys_at[d]: the keys seen so far in the object whose members sit at depth d.
  std::array<std::set<std::string>, 4> keys_at;
  std::string duplicate;
  // JSON never holds a raw NUL (inside strings it must be escaped), but the
  // parser would take one as the end of the input and ignore what follows.
  if (const void* nul = std::memchr(begin, 0, static_cast<size_t>(end - begin))) {
    return Status::corrupt(path + ": header is not valid JSON: raw NUL byte at offset " +
                           std::to_string(static_cast<const char*>(nul) - begin));
  }
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) -> bool {
    if (ev == json::parse_event_t::object_start || ev == json::parse_event_t::array_start) {
      // Depth 0: the header; 1: a tensor entry or __metadata__; 2: shape / data_offsets.
      if (depth >= 3) throw HeaderTooDeep{};
      if (ev == json::parse_event_t::object_start) keys_at[static_cast<size_t>(depth) + 1].clear();
    } else if (ev == json::parse_event_t::key && depth >= 1 && depth <= 3) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys_at[static_cast<size_t>(depth)].insert(k).second && duplicate.empty()) {
        duplicate = k.empty() ? std::string("''") : quoted(k);
      }
    }
    return true;
  };
  try {
    *out = json::parse(begin, end, cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const HeaderTooDeep&) {
    return Status::corrupt(path + ": header JSON is nested deeper than a safetensors header can be");
  } catch (const json::exception& e) {
    // nlohmann quotes the last token read, which may be huge; keep the message short.
    std::string what = printable(e.what(), false);
    if (what.size() > 300) what = what.substr(0, 300) + "...";
    return Status::corrupt(path + ": header is not valid JSON: " + what);
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory(path + ": out of memory while parsing the header");
  }
  if (!duplicate.empty()) {
    return Status::corrupt(path + ": duplicate key " + duplicate + " in the header");
  }
  return Status::ok();
}

// Validates one tensor entry of the header and fills *info (all but begin/end
// bounds against the data section, which the caller checks).
Status parse_entry(const std::string& path, const std::string& name, const json& v, SafeTensorInfo* info) {
  const std::string where = path + ": tensor " + quoted(name) + ": ";
  if (!v.is_object()) return Status::corrupt(where + "entry must be an object, got " + v.type_name());
  info->name = name;

  // dtype: one of the names we know; anything else cannot be sized or read.
  auto it = v.find("dtype");
  if (it == v.end()) return Status::corrupt(where + "missing \"dtype\"");
  if (!it->is_string()) return Status::corrupt(where + "\"dtype\" must be a string, got " + it->type_name());
  const std::string& dt = it->get_ref<const std::string&>();
  if (!dtype_from_name(dt, &info->dtype)) return Status::corrupt(where + "unknown dtype " + quoted(dt));

  // shape: non-negative integers whose product fits in int64 (Tensor::numel).
  it = v.find("shape");
  if (it == v.end()) return Status::corrupt(where + "missing \"shape\"");
  if (!it->is_array()) return Status::corrupt(where + "\"shape\" must be an array, got " + it->type_name());
  info->shape.clear();
  for (const json& d : *it) {
    if (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0) {
      return Status::corrupt(where + "negative dimension " + std::to_string(d.get<int64_t>()) + " in \"shape\"");
    }
    uint64_t u;
    if (!get_u64(d, &u)) return Status::corrupt(where + "\"shape\" must hold integers, got " + d.type_name());
    if (u > static_cast<uint64_t>(INT64_MAX)) return Status::corrupt(where + "dimension in \"shape\" overflows int64");
    info->shape.push_back(static_cast<int64_t>(u));
  }
  // The product must not wrap: a wrapped count could match a tiny byte range.
  // Zero dimensions are skipped in the check, so that even an empty tensor has
  // a product of its other dimensions that fits in int64: Tensor computes
  // strides and numel() left to right, and [0, 2^62, 4] would overflow there.
  int64_t nonzero = 1;
  bool has_zero = false;
  for (int64_t d : info->shape) {
    if (d == 0) {
      has_zero = true;
    } else if (__builtin_mul_overflow(nonzero, d, &nonzero)) {
      return Status::corrupt(where + "element count of \"shape\" overflows 64 bits");
    }
  }
  const int64_t numel = has_zero ? 0 : nonzero;
  uint64_t need;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(dtype_size(info->dtype)), &need)) {
    return Status::corrupt(where + "byte size of \"shape\" overflows 64 bits");
  }

  // data_offsets: exactly [begin, end], integers, begin <= end.
  it = v.find("data_offsets");
  if (it == v.end()) return Status::corrupt(where + "missing \"data_offsets\"");
  if (!it->is_array() || it->size() != 2 || !get_u64((*it)[0], &info->begin) || !get_u64((*it)[1], &info->end)) {
    return Status::corrupt(where + "\"data_offsets\" must be two non-negative integers [begin, end]");
  }
  if (info->begin > info->end) {
    return Status::corrupt(where + "\"data_offsets\" [" + std::to_string(info->begin) + ", " +
                           std::to_string(info->end) + "] are decreasing");
  }
  // The byte range must hold exactly the tensor: no more (hidden data), no less
  // (reads past the tensor).
  if (info->end - info->begin != need) {
    return Status::corrupt(where + "\"data_offsets\" cover " + std::to_string(info->end - info->begin) +
                           " bytes but " + info->shape_str() + " needs " + std::to_string(need));
  }
  // Our Tensor holds at most kMaxDims dimensions; refuse here rather than fail later.
  if (info->shape.size() > static_cast<size_t>(kMaxDims)) {
    return Status::unsupported(where + "has " + std::to_string(info->shape.size()) + " dimensions; at most " +
                               std::to_string(kMaxDims) + " are supported");
  }
  return Status::ok();
}

}  // namespace

int64_t SafeTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated on open: no overflow
  return n;
}

std::string SafeTensorInfo::shape_str() const { return shape_to_string(shape.data(), shape.size(), dtype); }

Status SafeTensorsReader::open(const std::string& path, SafeTensorsReader* out) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(MappedFile::open(path, &r.file_));
  const uint64_t size = r.file_.size();
  const uint8_t* p = r.file_.data();

  // The 8-byte length field must be there before anything can be read.
  if (size < 8) {
    return Status::corrupt(path + ": file is " + std::to_string(size) +
                           " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(p[i]) << (8 * i);  // little-endian on any host
  // Even an empty file set has a header ("{}"); 0 means a zeroed or foreign file.
  if (n == 0) return Status::corrupt(path + ": header length is 0 (empty header)");
  // Same limit as the reference implementation; a larger value is a corrupt length.
  if (n > kSafeTensorsMaxHeader) {
    return Status::corrupt(path + ": header length " + std::to_string(n) + " exceeds the limit of " +
                           std::to_string(kSafeTensorsMaxHeader) + " bytes");
  }
  // Written as a subtraction: 8 + n cannot overflow here, but this form never can.
  if (n > size - 8) {
    return Status::corrupt(path + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                           std::to_string(size) + " bytes)");
  }
  r.data_start_ = 8 + n;
  const uint64_t data_size = size - r.data_start_;

  json header;
  const char* hb = reinterpret_cast<const char*>(p + 8);
  LAPLACE_RETURN_IF_ERROR(parse_header(path, hb, hb + n, &header));
  if (!header.is_object()) {
    return Status::corrupt(path + ": header is not a JSON object (it is " + std::string(header.type_name()) + ")");
  }

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      // Free-form string -> string map; other types are not part of the format.
      if (!value.is_object()) {
        return Status::corrupt(path + ": __metadata__ must be an object of strings, got " + value.type_name());
      }
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return Status::corrupt(path + ": __metadata__ value for key " + quoted(mk) + " must be a string, got " +
                                 mv.type_name());
        }
        r.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    SafeTensorInfo info;
    LAPLACE_RETURN_IF_ERROR(parse_entry(path, key, value, &info));
    // Every byte we will ever touch must lie inside the data section.
    if (info.end > data_size) {
      return Status::corrupt(path + ": tensor " + quoted(key) + ": \"data_offsets\" end " + std::to_string(info.end) +
                             " is past the end of the data section (" + std::to_string(data_size) + " bytes)");
    }
    // (Duplicate names were rejected by parse_header; the index guards anyway.)
    if (!r.index_.emplace(key, r.tensors_.size()).second) {
      return Status::corrupt(path + ": duplicate tensor name " + quoted(key));
    }
    r.tensors_.push_back(std::move(info));
  }

  // The data section must be tiled exactly: tensors back to back from 0 to its
  // end. Overlaps would alias two tensors; gaps and trailing bytes mean a
  // truncated header or hidden data. Both readers and writers rely on this.
  std::sort(r.tensors_.begin(), r.tensors_.end(), [](const SafeTensorInfo& a, const SafeTensorInfo& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  uint64_t cursor = 0;
  const SafeTensorInfo* prev = nullptr;
  for (size_t i = 0; i < r.tensors_.size(); ++i) {
    const SafeTensorInfo& t = r.tensors_[i];
    if (t.begin < cursor) {
      return Status::corrupt(path + ": tensor " + quoted(t.name) + " [" + std::to_string(t.begin) + ", " +
                             std::to_string(t.end) + ") overlaps tensor " + quoted(prev->name) + " [" +
                             std::to_string(prev->begin) + ", " + std::to_string(prev->end) + ")");
    }
    if (t.begin > cursor) {
      return Status::corrupt(path + ": gap before tensor " + quoted(t.name) + ": bytes [" + std::to_string(cursor) +
                             ", " + std::to_string(t.begin) + ") of the data section belong to no tensor");
    }
    cursor = t.end;
    prev = &t;
    r.index_[t.name] = i;
  }
  if (cursor != data_size) {
    return Status::corrupt(path + ": bytes [" + std::to_string(cursor) + ", " + std::to_string(data_size) +
                           ") at the end of the data section belong to no tensor (file size " +
                           std::to_string(size) + ")");
  }
  *out = std::move(r);
  return Status::ok();
}

const SafeTensorInfo* SafeTensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const uint8_t* SafeTensorsReader::bytes(const SafeTensorInfo& info) const {
  // Resolve by name (copies of an info are fine) and insist on the validated
  // entry: an info from another file could point anywhere.
  const SafeTensorInfo* mine = find(info.name);
  LAPLACE_CHECK(mine != nullptr && mine->begin == info.begin && mine->end == info.end && mine->dtype == info.dtype &&
                    mine->shape == info.shape,
                "SafeTensorsReader: the SafeTensorInfo does not come from this reader");
  return file_.data() + data_start_ + mine->begin;
}

Status SafeTensorsReader::view(const SafeTensorInfo& info, Tensor* out) const {
  const uint8_t* b = bytes(info);
  // Typed loads through a misaligned pointer are undefined behaviour (and can
  // fault in vectorised loops); such files must be read with read_into.
  if (reinterpret_cast<uintptr_t>(b) % dtype_size(info.dtype) != 0) {
    return Status::invalid_argument(path() + ": tensor " + quoted(info.name) + " is not aligned for " +
                                    dtype_name(info.dtype) + " in the file; use read_into");
  }
  *out = Tensor::make(const_cast<uint8_t*>(b), info.dtype, info.shape.data(), static_cast<int>(info.shape.size()));
  return Status::ok();
}

Status SafeTensorsReader::read_into(const std::string& name, Tensor dst) const {
  const SafeTensorInfo* info = find(name);
  if (info == nullptr) return Status::not_found(path() + ": no tensor named " + quoted(name));
  LAPLACE_CHECK(dst.device == Device::kCPU, "read_into: dst must be a CPU tensor");
  LAPLACE_CHECK(dst.is_contiguous(), "read_into: dst must be contiguous");

  bool same = dst.ndim == static_cast<int>(info->shape.size());
  for (int i = 0; same && i < dst.ndim; ++i) same = dst.shape[i] == info->shape[i];
  auto mismatch = [&](const std::string& extra) {
    return path() + ": " + name + ": expected shape " +
           shape_to_string(dst.shape.data(), static_cast<size_t>(dst.ndim), dst.dtype) + ", file has " +
           info->shape_str() + extra;
  };
  if (!same) return Status::invalid_argument(mismatch(""));

  const int64_t n = info->numel();
  const uint8_t* src = bytes(*info);
  const DType from = info->dtype, to = dst.dtype;
  if (n > 0) LAPLACE_CHECK(dst.data != nullptr, "read_into: dst has no storage");

  if (from == to) {
    if (n > 0) std::memcpy(dst.data, src, info->nbytes());
    return Status::ok();
  }
  // Element-wise conversions. Sources are read with memcpy: mapped bytes need
  // not be aligned for their dtype.
  auto convert = [&](auto load, auto store) {
    for (int64_t i = 0; i < n; ++i) store(i, load(i));
  };
  auto* d = static_cast<uint8_t*>(dst.data);
  if (from == DType::kBF16 && to == DType::kF32) {
    convert(
        [&](int64_t i) {
          uint16_t h;
          std::memcpy(&h, src + 2 * i, 2);
          return bf16_to_float(h);
        },
        [&](int64_t i, float x) { std::memcpy(d + 4 * i, &x, 4); });
  } else if (from == DType::kF32 && to == DType::kBF16) {
    convert(
        [&](int64_t i) {
          float x;
          std::memcpy(&x, src + 4 * i, 4);
          return x;
        },
        [&](int64_t i, float x) {
          uint16_t h = float_to_bf16(x);
          std::memcpy(d + 2 * i, &h, 2);
        });
  } else if (from == DType::kF32 && to == DType::kF64) {
    convert(
        [&](int64_t i) {
          float x;
          std::memcpy(&x, src + 4 * i, 4);
          return static_cast<double>(x);
        },
        [&](int64_t i, double x) { std::memcpy(d + 8 * i, &x, 8); });
  } else if (from == DType::kF64 && to == DType::kF32) {
    convert(
        [&](int64_t i) {
          double x;
          std::memcpy(&x, src + 8 * i, 8);
          return static_cast<float>(x);
        },
        [&](int64_t i, float x) { std::memcpy(d + 4 * i, &x, 4); });
  } else {
    return Status::unsupported(
        mismatch(" (no conversion from " + std::string(dtype_name(from)) + " to " + dtype_name(to) +
                 "; supported: BF16->F32, F32->BF16, F32->F64, F64->F32)"));
  }
  return Status::ok();
}

Status safetensors_write(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata, unsigned mode, bool tidy) {
  // Validate first so that nothing is written (not even a temp file) for bad input.
  std::set<std::string> names;
  for (const NamedTensor& nt : tensors) {
    const Tensor& t = nt.tensor;
    const std::string where = path + ": tensor " + quoted(nt.name) + ": ";
    if (nt.name.empty()) return Status::invalid_argument(path + ": empty tensor name");
    // The key is reserved for the metadata object.
    if (nt.name == "__metadata__") return Status::invalid_argument(where + "name is reserved");
    if (!names.insert(nt.name).second) return Status::invalid_argument(where + "duplicate tensor name");
    if (t.device != Device::kCPU) return Status::invalid_argument(where + "must be a CPU tensor");
    if (t.ndim < 0 || t.ndim > kMaxDims) return Status::invalid_argument(where + "bad number of dimensions");
    for (int i = 0; i < t.ndim; ++i) {
      if (t.shape[i] < 0) return Status::invalid_argument(where + "negative dimension");
    }
    if (!t.is_contiguous()) return Status::invalid_argument(where + "must be contiguous");
    if (t.numel() > 0 && t.data == nullptr) return Status::invalid_argument(where + "has no data");
  }

  std::map<std::string, std::string> meta = metadata;
  meta["format"] = "pt";

  // Header exactly as the reference (serde) writer prints it: compact JSON,
  // "__metadata__" first, then each tensor as {"dtype","shape","data_offsets"}
  // in layout order.
  std::string header;
  uint64_t offset = 0;
  try {
    header = "{\"__metadata__\":" + json(meta).dump();
    for (const NamedTensor& nt : tensors) {
      const Tensor& t = nt.tensor;
      uint64_t nbytes = static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype);
      header += ",";
      header += json(nt.name).dump();
      header += ":{\"dtype\":\"";
      header += dtype_name(t.dtype);
      header += "\",\"shape\":[";
      for (int i = 0; i < t.ndim; ++i) {
        if (i) header += ",";
        header += std::to_string(t.shape[i]);
      }
      header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + nbytes) + "]}";
      offset += nbytes;
    }
    header += "}";
  } catch (const json::exception& e) {
    // dump() refuses strings that are not valid UTF-8; readers would refuse them too.
    return Status::invalid_argument(path + ": tensor name or metadata is not valid UTF-8 (" + e.what() + ")");
  }
  // Spaces up to a multiple of 8 keep the data section 8-byte aligned in the file.
  header.append((8 - header.size() % 8) % 8, ' ');
  // A reader (ours or the reference) would refuse a larger header.
  if (header.size() > kSafeTensorsMaxHeader) {
    return Status::invalid_argument(path + ": header of " + std::to_string(header.size()) +
                                    " bytes exceeds the safetensors limit");
  }

  return write_file_atomic(path, [&](std::FILE* f) -> Status {
    uint8_t len[8];
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));  // little-endian on any host
    LAPLACE_RETURN_IF_ERROR(write_all(f, len, 8));
    LAPLACE_RETURN_IF_ERROR(write_all(f, header.data(), header.size()));
    for (const NamedTensor& nt : tensors) {
      LAPLACE_RETURN_IF_ERROR(write_all(f, nt.tensor.data, nt.tensor.nbytes()));
    }
    return Status::ok();
  }, mode, tidy);
}

}  // namespace laplace
