// cupti_trace: a kernel and copy timeline of any CUDA program, for machines without Nsight
// Systems (the lent H200 has ncu but no nsys). Built as a shared library and loaded by the
// CUDA driver through its injection hook, so the program is not rebuilt or changed:
//
//   g++ -O2 -shared -fPIC -I$CUDA/include experiments/trace/cupti_trace.cpp -L<dir of libcupti> -lcupti
//       -o build-gpu/libcupti_trace.so        (or the CMake target cupti_trace, -DLAPLACE_EXPERIMENTS=ON)
//   CUDA_INJECTION64_PATH=$PWD/build-gpu/libcupti_trace.so CUPTI_TRACE_OUT=trace.csv ./prog …
//   python3 scripts/trace_step.py trace.csv --steps 8
//
// It records every kernel (each node of a replayed CUDA graph is its own record) and every
// copy with its GPU start and end, and writes them at exit as CSV with the column names of
// `nsys stats --report cuda_gpu_trace` that scripts/trace_step.py reads. Activity tracing
// adds a little to each launch, so read gaps against the same program's untraced step time.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Event {
  uint64_t start, end;
  std::string name;
};

std::mutex mu;
std::vector<Event>* events = nullptr;  // leaked on purpose: written from an atexit handler
constexpr size_t kBufBytes = 8u << 20;

#define CUPTI_OK(call)                                                                          \
  do {                                                                                          \
    CUptiResult r_ = (call);                                                                    \
    if (r_ != CUPTI_SUCCESS) {                                                                  \
      const char* s_ = nullptr;                                                                 \
      cuptiGetResultString(r_, &s_);                                                            \
      std::fprintf(stderr, "cupti_trace: %s failed at %s:%d: %s\n", #call, __FILE__, __LINE__, \
                   s_ ? s_ : "?");                                                              \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)

std::string demangle(const char* n) {
  if (!n) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(n, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : n;
  std::free(d);
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, kBufBytes));
  *size = kBufBytes;
  *max_records = 0;
}

const char* copy_name(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "[CUDA memcpy Host-to-Device]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "[CUDA memcpy Device-to-Host]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "[CUDA memcpy Device-to-Device]";
    default: return "[CUDA memcpy]";
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      events->push_back({k->start, k->end, demangle(k->name)});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      events->push_back({m->start, m->end, copy_name(m->copyKind)});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      events->push_back({m->start, m->end, "[CUDA memset " + std::to_string(m->bytes) + " B]"});
    }
  }
  std::free(buf);
}

void write_trace() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* path = std::getenv("CUPTI_TRACE_OUT");
  std::FILE* f = std::fopen(path ? path : "cupti_trace.csv", "w");
  if (!f) {
    std::perror("cupti_trace: cannot write the trace");
    return;
  }
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(f, "Start (ns),Duration (ns),Name\n");
  for (const Event& e : *events) {
    std::string n = e.name;
    for (char& c : n)
      if (c == ',' || c == '"') c = ' ';  // one CSV field, no quoting needed
    std::fprintf(f, "%llu,%llu,%s\n", static_cast<unsigned long long>(e.start),
                 static_cast<unsigned long long>(e.end - e.start), n.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "cupti_trace: %zu events written to %s\n", events->size(), path ? path : "cupti_trace.csv");
}

}  // namespace

// Called by the CUDA driver at initialisation when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection(void) {
  events = new std::vector<Event>();
  events->reserve(1 << 20);
  CUPTI_OK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  CUPTI_OK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  CUPTI_OK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  CUPTI_OK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  std::atexit(write_trace);
  return 1;
}
