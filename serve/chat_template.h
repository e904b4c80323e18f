// The chat template stored with a model (DIR/chat_template.json): how a list of messages
// becomes the model's prompt. Structured (per-role prefix and suffix), not a template
// language, so that a conversation is tokenized message by message: the tokens of turn
// n are a prefix of the tokens of turn n+1, which is what lets the state cache skip the
// whole earlier conversation.
//
//   {"bos": "", "roles": {"system": {"prefix": "### System:\n", "suffix": "\n\n"}, "user": …,
//    "assistant": …}, "generation_prompt": "### Assistant:\n", "stop": ["\n### "]}
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace laplace {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant" ("developer" is read as "system")
  std::string content;
};

struct ChatTemplate {
  struct Role {
    std::string prefix, suffix;
  };
  std::string bos;                   // text before the first message
  std::map<std::string, Role> roles;  // system, user, assistant
  std::string generation_prompt;     // after the last message: the assistant's turn begins
  std::vector<std::string> stop;     // stop strings every chat request gets

  static ChatTemplate default_template();
  // Reads DIR/chat_template.json's text. Errors: corrupt (not JSON / wrong types),
  // invalid_argument (a role missing).
  static Status parse(const std::string& json_text, ChatTemplate* out);

  // The prompt as text pieces to tokenize one by one: bos, then per message prefix,
  // content, suffix, then the generation prompt. Piece kinds tell which are contents of
  // assistant messages (which a server may tokenize as the tokens it generated).
  struct Piece {
    std::string text;
    bool assistant_content = false;
  };
  Status render(const std::vector<ChatMessage>& messages, std::vector<Piece>* out) const;
};

}  // namespace laplace
