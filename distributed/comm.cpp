#include "distributed/comm.h"

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

// out[i] = Σ_q parts[q·n + i] in rank order (s = part₀; s = s + part₁; …), accumulated in
// A (F32 for BF16, else the type itself) and stored once; with accumulate, the stored sum
// is then added to out[i] (out[i] + sum, rounded once more for BF16).
template <class T, class A, class Load, class Store>
void sum_typed(const void* parts, int P, int64_t n, void* out, bool accumulate, Load load, Store store) {
  const T* p = static_cast<const T*>(parts);
  T* o = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) {
    A s = load(p[i]);
    for (int q = 1; q < P; ++q) s = s + load(p[q * n + i]);
    o[i] = accumulate ? store(load(o[i]) + load(store(s))) : store(s);
  }
}

void sum_in_rank_order(const void* parts, int P, int64_t n, void* out, CommType t, bool accumulate) {
  auto same = [](auto x) { return x; };
  switch (t) {
    case CommType::kF32: return sum_typed<float, float>(parts, P, n, out, accumulate, same, same);
    case CommType::kF64: return sum_typed<double, double>(parts, P, n, out, accumulate, same, same);
    case CommType::kI64: return sum_typed<int64_t, int64_t>(parts, P, n, out, accumulate, same, same);
    case CommType::kBF16:
      return sum_typed<uint16_t, float>(parts, P, n, out, accumulate, bf16_to_float, float_to_bf16);
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
  if (P == 1) {  // the sum of one part is the part: no exchange, no staging
    if (n > 0) sum_parts(send, 1, n, recv, t, accumulate);
    return;
  }
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
  sum_in_rank_order(parts, P, n, out, t, accumulate);
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

std::vector<int64_t> all_gather_value(Communicator& comm, int64_t value) {
  const int P = comm.size();
  std::vector<int64_t> all(P), counts(P, 1), displs(P);
  for (int q = 0; q < P; ++q) displs[q] = q;
  comm.all_gather(&value, all.data(), counts, displs, CommType::kI64);
  return all;
}

Status agree_status(Communicator& comm, const Status& local) {
  const std::vector<int64_t> all = all_gather_value(comm, local.is_ok() ? 0 : 1);
  if (!local.is_ok()) return local;
  for (int q = 0; q < comm.size(); ++q)
    if (all[q] != 0)
      return Status::invalid_argument("rank " + std::to_string(q) + " failed (its error is printed by that rank)");
  return Status::ok();
}

}  // namespace laplace
