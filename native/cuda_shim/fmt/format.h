// MLX's CUDA headers include fmt for the messages of templates the native decode path never
// instantiates, and MLX's wheel ships no fmt: this stands in for it at build time only.
#pragma once
#include <string>
namespace fmt {
template <class... Args>
std::string format(const char* text, Args&&...) {
  return text;
}
}  // namespace fmt
