#include "dist/comm.h"

#include <cstdlib>
#include <cstring>

#include "core/dtype.h"
#include "core/check.h"
#include "core/status.h"

namespace laplace {

size_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::kF32: return 4;
    case CommType::kF64: return 8;
    case CommType::kBF16: return 2;
    case CommType::kI64: return 8;
  }
  return 0;
}

const char* comm_type_name(CommType t) {
  switch (t) {
    case CommType::kF32: return "f32";
    case CommType::kF64: return "f64";
    case CommType::kBF16: return "bf16";
    case CommType::kI64: return "i64";
  }
  return "?";
}

namespace {

void check_sizes(const Communicator& c, const std::vector<int64_t>& v, const char* what) {
  LAPLACE_CHECK(static_cast<int>(v.size()) == c.size(), what);
  for (int64_t x : v) LAPLACE_CHECK(x >= 0, what);
}

// acc (n elements) = Σ_q parts[q·n ..] in rank order: acc = part₀; acc += part₁; …
void sum_in_rank_order(const char* parts, int P, int64_t n, void* acc, CommType t) {
  switch (t) {
    case CommType::kF32: {
      const float* p = reinterpret_cast<const float*>(parts);
      float* a = static_cast<float*>(acc);
      std::memcpy(a, p, static_cast<size_t>(n) * 4);
      for (int q = 1; q < P; ++q)
        for (int64_t i = 0; i < n; ++i) a[i] = a[i] + p[q * n + i];
      break;
    }
    case CommType::kF64: {
      const double* p = reinterpret_cast<const double*>(parts);
      double* a = static_cast<double*>(acc);
      std::memcpy(a, p, static_cast<size_t>(n) * 8);
      for (int q = 1; q < P; ++q)
        for (int64_t i = 0; i < n; ++i) a[i] = a[i] + p[q * n + i];
      break;
    }
    case CommType::kI64: {
      const int64_t* p = reinterpret_cast<const int64_t*>(parts);
      int64_t* a = static_cast<int64_t*>(acc);
      std::memcpy(a, p, static_cast<size_t>(n) * 8);
      for (int q = 1; q < P; ++q)
        for (int64_t i = 0; i < n; ++i) a[i] = a[i] + p[q * n + i];
      break;
    }
    case CommType::kBF16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(parts);
      uint16_t* a = static_cast<uint16_t*>(acc);
      for (int64_t i = 0; i < n; ++i) {
        float s = bf16_to_float(p[i]);
        for (int q = 1; q < P; ++q) s = s + bf16_to_float(p[q * n + i]);
        a[i] = float_to_bf16(s);
      }
      break;
    }
  }
}

// a = a + b element-wise in the type (BF16: in F32, rounded once).
void add_in_place(void* a, const void* b, int64_t n, CommType t) {
  switch (t) {
    case CommType::kF32:
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(a)[i] = static_cast<float*>(a)[i] + static_cast<const float*>(b)[i];
      break;
    case CommType::kF64:
      for (int64_t i = 0; i < n; ++i)
        static_cast<double*>(a)[i] = static_cast<double*>(a)[i] + static_cast<const double*>(b)[i];
      break;
    case CommType::kI64:
      for (int64_t i = 0; i < n; ++i)
        static_cast<int64_t*>(a)[i] = static_cast<int64_t*>(a)[i] + static_cast<const int64_t*>(b)[i];
      break;
    case CommType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t* x = static_cast<uint16_t*>(a) + i;
        *x = float_to_bf16(bf16_to_float(*x) + bf16_to_float(static_cast<const uint16_t*>(b)[i]));
      }
      break;
  }
}

}  // namespace

void Communicator::all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                              const std::vector<int64_t>& displs, CommType t) {
  check_sizes(*this, counts, "all_gather: counts need one non-negative entry per rank");
  check_sizes(*this, displs, "all_gather: displs need one non-negative entry per rank");
  const int64_t es = static_cast<int64_t>(comm_type_size(t));
  const int me = rank(), P = size();
  stats_.calls++;
  stats_.bytes_sent += counts[me] * es * (P - 1);
  for (int q = 0; q < P; ++q)
    if (q != me) stats_.bytes_received += counts[q] * es;
  do_all_gather(send, recv, counts, displs, t);
}

void Communicator::all_to_all(const void* send, const std::vector<int64_t>& send_counts,
                              const std::vector<int64_t>& send_displs, void* recv,
                              const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                              CommType t) {
  check_sizes(*this, send_counts, "all_to_all: send_counts need one non-negative entry per rank");
  check_sizes(*this, send_displs, "all_to_all: send_displs need one non-negative entry per rank");
  check_sizes(*this, recv_counts, "all_to_all: recv_counts need one non-negative entry per rank");
  check_sizes(*this, recv_displs, "all_to_all: recv_displs need one non-negative entry per rank");
  const int64_t es = static_cast<int64_t>(comm_type_size(t));
  const int me = rank(), P = size();
  stats_.calls++;
  for (int q = 0; q < P; ++q) {
    if (q == me) continue;
    stats_.bytes_sent += send_counts[q] * es;
    stats_.bytes_received += recv_counts[q] * es;
  }
  do_all_to_all(send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
}

void Communicator::broadcast(void* buf, int64_t count, int root, CommType t) {
  LAPLACE_CHECK(root >= 0 && root < size() && count >= 0, "broadcast: bad root or count");
  const int64_t es = static_cast<int64_t>(comm_type_size(t));
  stats_.calls++;
  if (rank() == root) stats_.bytes_sent += count * es * (size() - 1);
  else stats_.bytes_received += count * es;
  do_broadcast(buf, count, root, t);
}

void Communicator::barrier() { do_barrier(); }

void Communicator::reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& counts, CommType t,
                                  bool accumulate) {
  check_sizes(*this, counts, "reduce_scatter: counts need one non-negative entry per rank");
  const int P = size(), me = rank();
  const int64_t n = counts[me];
  std::vector<int64_t> sdispl(P), rcounts(P, n), rdispl(P);
  int64_t off = 0;
  for (int q = 0; q < P; ++q) {
    sdispl[q] = off;
    off += counts[q];
    rdispl[q] = q * n;
  }
  void* parts = reduction_scratch(static_cast<size_t>(n * P) * comm_type_size(t), send);
  all_to_all(send, counts, sdispl, parts, rcounts, rdispl, t);
  if (n > 0) sum_parts(parts, P, n, recv, t, accumulate);
}

void Communicator::all_reduce(void* buf, int64_t count, CommType t) {
  const int P = size();
  std::vector<int64_t> counts(P, count), displs(P);
  for (int q = 0; q < P; ++q) displs[q] = q * count;
  void* parts = reduction_scratch(static_cast<size_t>(count * P) * comm_type_size(t), buf);
  all_gather(buf, parts, counts, displs, t);
  if (count > 0) sum_parts(parts, P, count, buf, t, false);
}

void* Communicator::reduction_scratch(size_t bytes, const void*) {
  if (host_scratch_.size() < bytes) host_scratch_.resize(bytes);
  return host_scratch_.data();
}

void Communicator::sum_parts(const void* parts, int P, int64_t n, void* out, CommType t, bool accumulate) {
  if (!accumulate) return sum_in_rank_order(static_cast<const char*>(parts), P, n, out, t);
  std::vector<char> sum(static_cast<size_t>(n) * comm_type_size(t));
  sum_in_rank_order(static_cast<const char*>(parts), P, n, sum.data(), t);
  add_in_place(out, sum.data(), n, t);
}

// ---- single process ------------------------------------------------------------------

void SingleCommunicator::do_all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                                       const std::vector<int64_t>& displs, CommType t) {
  const size_t es = comm_type_size(t);
  if (counts[0] > 0 && static_cast<char*>(recv) + displs[0] * es != send)
    std::memmove(static_cast<char*>(recv) + displs[0] * es, send, static_cast<size_t>(counts[0]) * es);
}

void SingleCommunicator::do_all_to_all(const void* send, const std::vector<int64_t>& send_counts,
                                       const std::vector<int64_t>& send_displs, void* recv,
                                       const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                                       CommType t) {
  LAPLACE_CHECK(send_counts[0] == recv_counts[0], "all_to_all: send and receive counts to self differ");
  const size_t es = comm_type_size(t);
  if (send_counts[0] > 0)
    std::memmove(static_cast<char*>(recv) + recv_displs[0] * es, static_cast<const char*>(send) + send_displs[0] * es,
                 static_cast<size_t>(send_counts[0]) * es);
}

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
         std::getenv("PMI_SIZE") != nullptr;
}

Status make_communicator(std::unique_ptr<Communicator>* out) {
  if (launched_by_mpi()) return make_mpi_communicator(out);
  *out = std::make_unique<SingleCommunicator>();
  return Status::ok();
}

Status agree_status(Communicator& comm, const Status& local) {
  const int P = comm.size();
  int64_t mine = local.is_ok() ? 0 : 1;
  std::vector<int64_t> all(P), counts(P, 1), displs(P);
  for (int q = 0; q < P; ++q) displs[q] = q;
  comm.all_gather(&mine, all.data(), counts, displs, CommType::kI64);
  if (!local.is_ok()) return local;
  for (int q = 0; q < P; ++q)
    if (all[q] != 0)
      return Status::invalid_argument("rank " + std::to_string(q) + " failed (its error is printed by that rank)");
  return Status::ok();
}

}  // namespace laplace
