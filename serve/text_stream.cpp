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
    if (!s.empty()) {
      max_stop_ = std::max(max_stop_, s.size());
      stops_.push_back(std::move(s));
    }
}

namespace {

size_t strip_replacements(std::string* text) {
  size_t n = 0;
  while (text->size() >= kReplacement.size() &&
         text->compare(text->size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0) {
    text->resize(text->size() - kReplacement.size());
    ++n;
  }
  return n;
}

}  // namespace

void TextStream::advance() {
  const std::vector<int32_t> window(ids_.begin() + static_cast<ptrdiff_t>(prefix_), ids_.end());
  const std::vector<int32_t> context(ids_.begin() + static_cast<ptrdiff_t>(prefix_),
                                     ids_.begin() + static_cast<ptrdiff_t>(read_));
  std::string w, c;
  if (!tok_->decode(window, &w).is_ok() || !tok_->decode(context, &c).is_ok()) return;  // ids were checked
  const bool unfinished = strip_replacements(&w) > 0;
  if (w.size() < c.size() || w.compare(0, c.size(), c) != 0) return;  // not append-only: wait for more
  if (unfinished) {
    pending_ = w.substr(c.size());
    return;
  }
  decoded_ += w.substr(c.size());
  pending_.clear();
  prefix_ = read_;
  read_ = ids_.size();
}

std::string TextStream::tail(size_t from) const {
  if (from >= decoded_.size()) return pending_.substr(std::min(from - decoded_.size(), pending_.size()));
  return decoded_.substr(from) + pending_;
}

std::string TextStream::push(int32_t token) {
  if (stopped_) return {};
  ids_.push_back(token);
  advance();
  const size_t total = size();
  if (total < sent_.size()) return {};  // never resend what went out
  // Only the text from a stop string's length before what went out can hold anything new.
  const size_t base = sent_.size() >= max_stop_ ? sent_.size() - max_stop_ : 0;
  const std::string text = tail(base);
  const size_t at = sent_.size() - base;  // where the unsent text starts in `text`
  // A completed stop string: send up to it, drop the rest. The earliest match wins; a
  // match must end after what was already sent (else it would have stopped then).
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t from = at >= s.size() ? at - s.size() + 1 : 0;
    const size_t p = text.find(s, from);
    if (p != std::string::npos) cut = std::min(cut, p);
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = cut > at ? text.substr(at, cut - at) : std::string();
    sent_ += out;
    return out;
  }
  size_t hold = 0;
  for (const std::string& s : stops_) hold = std::max(hold, partial_stop_suffix(text, s));
  const size_t end = text.size() - std::min(hold, text.size());
  if (end <= at) return {};
  std::string out = text.substr(at, end - at);
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
