#include "serve/text_stream.h"

#include <algorithm>

namespace laplace {

namespace {
const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD
}

size_t partial_stop_suffix(const std::string& text, const std::string& stop) {
  const size_t max = std::min(text.size(), stop.size() - 1);
  for (size_t k = max; k > 0; --k)
    if (text.compare(text.size() - k, k, stop, 0, k) == 0) return k;
  return 0;
}

TextStream::TextStream(const Tokenizer* tok, std::vector<std::string> stops) : tok_(tok) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string TextStream::stable_text() const {
  std::string text;
  Status st = tok_->decode(ids_, &text);
  if (!st.is_ok()) return sent_;  // ids were checked against the vocabulary on the way in
  while (text.size() >= kReplacement.size() &&
         text.compare(text.size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0)
    text.resize(text.size() - kReplacement.size());
  return text;
}

std::string TextStream::push(int32_t token) {
  if (stopped_) return {};
  ids_.push_back(token);
  std::string text = stable_text();
  // Decoding is append-only apart from the held-back tail; never resend what went out.
  if (text.size() < sent_.size() || text.compare(0, sent_.size(), sent_) != 0) return {};
  // A completed stop string: send up to it, drop the rest. The earliest match wins; a
  // match must end after what was already sent (else it would have stopped then).
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t from = sent_.size() >= s.size() ? sent_.size() - s.size() + 1 : 0;
    const size_t p = text.find(s, from);
    if (p != std::string::npos) cut = std::min(cut, p);
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = cut > sent_.size() ? text.substr(sent_.size(), cut - sent_.size()) : std::string();
    sent_ += out;
    return out;
  }
  size_t hold = 0;
  for (const std::string& s : stops_) hold = std::max(hold, partial_stop_suffix(text, s));
  const size_t end = text.size() - hold;
  if (end <= sent_.size()) return {};
  std::string out = text.substr(sent_.size(), end - sent_.size());
  sent_ += out;
  return out;
}

std::string TextStream::finish() {
  if (stopped_) return {};
  std::string text;
  if (!tok_->decode(ids_, &text).is_ok() || text.size() < sent_.size() ||
      text.compare(0, sent_.size(), sent_) != 0)
    return {};
  std::string out = text.substr(sent_.size());
  sent_ += out;
  return out;
}

std::string token_text(const Tokenizer& tok, int32_t id) {
  std::string p = tok.piece(id);
  if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>') {
    return std::string(1, static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
  }
  std::string out;
  const std::string ws = "\xE2\x96\x81";  // ▁
  for (size_t i = 0; i < p.size();) {
    if (p.compare(i, ws.size(), ws) == 0) {
      out += ' ';
      i += ws.size();
    } else {
      out += p[i++];
    }
  }
  return out;
}

}  // namespace laplace
