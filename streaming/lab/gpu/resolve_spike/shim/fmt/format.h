// MLX's CUDA headers include fmt for error messages of templates this spike never
// instantiates; the wheel does not ship fmt, so this stands in (build-time only).
#pragma once
#include <string>
namespace fmt {
template <class... Args>
std::string format(const char* text, Args&&...) { return text; }
}  // namespace fmt
