// The Python module of the native kernels (linear.cpp): pybind11 with torch's tensor casters,
// not torch/extension.h (the whole C++ frontend, ~90% of the compile time). A unit of its own,
// compiled beside linear.cpp in parallel.

#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

// linear.cpp
bool set_avx512(bool on);
bool avx512_enabled();
std::vector<at::Tensor> conv_pool_relu_forward(const at::Tensor& x, const at::Tensor& w,
                                               const c10::optional<at::Tensor>& bias, int64_t k);
void conv_pool_relu_backward_sgd(const at::Tensor& grad, const at::Tensor& out,
                                 const at::Tensor& arg, const at::Tensor& x, at::Tensor w,
                                 c10::optional<at::Tensor> bias, int64_t k, double lr);
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias);
at::Tensor linear_backward_sgd(const at::Tensor& dy, const at::Tensor& x, at::Tensor w,
                               c10::optional<at::Tensor> bias, double lr, bool need_dx);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_avx512", &set_avx512, "use the AVX-512 code (same bits as AVX2) where supported");
  m.def("conv_pool_relu_forward", &conv_pool_relu_forward,
        "relu(maxpool2x2(conv(x))) for one input channel, channels-last output and argmax");
  m.def("conv_pool_relu_backward_sgd", &conv_pool_relu_backward_sgd,
        "the block's weight and bias SGD step from its output gradient (no input gradient)");
  m.def("avx512_enabled", &avx512_enabled, "whether the AVX-512 code is in use");
  m.def("linear_forward", &linear_forward, "y = x W^T + b for a skinny batch");
  m.def("linear_backward_sgd", &linear_backward_sgd,
        "dx = dy W (old W); W -= lr dy^T x; b -= lr sum(dy) in one pass over W");
}
