// The web page of `laplace serve` (docs/serving.md §9, "The web page"): a chat view, a live
// view of /metrics and the named sessions, as three hand-written files (serve/http/ui/) compiled
// into the binary, so a server needs no file beside it and no network to show its page.
//
// The page is public: it loads without the API key (it holds no data of its own; the key it
// is given goes only into the API calls it makes, from the browser's session storage). Every
// file goes out with a strict Content-Security-Policy (scripts, styles, images and fetches
// from this server only; no inline script or style), nosniff and no-cache, so that a browser
// runs only what this binary ships and revalidates after an upgrade.
#pragma once

#include <optional>
#include <string_view>

#include "serve/http/http_server.h"

namespace laplace {

// The answer to a GET or HEAD of one of the page's paths ("/", "/ui/app.js", ...), or
// nullopt when `path` is not one of them.
std::optional<http::Response> static_file_response(std::string_view path);

// True for the page's paths: they skip the API key and the readiness check.
bool is_static_path(std::string_view path);

// The Content-Security-Policy the page's files are served with.
std::string_view ui_content_security_policy();

}  // namespace laplace
