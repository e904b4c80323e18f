#include "eval/context.h"

#include <algorithm>
#include <string>

#include "core/rng.h"
#include "eval/stream.h"
#include "serve/metrics.h"

namespace laplace {

namespace {

bool power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

int64_t memory_in_use(Backend& be, bool cuda) {
  if (!cuda) return process_resident_bytes();
  size_t free_b = 0, total_b = 0;
  return be.memory_info(&free_b, &total_b) ? static_cast<int64_t>(total_b - free_b) : 0;
}

}  // namespace

Status eval_position_loss(Model& m, const std::vector<int32_t>& heldout, const PositionLossOptions& o,
                          const std::function<void(const PositionBucket&)>& each) {
  if (o.context < 2) return Status::invalid_argument("position loss: --context must be at least 2");
  if (o.streams < 1) return Status::invalid_argument("position loss: --streams must be at least 1");
  if (!power_of_two(o.first_bucket) || !power_of_two(o.piece) || o.piece < o.first_bucket)
    return Status::invalid_argument("position loss: --piece and --first-bucket must be powers of two, piece >= "
                                    "first bucket");
  const int64_t n = static_cast<int64_t>(heldout.size());
  if (n < o.context + 1)
    return Status::invalid_argument("position loss: context " + std::to_string(o.context) + " needs " +
                                    std::to_string(o.context + 1) + " held-out tokens; the data holds " +
                                    std::to_string(n));
  const int64_t S = o.streams, T = o.context;
  // Stream s: T + 1 consecutive held-out tokens from a seeded offset (inputs and their targets).
  std::vector<int32_t> x(static_cast<size_t>(S * T)), y(static_cast<size_t>(S * T));
  SplitMix64 rng{splitmix64_hash(o.seed)};
  for (int64_t s = 0; s < S; ++s) {
    const int64_t off = static_cast<int64_t>(rng.below(static_cast<uint64_t>(n - T)));
    std::copy_n(heldout.data() + off, T, x.data() + s * T);
    std::copy_n(heldout.data() + off + 1, T, y.data() + s * T);
  }
  SequenceStream st;
  LAPLACE_RETURN_IF_ERROR(st.init(&m, S, o.piece, o.piece));
  st.reset();
  const bool cuda = m.backend().name() == std::string("cuda");
  std::vector<int32_t> bx, by;
  for (int64_t b0 = 0; b0 < T;) {
    const int64_t b1 = std::min(T, b0 == 0 ? o.first_bucket : 2 * b0);
    const int64_t w = b1 - b0;
    bx.resize(static_cast<size_t>(S * w));
    by.resize(static_cast<size_t>(S * w));
    for (int64_t s = 0; s < S; ++s) {
      std::copy_n(x.data() + s * T + b0, w, bx.data() + s * w);
      std::copy_n(y.data() + s * T + b0, w, by.data() + s * w);
    }
    PositionBucket r;
    r.begin = b0;
    r.end = b1;
    r.loss_sum = st.feed_loss(bx.data(), by.data(), w, &r.count);
    r.memory_bytes = memory_in_use(m.backend(), cuda);
    if (each) each(r);
    b0 = b1;
  }
  return Status::ok();
}

std::vector<DocumentSpan> split_documents(const std::vector<int32_t>& tokens, int32_t separator) {
  std::vector<DocumentSpan> docs;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[static_cast<size_t>(i)] != separator) continue;
    if (!docs.empty()) docs.back().tokens = i - docs.back().begin - 1;
    docs.push_back({i, 0});
  }
  if (!docs.empty()) docs.back().tokens = n - docs.back().begin - 1;
  return docs;
}

Status eval_document_position_loss(Model& m, const std::vector<int32_t>& tokens, const DocumentLossOptions& o,
                                   const std::function<void(const PositionBucket&)>& each,
                                   DocumentLossSummary* summary) {
  if (o.context < 1) return Status::invalid_argument("position loss: --context must be at least 1");
  if (o.streams < 1) return Status::invalid_argument("position loss: --streams must be at least 1");
  if (o.min_tokens < 1) return Status::invalid_argument("position loss: --min-doc-tokens must be at least 1");
  if (!power_of_two(o.first_bucket) || !power_of_two(o.piece) || o.piece < o.first_bucket)
    return Status::invalid_argument("position loss: --piece and --first-bucket must be powers of two, piece >= "
                                    "first bucket");
  const std::vector<DocumentSpan> docs = split_documents(tokens, o.separator);
  DocumentLossSummary sum;
  sum.documents = static_cast<int64_t>(docs.size());
  for (const DocumentSpan& d : docs) sum.longest = std::max(sum.longest, d.tokens);
  if (docs.empty())
    return Status::invalid_argument("position loss: the data holds no document: no separator token (id " +
                                    std::to_string(o.separator) + ") precedes any of its " +
                                    std::to_string(tokens.size()) + " tokens");
  // The documents scored, longest first (ties in data order), so rows run side by side end close together.
  std::vector<DocumentSpan> sel;
  for (const DocumentSpan& d : docs)
    if (d.tokens >= o.min_tokens) sel.push_back({d.begin, std::min(d.tokens, o.context)});
  if (sel.empty())
    return Status::invalid_argument("position loss: no document of at least " + std::to_string(o.min_tokens) +
                                    " tokens among the " + std::to_string(docs.size()) +
                                    " documents of the data (the longest has " + std::to_string(sum.longest) +
                                    ")");
  std::stable_sort(sel.begin(), sel.end(),
                   [](const DocumentSpan& a, const DocumentSpan& b) { return a.tokens > b.tokens; });
  sum.scored = static_cast<int64_t>(sel.size());
  for (const DocumentSpan& d : sel) sum.scored_tokens += d.tokens;
  // The buckets, to the longest scored document's end.
  const int64_t L = sel.front().tokens;
  std::vector<PositionBucket> buckets;
  for (int64_t b0 = 0; b0 < L;) {
    PositionBucket b;
    b.begin = b0;
    b.end = std::min(L, b0 == 0 ? o.first_bucket : 2 * b0);
    buckets.push_back(b);
    b0 = b.end;
  }
  const int64_t S = o.streams;
  SequenceStream st;
  LAPLACE_RETURN_IF_ERROR(st.init(&m, S, o.piece, o.piece));
  const bool cuda = m.backend().name() == std::string("cuda");
  std::vector<int32_t> bx, by;
  for (size_t k = 0; k < sel.size(); k += static_cast<size_t>(S)) {
    const int64_t rows = std::min<int64_t>(S, static_cast<int64_t>(sel.size() - k));
    const int64_t Lb = sel[k].tokens;  // the batch's longest
    st.reset();                          // every document from the zero state
    for (PositionBucket& b : buckets) {
      if (b.begin >= Lb) break;
      const int64_t b0 = b.begin, b1 = std::min(b.end, Lb), w = b1 - b0;
      bx.assign(static_cast<size_t>(S * w), o.separator);
      by.assign(static_cast<size_t>(S * w), -1);
      for (int64_t s = 0; s < rows; ++s) {
        const DocumentSpan& d = sel[k + static_cast<size_t>(s)];
        // Position p: input token begin + p (the separator at p = 0), target begin + p + 1.
        for (int64_t p = b0; p < std::min(b1, d.tokens); ++p) {
          bx[static_cast<size_t>(s * w + p - b0)] = tokens[static_cast<size_t>(d.begin + p)];
          by[static_cast<size_t>(s * w + p - b0)] = tokens[static_cast<size_t>(d.begin + p + 1)];
        }
      }
      int64_t count = 0;
      b.loss_sum += st.feed_loss(bx.data(), by.data(), w, &count);
      b.count += count;
      b.memory_bytes = std::max(b.memory_bytes, memory_in_use(m.backend(), cuda));
    }
  }
  if (summary) *summary = sum;
  if (each)
    for (const PositionBucket& b : buckets) each(b);
  return Status::ok();
}

}  // namespace laplace
