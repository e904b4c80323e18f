#include "serve/chat_template.h"

#include <nlohmann/json.hpp>

namespace laplace {

ChatTemplate ChatTemplate::default_template() {
  ChatTemplate t;
  t.roles["system"] = {"### System:\n", "\n\n"};
  t.roles["user"] = {"### User:\n", "\n\n"};
  t.roles["assistant"] = {"### Assistant:\n", "\n\n"};
  t.generation_prompt = "### Assistant:\n";
  t.stop = {"\n### "};
  return t;
}

Status ChatTemplate::parse(const std::string& text, ChatTemplate* out) {
  using nlohmann::json;
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::corrupt("chat template: not a JSON object");
  ChatTemplate t;
  auto str = [&](const json& o, const char* key, std::string* dst) -> Status {
    if (!o.contains(key)) return Status::ok();
    if (!o[key].is_string()) return Status::corrupt(std::string("chat template: '") + key + "' must be a string");
    *dst = o[key].get<std::string>();
    return Status::ok();
  };
  LAPLACE_RETURN_IF_ERROR(str(j, "bos", &t.bos));
  LAPLACE_RETURN_IF_ERROR(str(j, "generation_prompt", &t.generation_prompt));
  if (!j.contains("roles") || !j["roles"].is_object()) return Status::corrupt("chat template: 'roles' must be an object");
  for (const char* r : {"system", "user", "assistant"}) {
    if (!j["roles"].contains(r) || !j["roles"][r].is_object())
      return Status::invalid_argument(std::string("chat template: role '") + r + "' missing");
    Role role;
    LAPLACE_RETURN_IF_ERROR(str(j["roles"][r], "prefix", &role.prefix));
    LAPLACE_RETURN_IF_ERROR(str(j["roles"][r], "suffix", &role.suffix));
    t.roles[r] = role;
  }
  if (j.contains("stop")) {
    if (!j["stop"].is_array()) return Status::corrupt("chat template: 'stop' must be an array of strings");
    for (const auto& s : j["stop"]) {
      if (!s.is_string()) return Status::corrupt("chat template: 'stop' must be an array of strings");
      t.stop.push_back(s.get<std::string>());
    }
  }
  *out = std::move(t);
  return Status::ok();
}

Status ChatTemplate::render(const std::vector<ChatMessage>& messages, std::vector<Piece>* out) const {
  out->clear();
  if (!bos.empty()) out->push_back({bos, false});
  for (const ChatMessage& m : messages) {
    const std::string role = m.role == "developer" ? "system" : m.role;
    auto it = roles.find(role);
    if (it == roles.end()) return Status::invalid_argument("unknown message role '" + m.role + "'");
    if (!it->second.prefix.empty()) out->push_back({it->second.prefix, false});
    if (!m.content.empty()) out->push_back({m.content, role == "assistant"});
    if (!it->second.suffix.empty()) out->push_back({it->second.suffix, false});
  }
  if (!generation_prompt.empty()) out->push_back({generation_prompt, false});
  return Status::ok();
}

}  // namespace laplace
