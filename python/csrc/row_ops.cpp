// Runtime.rms_norm, rotary and silu_mul: the decode row operations (Note [Decode row ops] in
// src/row_ops.cpp) on torch tensors. Each checks its tensors (naming the bad one), then runs the
// backend's kernel on torch's current stream (CUDA: capturable in a CUDA graph, no host work
// after the launch) or the host backend's on the runtime's own stream, waited for.
#include "runtime.h"

#include <string>

namespace py = pybind11;

namespace reviva::python {
namespace {

HalfType half_type(const torch::Tensor& t, const char* op, const char* name) {
  REVIVA_CHECK_ARG(t.defined(), op, ": ", name, " is None");
  const bool bf16 = t.scalar_type() == torch::kBFloat16;
  REVIVA_CHECK_ARG(bf16 || t.scalar_type() == torch::kHalf, op, ": ", name,
                   " must be bfloat16 or float16, got a ", describe(t));
  return bf16 ? HalfType::BFloat16 : HalfType::Float16;
}

// `t` as [rows, width] rows of one stride, its last dimension dense, on the runtime's device and
// of `type`; returns the row stride (elements).
std::int64_t row_stride(const Runtime& rt, const torch::Tensor& t, const torch::Tensor& like,
                        HalfType type, const char* op, const char* name) {
  REVIVA_CHECK_ARG(half_type(t, op, name) == type && t.device() == rt.device(), op, ": ", name,
                   " must be a ", like.dtype(), " tensor on ", rt.device().str(), ", got a ",
                   describe(t));
  REVIVA_CHECK_ARG(t.sizes() == like.sizes(), op, ": ", name, " must have shape ", like.sizes(),
                   ", got a ", describe(t));
  REVIVA_CHECK_ARG(t.dim() >= 1 && t.stride(-1) == 1, op, ": ", name,
                   "'s last dimension must be dense, got strides ", t.strides());
  const int64_t width = t.size(-1);
  int64_t stride = width;  // (one row or none: any)
  // Rows of one stride: the leading dimensions collapse (as view(-1, width) allows).
  int64_t expect = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (expect < 0) {
      stride = t.stride(d);
      expect = stride * t.size(d);
      continue;
    }
    REVIVA_CHECK_ARG(t.stride(d) == expect, op, ": ", name,
                     " must be rows of one stride (view(-1, width) of it), got strides ",
                     t.strides(), " for a ", describe(t));
    expect *= t.size(d);
  }
  REVIVA_CHECK_ARG(stride >= width || t.numel() == width, op, ": ", name,
                   "'s rows overlap (stride ", stride, " < width ", width, ")");
  return stride;
}

template <typename Launch>
void on_current_stream(const Runtime& rt, Launch launch) {
  if (auto stream = rt.current_stream()) {
    launch(stream->handle());
    return;
  }
  py::gil_scoped_release release;
  auto stream = rt.compute_stream();
  launch(stream->handle());
  rt.backend()->synchronize_stream(stream->handle());
}

void rms_norm_into(const Runtime& rt, const torch::Tensor& x, const torch::Tensor& weight,
                   double eps, torch::Tensor& out, const std::optional<torch::Tensor>& residual) {
  const HalfType type = half_type(x, "rms_norm", "x");
  RmsNorm n;
  n.type = type;
  n.x = x.data_ptr();
  n.x_stride = row_stride(rt, x, x, type, "rms_norm", "x");
  n.out = out.data_ptr();
  n.out_stride = row_stride(rt, out, x, type, "rms_norm", "out");
  if (residual.has_value() && residual->defined()) {
    n.residual = residual->data_ptr();
    n.residual_stride = row_stride(rt, *residual, x, type, "rms_norm", "residual");
    REVIVA_CHECK_ARG(!residual->is_same(out) && n.residual != n.out,
                     "rms_norm: out must not be the residual (it is written with the sum)");
  }
  REVIVA_CHECK_ARG(half_type(weight, "rms_norm", "weight") == type &&
                       weight.device() == rt.device() && weight.dim() == 1 &&
                       weight.size(0) == x.size(-1) && weight.stride(0) == 1,
                   "rms_norm: weight must be a dense ", x.dtype(), " tensor of shape [", x.size(-1),
                   "] on ", rt.device().str(), ", got a ", describe(weight));
  n.weight = weight.data_ptr();
  n.width = static_cast<std::size_t>(x.size(-1));
  n.rows = x.size(-1) == 0 ? 0 : static_cast<std::size_t>(x.numel() / x.size(-1));
  n.eps = static_cast<float>(eps);
  on_current_stream(rt, [&](StreamHandle s) { rt.backend()->rms_norm_async(n, s); });
}

void rotary_in_place(const Runtime& rt, torch::Tensor& q, torch::Tensor& k,
                     const torch::Tensor& cos, const torch::Tensor& sin) {
  const HalfType type = half_type(q, "rotary", "q");
  const auto check3 = [&](const torch::Tensor& t, const char* name) {
    REVIVA_CHECK_ARG(
        half_type(t, "rotary", name) == type && t.device() == rt.device() && t.dim() == 3 &&
            t.stride(2) == 1 && t.size(0) == q.size(0) && t.size(2) == q.size(2),
        "rotary: ", name, " must be a ", q.dtype(), " tensor [batch ", q.size(0),
        ", heads, head_dim ", q.size(2), "] on ", rt.device().str(),
        " with its last dimension dense, got a ", describe(t), " with strides ", t.strides());
  };
  check3(q, "q");
  check3(k, "k");
  const auto check2 = [&](const torch::Tensor& t, const char* name) {
    REVIVA_CHECK_ARG(half_type(t, "rotary", name) == type && t.device() == rt.device() &&
                         t.dim() == 2 && t.stride(1) == 1 && t.size(0) == q.size(0) &&
                         t.size(1) == q.size(2),
                     "rotary: ", name, " must be a ", q.dtype(), " tensor [batch ", q.size(0),
                     ", head_dim ", q.size(2), "] on ", rt.device().str(),
                     " with its last dimension dense, got a ", describe(t));
  };
  check2(cos, "cos");
  check2(sin, "sin");
  Rotary r;
  r.type = type;
  r.batch = static_cast<std::size_t>(q.size(0));
  r.q_heads = static_cast<std::size_t>(q.size(1));
  r.k_heads = static_cast<std::size_t>(k.size(1));
  r.head_dim = static_cast<std::size_t>(q.size(2));
  r.q = q.data_ptr();
  r.q_stride[0] = q.stride(0);
  r.q_stride[1] = q.stride(1);
  r.k = k.data_ptr();
  r.k_stride[0] = k.stride(0);
  r.k_stride[1] = k.stride(1);
  r.cos = cos.data_ptr();
  r.sin = sin.data_ptr();
  r.cos_stride = cos.stride(0);
  r.sin_stride = sin.stride(0);
  on_current_stream(rt, [&](StreamHandle s) { rt.backend()->rotary_async(r, s); });
}

void silu_mul_into(const Runtime& rt, const torch::Tensor& gate, const torch::Tensor& up,
                   torch::Tensor& out) {
  const HalfType type = half_type(gate, "silu_mul", "gate");
  SiluMul op;
  op.type = type;
  op.gate = gate.data_ptr();
  op.gate_stride = row_stride(rt, gate, gate, type, "silu_mul", "gate");
  op.up = up.data_ptr();
  op.up_stride = row_stride(rt, up, gate, type, "silu_mul", "up");
  op.out = out.data_ptr();
  op.out_stride = row_stride(rt, out, gate, type, "silu_mul", "out");
  op.width = static_cast<std::size_t>(gate.size(-1));
  op.rows = gate.size(-1) == 0 ? 0 : static_cast<std::size_t>(gate.numel() / gate.size(-1));
  on_current_stream(rt, [&](StreamHandle s) { rt.backend()->silu_mul_async(op, s); });
}

}  // namespace

void bind_row_ops(py::class_<Runtime, std::shared_ptr<Runtime>>& runtime) {
  runtime
      .def("rms_norm", &rms_norm_into, py::arg("x"), py::arg("weight"), py::arg("eps"),
           py::arg("out"), py::arg("residual") = py::none(),
           "out = HF's RMSNorm of x's rows (bf16 or fp16 [..., width], rows of one stride): in "
           "fp32 x * rsqrt(mean(x^2) + eps), rounded, times weight ([width]). With `residual` "
           "(x's shape), the rows normalized are residual + x (rounded), also written into "
           "`residual`. `out` may be x, not the residual. In torch's current stream's order: one "
           "kernel on CUDA (Note [Decode row ops]).")
      .def("rotary", &rotary_in_place, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"),
           "Rotary position embedding in place, as HF's apply_rotary_pos_emb with rotate_half: "
           "q [batch, heads, head_dim] and k [batch, kv_heads, head_dim] (any strides, the last "
           "dimension dense) become x * cos + rotate_half(x) * sin, each product and the sum "
           "rounded to their dtype; cos and sin [batch, head_dim] (one position per sequence). "
           "One kernel on CUDA, in torch's current stream's order.")
      .def("silu_mul", &silu_mul_into, py::arg("gate"), py::arg("up"), py::arg("out"),
           "out = silu(gate) * up as HF's gated MLP computes it (silu rounded, then the "
           "product), for tensors of one shape and dtype (bf16 or fp16, rows of one stride); "
           "`out` may be gate or up. One kernel on CUDA, in torch's current stream's order.");
}

}  // namespace reviva::python
