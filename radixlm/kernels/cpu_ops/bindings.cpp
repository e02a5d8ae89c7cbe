// The kernels' Python module: exactly the names of fused_ops.FUNCTIONS (the build names the
// module, TORCH_EXTENSION_NAME). Errors raised in a kernel reach Python as torch's.

// (pybind11 and torch's casters only: torch/extension.h would add the whole C++ frontend,
// doubling this file's build time)
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("paged_decode_attention", torch::wrap_pybind_function(paged_decode_attention),
        "paged_decode_attention", py::arg("q"), py::arg("k_buffer"), py::arg("v_buffer"),
        py::arg("slots"), py::arg("seq_lens"), py::arg("scale"), py::arg("softcap") = 0.0);
  m.def("rotary", torch::wrap_pybind_function(rotary), "rotary");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("scatter_rows", torch::wrap_pybind_function(scatter_rows), "scatter_rows");
  m.def("int8_matmul", torch::wrap_pybind_function(int8_matmul), "int8_matmul");
  m.def("dense_matmul", torch::wrap_pybind_function(dense_matmul), "dense_matmul");
  m.def("blocked_matmul", torch::wrap_pybind_function(blocked_matmul), "blocked_matmul");
  m.def("blocked_int8_matmul", torch::wrap_pybind_function(blocked_int8_matmul),
        "blocked_int8_matmul");
  m.def("paged_prefill_attention", torch::wrap_pybind_function(paged_prefill_attention),
        "paged_prefill_attention");
  m.def("prefill_attention_available", torch::wrap_pybind_function(prefill_attention_available),
        "prefill_attention_available");
  m.def("pair_matmul", torch::wrap_pybind_function(pair_matmul), "pair_matmul");
  m.def("int8_pair_matmul", torch::wrap_pybind_function(int8_pair_matmul), "int8_pair_matmul");
  m.def("pair_matmul_silu", torch::wrap_pybind_function(pair_matmul_silu), "pair_matmul_silu");
  m.def("int8_pair_matmul_silu", torch::wrap_pybind_function(int8_pair_matmul_silu),
        "int8_pair_matmul_silu");
  m.def("pair_matmul_available", torch::wrap_pybind_function(pair_matmul_available),
        "pair_matmul_available");
  m.def("decode_layer", torch::wrap_pybind_function(decode_layer), "decode_layer");
  m.def("decode_layers", torch::wrap_pybind_function(decode_layers), "decode_layers");
  m.def("sandwich_decode_layers", torch::wrap_pybind_function(sandwich_decode_layers),
        "sandwich_decode_layers");
  m.def("lora_add", torch::wrap_pybind_function(lora_add), "lora_add");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
  m.def("quantized_matmul", torch::wrap_pybind_function(quantized_matmul), "quantized_matmul");
  m.def("quantized_matmul_parts", torch::wrap_pybind_function(quantized_matmul_parts),
        "quantized_matmul_parts");
  m.def("dequantize_blocks", torch::wrap_pybind_function(dequantize_blocks),
        "dequantize_blocks");
  m.def("quantized_bf16_dots_serve", torch::wrap_pybind_function(quantized_bf16_dots_serve),
        "quantized_bf16_dots_serve");
}
