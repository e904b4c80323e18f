// Status: the result of an operation that can fail for expected reasons (bad files,
// bad configs, bad requests). Programming errors use LAPLACE_CHECK instead.
#pragma once

#include <string>
#include <utility>

namespace laplace {

// [[nodiscard]]: every function returning a Status is checked, so a failure is never dropped
// by accident; where ignoring one is right, the call says so with (void) and a comment.
class [[nodiscard]] Status {
 public:
  enum class Code { kOk = 0, kInvalidArgument, kNotFound, kIoError, kCorrupt, kUnsupported, kOutOfMemory, kConflict };

  Status() = default;
  static Status ok() { return Status(); }
  static Status invalid_argument(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }
  static Status not_found(std::string msg) { return Status(Code::kNotFound, std::move(msg)); }
  static Status io_error(std::string msg) { return Status(Code::kIoError, std::move(msg)); }
  static Status corrupt(std::string msg) { return Status(Code::kCorrupt, std::move(msg)); }
  static Status unsupported(std::string msg) { return Status(Code::kUnsupported, std::move(msg)); }
  static Status out_of_memory(std::string msg) { return Status(Code::kOutOfMemory, std::move(msg)); }
  // What was to be changed changed meanwhile (another writer got there first).
  static Status conflict(std::string msg) { return Status(Code::kConflict, std::move(msg)); }

  bool is_ok() const { return code_ == Code::kOk; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  // "corrupt: model.safetensors: header length 99999999999 exceeds file size 1024"
  std::string to_string() const;

  // Prefixes the message with context ("loading ckpt.safetensors: ...").
  Status with_context(const std::string& ctx) const {
    return is_ok() ? *this : Status(code_, ctx + ": " + msg_);
  }

 private:
  Status(Code c, std::string m) : code_(c), msg_(std::move(m)) {}
  Code code_ = Code::kOk;
  std::string msg_;
};

}  // namespace laplace

// Propagate a failed Status to the caller.
#define LAPLACE_RETURN_IF_ERROR(expr)             \
  do {                                            \
    ::laplace::Status _st = (expr);               \
    if (!_st.is_ok()) return _st;                 \
  } while (0)
