// The base of the primitives: inputs read as row-contiguous arrays (packed at run time where they
// are not), one float32 output, CPU only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace qk {

namespace mx = mlx::core;

// An input as the kernel reads it: row-contiguous data in place (activations and parameters are), or
// else packed at run time into `buf`, so that the graph needs no copy node in front of each product.
template <class T>
struct Operand {
  const T* base;
  std::vector<int64_t> shape, strides;
  bool dense;
  size_t size;

  explicit Operand(const mx::array& a)
      : base(a.data<T>()), shape(a.shape().begin(), a.shape().end()),
        strides(a.strides().begin(), a.strides().end()), dense(a.flags().row_contiguous), size(a.size()) {}

  const T* packed(std::vector<T>& buf) const {
    if (dense || size == 0) return base;
    buf.resize(size);
    copy_out(reinterpret_cast<uint8_t*>(buf.data()), sizeof(T));
    return buf.data();
  }

  // For an input of another dtype seen as bytes: the same, an element being `width` bytes.
  const void* packed_as(std::vector<uint8_t>& buf, int width) const {
    if (dense || size == 0) return base;
    buf.resize(size * width);
    copy_out(buf.data(), width);
    return buf.data();
  }

 private:
  void copy_out(uint8_t* dst, int width) const {  // the elements in row-major order, last axis fastest
    const uint8_t* src = reinterpret_cast<const uint8_t*>(base);
    std::vector<int64_t> at(shape.size(), 0);
    int64_t off = 0;
    for (size_t i = 0; i < size; ++i) {
      std::memcpy(dst + i * width, src + off * width, width);
      for (int d = (int)shape.size() - 1; d >= 0; --d) {
        off += strides[d];
        if (++at[d] < shape[d]) break;
        off -= strides[d] * shape[d];
        at[d] = 0;
      }
    }
  }
};

// A primitive whose inputs are read as row-contiguous float32 (packed at run time when they are not)
// and whose one float32 output is written by `fn(inputs, out)`.
class Rowwise : public mx::Primitive {
 public:
  using Fn = std::function<void(const std::vector<const float*>&, const std::vector<const void*>&, float*)>;

  explicit Rowwise(mx::Stream s) : mx::Primitive(s) {}

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " has no GPU kernel: MLX's own ops serve there");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {out_shape(inputs)}; }

 protected:
  virtual mx::Shape out_shape(const std::vector<mx::array>& inputs) const = 0;
  // what runs on the stream's thread: float inputs (packed), other inputs (packed, as bytes), the output
  virtual Fn body(const std::vector<mx::array>& inputs) const = 0;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    std::vector<Operand<float>> floats;
    std::vector<Operand<uint8_t>> others;  // bool / int32 inputs, packed element by element in their width
    std::vector<int> width;
    for (auto& a : inputs) {
      enc.set_input_array(a);
      if (a.dtype() == mx::float32) {
        floats.emplace_back(a);
      } else {
        others.emplace_back(a);
        width.push_back((int)a.itemsize());
      }
    }
    enc.set_output_array(out);
    enc.dispatch([fn = body(inputs), floats = std::move(floats), others = std::move(others), width = std::move(width),
                  op = out.data<float>()]() {
      thread_local std::vector<std::vector<float>> fbuf;
      thread_local std::vector<std::vector<uint8_t>> obuf;
      fbuf.resize(std::max(fbuf.size(), floats.size()));
      obuf.resize(std::max(obuf.size(), others.size()));
      std::vector<const float*> fp;
      std::vector<const void*> opp;
      for (size_t i = 0; i < floats.size(); ++i) fp.push_back(floats[i].packed(fbuf[i]));
      for (size_t i = 0; i < others.size(); ++i) opp.push_back(others[i].packed_as(obuf[i], width[i]));
      fn(fp, opp, op);
    });
  }
};

}  // namespace qk
