#include "core/doc_starts.h"

#include <string>

namespace laplace {

void doc_starts_from_separator(const int32_t* tokens, int64_t B, int64_t T, int32_t separator, int32_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = -1;
    for (int64_t t = 0; t < T; ++t) {
      if (tokens[b * T + t] == separator) start = static_cast<int32_t>(t);
      out[b * T + t] = start;
    }
  }
}

Status doc_starts_from_offsets(std::span<const int64_t> offsets, int64_t T, std::vector<int32_t>* out) {
  if (T < 1 || T > INT32_MAX) return Status::invalid_argument("documents: row length " + std::to_string(T) + " is out of range");
  if (offsets.size() < 2)
    return Status::invalid_argument("documents: need at least two offsets (0 and the row length), got " +
                                    std::to_string(offsets.size()));
  if (offsets.front() != 0)
    return Status::invalid_argument("documents: the first offset must be 0, got " + std::to_string(offsets.front()));
  for (size_t i = 1; i < offsets.size(); ++i) {
    const int64_t a = offsets[i - 1], b = offsets[i];
    if (b > T)
      return Status::invalid_argument("documents: offset " + std::to_string(i) + " = " + std::to_string(b) +
                                      " is past the row's " + std::to_string(T) + " tokens");
    if (b == a)
      return Status::invalid_argument("documents: document " + std::to_string(i - 1) + " is empty (offsets " +
                                      std::to_string(i - 1) + " and " + std::to_string(i) + " are both " +
                                      std::to_string(a) + ")");
    if (b < a)
      return Status::invalid_argument("documents: offset " + std::to_string(i) + " = " + std::to_string(b) +
                                      " is before offset " + std::to_string(i - 1) + " = " + std::to_string(a));
  }
  if (offsets.back() != T)
    return Status::invalid_argument("documents: the last offset must be the row length " + std::to_string(T) +
                                    ", got " + std::to_string(offsets.back()));
  out->assign(static_cast<size_t>(T), 0);
  for (size_t i = 0; i + 1 < offsets.size(); ++i)
    for (int64_t t = offsets[i]; t < offsets[i + 1]; ++t) (*out)[static_cast<size_t>(t)] = static_cast<int32_t>(offsets[i]);
  return Status::ok();
}

Status validate_doc_starts(const int32_t* doc, int64_t B, int64_t T) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t d = doc[b * T + t];
      const bool ok = t == 0 ? (d == -1 || d == 0) : (d == doc[b * T + t - 1] || d == t);
      if (!ok)
        return Status::invalid_argument("documents: row " + std::to_string(b) + ", position " + std::to_string(t) +
                                        ": document start " + std::to_string(d) + " is neither " +
                                        (t == 0 ? std::string("-1 nor 0") :
                                                  "the previous token's (" + std::to_string(doc[b * T + t - 1]) +
                                                      ") nor the position itself"));
    }
  return Status::ok();
}

bool doc_starts_split(const int32_t* doc, int64_t B, int64_t T) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      if (doc[b * T + t] == t) return true;
  return false;
}

}  // namespace laplace
