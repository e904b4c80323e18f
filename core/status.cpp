#include "core/check.h"
#include "core/status.h"

namespace laplace {

std::string Status::to_string() const {
  const char* name = "ok";
  switch (code_) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: name = "invalid argument"; break;
    case Code::kNotFound: name = "not found"; break;
    case Code::kIoError: name = "I/O error"; break;
    case Code::kCorrupt: name = "corrupt"; break;
    case Code::kUnsupported: name = "unsupported"; break;
    case Code::kOutOfMemory: name = "out of memory"; break;
    case Code::kConflict: name = "conflict"; break;
  }
  return std::string(name) + ": " + msg_;
}

void check_failed(const char* file, int line, const char* expr, const char* msg) {
  std::fprintf(stderr, "laplace: internal check failed at %s:%d: %s (%s)\n", file, line, expr, msg);
  std::fflush(stderr);
  std::abort();
}

}  // namespace laplace
