// Generated token ids → text, as a stream: what a server may send after each token.
//
// Two things make this more than decode(): (1) a token can end inside a UTF-8 character
// (byte-fallback pieces), which decodes to U+FFFD until the rest arrives, so trailing
// replacement characters are held back; (2) a stop string can span token boundaries, so
// any tail of the text that is a prefix of a stop string is held back until it either
// completes the stop string (everything from it on is dropped) or cannot any more.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace laplace {

class TextStream {
 public:
  // Empty stop strings are ignored. The tokenizer must outlive the stream.
  TextStream(const Tokenizer* tok, std::vector<std::string> stops);

  // Adds one generated token (ignored after a stop). Returns the text now safe to send.
  std::string push(int32_t token);
  // The end of generation: everything still held back (nothing after a stop).
  std::string finish();

  bool stopped() const { return stopped_; }
  // All text returned so far, in order.
  const std::string& sent() const { return sent_; }
  // Tokens pushed before the stop string completed (all, when no stop hit).
  const std::vector<int32_t>& tokens() const { return ids_; }

 private:
  // Decodes what the last token added, without trailing U+FFFD (an unfinished UTF-8
  // character): the text is decoded_ + pending_. Each push decodes a few tokens, not all of
  // them (a whole decode per token made a long answer quadratic): the tokens from prefix_
  // on, less the text of those before read_ (already in decoded_), which they need only as
  // context (a piece's leading space is dropped at the start of a decode).
  void advance();
  // The text from byte `from` on (from >= decoded_.size() - its last piece or so).
  std::string tail(size_t from) const;
  size_t size() const { return decoded_.size() + pending_.size(); }

  const Tokenizer* tok_;
  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  std::vector<int32_t> ids_;
  std::string decoded_;   // the text of ids_[0, read_)
  std::string pending_;   // the stable text of ids_[read_, end) (an unfinished character's tokens)
  size_t prefix_ = 0, read_ = 0;
  std::string sent_;
  bool stopped_ = false;
};

// Bytes of the longest suffix of `text` that is a proper prefix of `stop`.
size_t partial_stop_suffix(const std::string& text, const std::string& stop);

// The text of one token for logprobs ("▁the" → " the", "<0x0A>" → "\n").
std::string token_text(const Tokenizer& tok, int32_t id);

}  // namespace laplace
