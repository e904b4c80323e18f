// Communicator: the collectives distributed training needs (docs/distributed.md),
// over raw typed host buffers, with an MPI implementation (distributed/comm_mpi.cpp, Open MPI
// on CPUs; a stub that says so when the build has no MPI) and a single-process one
// (P = 1) used when the program was not started by mpirun.
//
// Determinism: the primitives that only MOVE bytes (all_gather, all_to_all, broadcast)
// map onto the engine's own collectives. The REDUCTIONS (reduce_scatter, all_reduce)
// are implemented here on top of all_to_all / all_gather and sum the contributions on
// the receiving rank in rank order 0, 1, …, P−1 (acc = c₀; acc += c₁; …), so results are
// bitwise reproducible and independent of the engine's algorithm choice. On one rank a
// reduce_scatter exchanges nothing: its one part is added where it lies (the same bits).
//
// Traffic accounting: every call adds to stats() the payload this rank addresses to,
// and receives from, OTHER ranks at the API level (self-copies excluded), whatever
// route the engine takes internally: all_gather sends counts[me]·(P−1) and receives
// Σ_{q≠me} counts[q]; all_to_all sends Σ_{q≠me} send_counts[q] and receives
// Σ_{q≠me} recv_counts[q]; broadcast sends count·(P−1) at the root and receives count
// elsewhere. These are the quantities the Muon traffic formula (distributed/plan.h) predicts.
//
// Counts and offsets are in ELEMENTS of the given type. Buffers are host memory, except
// for the NCCL communicator (distributed/nccl/), which also takes device memory: device
// buffers go through NCCL on the stream given to use_stream(), host buffers through
// MPI. One call's buffers are all on the same side.
// Every rank must call every collective in the same order with consistent counts
// (derive them from global shapes, never from a rank's own possibly empty shard).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace laplace {

enum class CommType { kF32, kF64, kBF16, kI64 };  // kBF16: raw uint16 bf16 bits

size_t comm_type_size(CommType t);
const char* comm_type_name(CommType t);

struct CommStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t calls = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;

  // recv[displs[q] .. displs[q] + counts[q]) ← rank q's `send` (counts[q] elements),
  // for every q (including this rank). counts/displs have size() entries.
  void all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                  const std::vector<int64_t>& displs, CommType t);
  // Rank q receives send[send_displs[q] .. + send_counts[q]) into its
  // recv[recv_displs[me] .. + recv_counts[me]). A peer with count 0 is skipped.
  void all_to_all(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                  void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                  CommType t);
  // buf (count elements) on every rank ← root's buf.
  void broadcast(void* buf, int64_t count, int root, CommType t);
  void barrier();

  // `send` holds Σ counts elements, rank q's part at the prefix offset of counts;
  // recv (counts[me] elements) = Σ_q (rank q's part for me), summed in rank order.
  // F32/F64/I64 add in their own type; BF16 accumulates in F32 and rounds once.
  // With accumulate, recv = recv + (that sum): the sum first, then one add.
  void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& counts, CommType t,
                      bool accumulate = false);
  // buf ← Σ_q rank q's buf, summed in rank order; identical bits on every rank.
  void all_reduce(void* buf, int64_t count, CommType t);

  // Device collectives are queued on this CUDA stream (the backend's, so they order
  // with compute without host synchronisation). Host-only communicators ignore it.
  virtual void use_stream(void* cuda_stream) {}

  // Overlap with compute (device communicators; no-ops for host ones, whose collectives
  // finish before they return). Between overlap_begin() and overlap_end() device
  // collectives run on the communicator's own stream, beside the compute stream given to
  // use_stream(), and are ordered against it only by these calls:
  //   overlap_begin()   collectives queued from now on start after all compute queued so far
  //   after_compute()   the same, inside the region
  //   mark()            names the collectives queued so far
  //   compute_wait(m)   compute queued from now on waits for the collectives of mark m
  //   overlap_end()     compute waits for every collective; back to the compute stream
  // A mark is valid for the next 1024 marks.
  virtual void overlap_begin() {}
  virtual void after_compute() {}
  virtual int64_t mark() { return 0; }
  virtual void compute_wait(int64_t mark) {}
  virtual void overlap_end() {}

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }

 protected:
  virtual void do_all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                             const std::vector<int64_t>& displs, CommType t) = 0;
  virtual void do_all_to_all(const void* send, const std::vector<int64_t>& send_counts,
                             const std::vector<int64_t>& send_displs, void* recv,
                             const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                             CommType t) = 0;
  virtual void do_broadcast(void* buf, int64_t count, int root, CommType t) = 0;
  virtual void do_barrier() = 0;
  // The reductions' staging: a buffer for P parts on the same side as `like` (the
  // caller's buffer), and their rank-order sum into `out`. Host by default; the NCCL
  // communicator stages device buffers on the device and sums them with a kernel that
  // follows the same order and rounding.
  virtual void* reduction_scratch(size_t bytes, const void* like);
  virtual void sum_parts(const void* parts, int P, int64_t n, void* out, CommType t, bool accumulate);

 private:
  CommStats stats_;
  std::vector<char> host_scratch_;
};

// P = 1: every collective is a local copy.
class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* name() const override { return "single"; }

 protected:
  void do_all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                     const std::vector<int64_t>& displs, CommType t) override;
  void do_all_to_all(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                     void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                     CommType t) override;
  void do_broadcast(void*, int64_t, int, CommType) override {}
  void do_barrier() override {}
};

// True when this process was started by an MPI launcher (mpirun/mpiexec/srun with PMI):
// Open MPI's OMPI_COMM_WORLD_SIZE, PMIx's PMIX_RANK or PMI_SIZE is set.
bool launched_by_mpi();

// MPI communicator over MPI_COMM_WORLD; initialises MPI (MPI_Init_thread) on first use
// and finalises it when the communicator is destroyed. In builds without MPI this
// returns unsupported with a message saying so.
Status make_mpi_communicator(std::unique_ptr<Communicator>* out);
// MPI when launched_by_mpi(), else SingleCommunicator.
Status make_communicator(std::unique_ptr<Communicator>* out);
// True when this build has the MPI implementation.
bool mpi_available();

// NCCL communicator for one rank per GPU (distributed/nccl/comm_nccl.cpp): under an MPI launcher
// it selects GPU (local rank mod visible GPUs) — call it BEFORE creating the CUDA
// backend — and bootstraps NCCL over MPI, which also carries host-buffer collectives;
// without a launcher it is a one-rank NCCL communicator. Unsupported (with the reason)
// in builds without CUDA or NCCL, or when no GPU is visible.
Status make_nccl_communicator(std::unique_ptr<Communicator>* out);
// True when this build has the NCCL implementation.
bool nccl_available();

// Every rank's `value`, in rank order (one all_gather of one element each). Collective.
std::vector<int64_t> all_gather_value(Communicator& comm, int64_t value);

// Every rank passes its own status; returns ok only if all are ok, else the first
// failing rank's status on that rank and "rank k failed" on the others. Collective.
Status agree_status(Communicator& comm, const Status& local);

}  // namespace laplace
