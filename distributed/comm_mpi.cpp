// The MPI Communicator (Open MPI on CPUs). Compiled with MPI when CMake found it
// (LAPLACE_HAVE_MPI); otherwise make_mpi_communicator reports that this build has none.
// Only byte-moving collectives go to MPI (Allgatherv, Alltoallv, Bcast: exact copies);
// reductions are done by the base class in a fixed rank order (distributed/comm.h).
#include "distributed/comm.h"

#include <climits>
#include <cstdio>

#include "core/check.h"

#ifdef LAPLACE_HAVE_MPI
#include <mpi.h>
#endif

namespace laplace {

#ifdef LAPLACE_HAVE_MPI

namespace {

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::kF32: return MPI_FLOAT;
    case CommType::kF64: return MPI_DOUBLE;
    case CommType::kBF16: return MPI_UINT16_T;
    case CommType::kI64: return MPI_INT64_T;
  }
  return MPI_BYTE;
}

std::vector<int> to_int(const std::vector<int64_t>& v, const char* what) {
  std::vector<int> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    LAPLACE_CHECK(v[i] >= 0 && v[i] <= INT_MAX, what);
    r[i] = static_cast<int>(v[i]);
  }
  return r;
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      owns_ = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "mpi"; }

 protected:
  void do_all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                     const std::vector<int64_t>& displs, CommType t) override {
    const char* what = "MPI all_gather: counts and offsets must fit an int (split the call)";
    std::vector<int> c = to_int(counts, what), d = to_int(displs, what);
    MPI_Allgatherv(send, c[rank_], mpi_type(t), recv, c.data(), d.data(), mpi_type(t), MPI_COMM_WORLD);
  }
  void do_all_to_all(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                     void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                     CommType t) override {
    const char* what = "MPI all_to_all: counts and offsets must fit an int (split the call)";
    std::vector<int> sc = to_int(send_counts, what), sd = to_int(send_displs, what);
    std::vector<int> rc = to_int(recv_counts, what), rd = to_int(recv_displs, what);
    MPI_Alltoallv(send, sc.data(), sd.data(), mpi_type(t), recv, rc.data(), rd.data(), mpi_type(t), MPI_COMM_WORLD);
  }
  void do_broadcast(void* buf, int64_t count, int root, CommType t) override {
    const int64_t chunk = int64_t{1} << 30;
    char* p = static_cast<char*>(buf);
    for (int64_t off = 0; off < count; off += chunk) {
      const int64_t n = std::min(chunk, count - off);
      MPI_Bcast(p + off * static_cast<int64_t>(comm_type_size(t)), static_cast<int>(n), mpi_type(t), root,
                MPI_COMM_WORLD);
    }
  }
  void do_barrier() override { MPI_Barrier(MPI_COMM_WORLD); }

 private:
  int rank_ = 0, size_ = 1;
  bool owns_ = false;
};

}  // namespace

bool mpi_available() { return true; }

Status make_mpi_communicator(std::unique_ptr<Communicator>* out) {
  *out = std::make_unique<MpiCommunicator>();
  return Status::ok();
}


#else  // no MPI in this build

bool mpi_available() { return false; }

Status make_mpi_communicator(std::unique_ptr<Communicator>* out) {
  return Status::unsupported(
      "this laplace was built without MPI (CMake found no MPI; install libopenmpi-dev and rebuild), "
      "so it cannot run under mpirun");
}


#endif

}  // namespace laplace
