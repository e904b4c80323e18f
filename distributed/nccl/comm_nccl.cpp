// The NCCL Communicator: one rank per GPU (distributed/comm.h).
//
// Device buffers travel through NCCL, queued on the stream set by use_stream() (the
// CUDA backend's), so a training step orders its collectives with its kernels and never
// waits on the host. Only byte moves go to NCCL — grouped ncclSend/ncclRecv for
// all_gather and all_to_all (uneven per-peer counts; NCCL's own AllGather needs equal
// ones) and ncclBroadcast — and the reductions are the base class's: parts staged on the
// device, then summed by a kernel in rank order (distributed/nccl/rank_sum.cu), so results are
// bitwise the same whatever algorithm or topology NCCL picks, and equal to a one-rank run
// that adds the same parts in the same order.
//
// Host buffers (scalars: losses, plan hashes, norm partials, status flags) go to the
// host communicator this one wraps: MPI under mpirun, which also bootstraps NCCL by
// broadcasting rank 0's ncclUniqueId; a SingleCommunicator for one process.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.h"
#include "distributed/comm.h"
#include "distributed/nccl/rank_sum.h"

namespace laplace {

namespace {

#define NCCL_CHECK(call)                                                                                  \
  do {                                                                                                    \
    const ncclResult_t r_ = (call);                                                                       \
    if (r_ != ncclSuccess)                                                                                \
      ::laplace::check_failed(__FILE__, __LINE__, #call,                                                  \
                              (std::string("NCCL: ") + ncclGetErrorString(r_) +                           \
                               " (set NCCL_DEBUG=INFO for NCCL's own log)")                               \
                                  .c_str());                                                              \
  } while (0)

#define CUDART_CHECK(call)                                                                                \
  do {                                                                                                    \
    const cudaError_t e_ = (call);                                                                        \
    if (e_ != cudaSuccess)                                                                                \
      ::laplace::check_failed(__FILE__, __LINE__, #call, cudaGetErrorString(e_));                         \
  } while (0)

static_assert(static_cast<int>(CommType::kF32) == 0 && static_cast<int>(CommType::kF64) == 1 &&
                  static_cast<int>(CommType::kBF16) == 2 && static_cast<int>(CommType::kI64) == 3,
              "rank_sum_launch takes CommType values as plain ints");

// Which GPU this process drives: its rank among the processes of its host.
int local_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMIX_LOCAL_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

// True for memory the device can address as its own (device or managed).
bool is_device_ptr(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // unregistered host memory on old runtimes
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::unique_ptr<Communicator> host, int device) : host_(std::move(host)), device_(device) {}
  ~NcclCommunicator() override {
    // The borrowed stream may already be gone with its backend: wait on the device instead.
    cudaDeviceSynchronize();
    if (comm_) ncclCommDestroy(comm_);
    if (scratch_) cudaFree(scratch_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (own_stream_) cudaStreamDestroy(own_stream_);
  }

  Status init() {
    CUDART_CHECK(cudaSetDevice(device_));
    CUDART_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    stream_ = compute_ = own_stream_;
    events_.resize(kEvents + 1);  // a ring for mark(), plus one for after_compute()
    for (cudaEvent_t& e : events_) CUDART_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ncclUniqueId id{};
    if (host_->rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    static_assert(sizeof(id) % 8 == 0, "ncclUniqueId is a whole number of 8-byte words");
    host_->broadcast(&id, sizeof(id) / 8, 0, CommType::kI64);
    const ncclResult_t r = ncclCommInitRank(&comm_, host_->size(), id, host_->rank());
    if (r != ncclSuccess) {
      comm_ = nullptr;
      return Status::io_error(std::string("ncclCommInitRank failed on rank ") + std::to_string(host_->rank()) +
                              ": " + ncclGetErrorString(r) + " (set NCCL_DEBUG=INFO for NCCL's own log)");
    }
    return Status::ok();
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  const char* name() const override { return host_->size() > 1 ? "nccl+mpi" : "nccl"; }
  void use_stream(void* s) override {
    LAPLACE_CHECK(stream_ == compute_, "NCCL use_stream: inside an overlap region");
    stream_ = compute_ = s ? static_cast<cudaStream_t>(s) : own_stream_;
  }

  // Overlap: collectives on own_stream_ beside the compute stream (distributed/comm.h).
  void overlap_begin() override {
    if (stream_ != compute_ || compute_ == own_stream_) return;
    stream_ = own_stream_;
    after_compute();
  }
  void after_compute() override {
    if (stream_ == compute_) return;
    CUDART_CHECK(cudaEventRecord(events_[kEvents], compute_));
    CUDART_CHECK(cudaStreamWaitEvent(stream_, events_[kEvents], 0));
  }
  int64_t mark() override {
    const int64_t m = next_mark_++;
    if (stream_ != compute_) CUDART_CHECK(cudaEventRecord(events_[m % kEvents], stream_));
    return m;
  }
  void compute_wait(int64_t m) override {
    if (stream_ == compute_) return;
    LAPLACE_CHECK(m >= 0 && m < next_mark_ && next_mark_ - m <= kEvents, "NCCL compute_wait: stale or unknown mark");
    CUDART_CHECK(cudaStreamWaitEvent(compute_, events_[m % kEvents], 0));
  }
  void overlap_end() override {
    if (stream_ == compute_) return;
    compute_wait(mark());
    stream_ = compute_;
  }

 protected:
  void do_all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                     const std::vector<int64_t>& displs, CommType t) override {
    if (!on_device(send, recv, "all_gather")) return host_->all_gather(send, recv, counts, displs, t);
    const size_t es = comm_type_size(t);
    const int me = rank(), P = size();
    char* r = static_cast<char*>(recv);
    if (counts[me] > 0 && r + displs[me] * es != send)
      CUDART_CHECK(cudaMemcpyAsync(r + displs[me] * es, send, counts[me] * es, cudaMemcpyDeviceToDevice, stream_));
    NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < P; ++q) {
      if (q == me) continue;
      if (counts[me] > 0) NCCL_CHECK(ncclSend(send, counts[me] * es, ncclInt8, q, comm_, stream_));
      if (counts[q] > 0) NCCL_CHECK(ncclRecv(r + displs[q] * es, counts[q] * es, ncclInt8, q, comm_, stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
  }

  void do_all_to_all(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                     void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                     CommType t) override {
    if (!on_device(send, recv, "all_to_all"))
      return host_->all_to_all(send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
    const size_t es = comm_type_size(t);
    const int me = rank(), P = size();
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    LAPLACE_CHECK(send_counts[me] == recv_counts[me], "all_to_all: send and receive counts to self differ");
    if (send_counts[me] > 0)
      CUDART_CHECK(cudaMemcpyAsync(r + recv_displs[me] * es, s + send_displs[me] * es, send_counts[me] * es,
                                   cudaMemcpyDeviceToDevice, stream_));
    NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < P; ++q) {
      if (q == me) continue;
      if (send_counts[q] > 0)
        NCCL_CHECK(ncclSend(s + send_displs[q] * es, send_counts[q] * es, ncclInt8, q, comm_, stream_));
      if (recv_counts[q] > 0)
        NCCL_CHECK(ncclRecv(r + recv_displs[q] * es, recv_counts[q] * es, ncclInt8, q, comm_, stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
  }

  void do_broadcast(void* buf, int64_t count, int root, CommType t) override {
    if (!on_device(buf, nullptr, "broadcast")) return host_->broadcast(buf, count, root, t);
    if (count == 0 || size() == 1) return;
    NCCL_CHECK(ncclBroadcast(buf, buf, count * comm_type_size(t), ncclInt8, root, comm_, stream_));
  }

  // All device work queued so far is done, on every rank.
  void do_barrier() override {
    CUDART_CHECK(cudaStreamSynchronize(stream_));
    host_->barrier();
  }

  void* reduction_scratch(size_t bytes, const void* like) override {
    if (!is_device_ptr(like)) return Communicator::reduction_scratch(bytes, like);
    if (bytes > scratch_bytes_) {
      // Growing waits for queued users of the old buffer (all on the current stream);
      // sized by the largest parameter, so this happens in the first step only.
      if (scratch_) {
        CUDART_CHECK(cudaStreamSynchronize(stream_));
        CUDART_CHECK(cudaFree(scratch_));
      }
      CUDART_CHECK(cudaMalloc(&scratch_, bytes));
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  void sum_parts(const void* parts, int P, int64_t n, void* out, CommType t, bool accumulate) override {
    if (!is_device_ptr(parts)) return Communicator::sum_parts(parts, P, n, out, t, accumulate);
    const cudaError_t e = rank_sum_launch(parts, P, n, out, static_cast<int>(t), accumulate, stream_);
    if (e != cudaSuccess) check_failed(__FILE__, __LINE__, "rank_sum_launch", cudaGetErrorString(e));
  }

 private:
  // Whether a call's buffers are on the device. A null pointer (an empty shard) takes
  // the other one's side; one call never mixes host and device buffers.
  bool on_device(const void* a, const void* b, const char* what) const {
    const bool da = is_device_ptr(a), db = is_device_ptr(b);
    const bool ha = a && !da, hb = b && !db;
    LAPLACE_CHECK(!((da || db) && (ha || hb)),
                  (std::string("NCCL ") + what + ": host and device buffers mixed in one call").c_str());
    return da || db;
  }

  std::unique_ptr<Communicator> host_;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  static constexpr int64_t kEvents = 1024;
  cudaStream_t own_stream_ = nullptr;  // the side stream (and the stream when no backend gave one)
  cudaStream_t compute_ = nullptr;     // the backend's stream (use_stream)
  cudaStream_t stream_ = nullptr;      // where collectives go now: compute_, or own_stream_ in an overlap region
  std::vector<cudaEvent_t> events_;
  int64_t next_mark_ = 0;
  void* scratch_ = nullptr;  // device staging of the reductions' parts [P, n]
  size_t scratch_bytes_ = 0;
};

}  // namespace

bool nccl_available() { return true; }

Status make_nccl_communicator(std::unique_ptr<Communicator>* out) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    return Status::unsupported(std::string("NCCL needs a GPU, and none is visible") +
                               (e != cudaSuccess ? std::string(" (") + cudaGetErrorString(e) + ")" : ""));
  // NVLink multicast (NVLS) speeds up NCCL's all-reduce; we use only send/recv and
  // broadcast, so it buys nothing and costs its buffers. Off unless the user says otherwise.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::unique_ptr<Communicator> host;
  if (launched_by_mpi()) LAPLACE_RETURN_IF_ERROR(make_mpi_communicator(&host));
  else host = std::make_unique<SingleCommunicator>();
  const int lr = local_rank();
  if (lr >= n)
    std::fprintf(stderr,
                 "laplace: rank %d is local rank %d but only %d GPU(s) are visible; ranks will share GPUs, which NCCL "
                 "refuses: start at most one rank per GPU\n",
                 host->rank(), lr, n);
  auto c = std::make_unique<NcclCommunicator>(std::move(host), lr % n);
  LAPLACE_RETURN_IF_ERROR(c->init());
  *out = std::move(c);
  return Status::ok();
}

}  // namespace laplace
