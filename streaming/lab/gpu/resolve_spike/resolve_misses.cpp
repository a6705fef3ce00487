// Issue 31, stage 2 spike, second part: the miss path inside the primitive. `resolve(ids, slot
// tensors)` maps a layer's expert ids to slots and, where an expert is not in a slot, reads its
// rows from the safetensors shard into the slot memory (LRU victim, never one this call uses)
// before the gather runs; the Python thread only builds the graph. CPU backend only: the
// resolution runs on the CPU stream's worker in stream order with the gathers around it, so a
// slot is never refilled while a gather queued before it still reads it.
//
// Outputs: the slots, and each slot tensor again (sharing its buffer), so that the gather
// depends on the resolution as a graph edge. A failed read throws from the evaluation naming
// the layer, shard, offset and length; the slot it was filling claims no expert, and the layer
// fails every later call until it is rebuilt (the engine's "errors until reload").
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

struct LayerSlots {
  int layer, experts, slots, tensors;
  std::vector<int32_t> slot_of;    // expert -> slot, -1 when not in one
  std::vector<int32_t> expert_of;  // slot -> expert, -1 when empty
  std::vector<uint64_t> last_use;  // slot -> the call that last used it
  uint64_t clock = 0;
  std::vector<int64_t> row_bytes;  // tensor -> bytes of one expert's row
  std::vector<int> file_of;        // (expert, tensor) -> shard index
  std::vector<int64_t> offset_of;  // (expert, tensor) -> byte offset in its shard
  std::vector<std::string> paths;
  std::vector<int> fds;
  std::atomic<bool> broken{false};  // a read failed: every later call fails with its message
  std::mutex failed_mtx;
  std::string failed_why;
  uint64_t calls = 0, hits = 0, misses = 0, bytes = 0;

  LayerSlots(int layer, int experts, int slots, std::vector<int64_t> row_bytes, std::vector<int> file_of,
             std::vector<int64_t> offset_of, std::vector<std::string> paths)
      : layer(layer), experts(experts), slots(slots), tensors(int(row_bytes.size())), slot_of(experts, -1),
        expert_of(slots, -1), last_use(slots, 0), row_bytes(std::move(row_bytes)), file_of(std::move(file_of)),
        offset_of(std::move(offset_of)), paths(std::move(paths)) {
    if (this->file_of.size() != size_t(experts) * tensors || this->offset_of.size() != this->file_of.size())
      throw std::invalid_argument("resolve: the source table is not experts x tensors");
    for (auto& p : this->paths) {
      int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw std::runtime_error("resolve: cannot open " + p + ": " + std::strerror(errno));
      fds.push_back(fd);
    }
  }
  ~LayerSlots() {
    for (int fd : fds) ::close(fd);
  }

  [[noreturn]] void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lk(failed_mtx);
      if (!broken.load()) failed_why = why;
      broken.store(true);
    }
    throw std::runtime_error(why);
  }

  std::string failed() {
    std::lock_guard<std::mutex> lk(failed_mtx);
    return failed_why;
  }

  void read_row(int expert, int tensor, char* dst) {
    const size_t at = size_t(expert) * tensors + tensor;
    const int file = file_of[at];
    const int64_t offset = offset_of[at], length = row_bytes[tensor];
    int64_t done = 0;
    while (done < length) {
      ssize_t got = ::pread(fds[file], dst + done, size_t(length - done), offset + done);
      if (got <= 0)
        fail("layer " + std::to_string(layer) + ": reading expert " + std::to_string(expert) + " from " +
             paths[file] + " at offset " + std::to_string(offset) + ", length " + std::to_string(length) + ": " +
             (got == 0 ? std::string("the shard ends early") : std::string(std::strerror(errno))));
      done += got;
    }
    bytes += uint64_t(length);
  }

  // One call's ids -> slots, reading the misses into LRU victims the call does not use.
  void resolve(const uint32_t* ids, uint32_t* out, size_t n, const std::vector<char*>& bases) {
    if (broken.load()) throw std::runtime_error(failed());
    const uint64_t now = ++clock;
    ++calls;
    std::vector<int> missing;
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] >= uint32_t(experts)) fail("layer " + std::to_string(layer) + ": expert id out of range");
      int s = slot_of[ids[i]];
      if (s >= 0) {
        if (last_use[s] != now) ++hits;
        last_use[s] = now;
      } else if (std::find(missing.begin(), missing.end(), int(ids[i])) == missing.end()) {
        missing.push_back(int(ids[i]));
      }
    }
    for (int e : missing) {
      int victim = -1;
      for (int s = 0; s < slots; ++s)
        if (last_use[s] != now && (victim < 0 || last_use[s] < last_use[victim])) victim = s;
      if (victim < 0) fail("layer " + std::to_string(layer) + ": a call routes to more experts than the slots hold");
      if (expert_of[victim] >= 0) slot_of[expert_of[victim]] = -1;
      expert_of[victim] = -1;  // claims nothing until every row landed
      last_use[victim] = now;
      for (int t = 0; t < tensors; ++t) read_row(e, t, bases[t] + size_t(victim) * row_bytes[t]);
      expert_of[victim] = e;
      slot_of[e] = victim;
      ++misses;
    }
    for (size_t i = 0; i < n; ++i) out[i] = uint32_t(slot_of[ids[i]]);
  }
};

class ResolveMisses : public mx::Primitive {
 public:
  ResolveMisses(mx::Stream s, std::shared_ptr<LayerSlots> layer) : mx::Primitive(s), layer_(std::move(layer)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    if (layer_->broken.load()) throw std::runtime_error(layer_->failed());
    auto& ids = inputs[0];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    std::vector<char*> bases;
    for (size_t t = 1; t < inputs.size(); ++t) {
      outputs[t].copy_shared_buffer(inputs[t]);
      bases.push_back(const_cast<char*>(inputs[t].data<char>()));
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(ids);
    enc.set_output_array(out);
    enc.dispatch([ids = mx::array::unsafe_weak_copy(ids), out = mx::array::unsafe_weak_copy(out),
                  bases = std::move(bases), layer = layer_]() mutable {
      layer->resolve(ids.data<uint32_t>(), out.data<uint32_t>(), ids.size(), bases);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("resolve: the miss-path spike runs on the CPU backend only");
  }

  const char* name() const override { return "ResolveMisses"; }

 private:
  std::shared_ptr<LayerSlots> layer_;
};

std::vector<mx::array> resolve(const mx::array& ids, const std::vector<mx::array>& slot_tensors,
                               std::shared_ptr<LayerSlots> layer) {
  if (ids.dtype() != mx::uint32) throw std::invalid_argument("resolve: ids must be uint32");
  if (int(slot_tensors.size()) != layer->tensors) throw std::invalid_argument("resolve: one slot tensor per row size");
  std::vector<mx::Shape> shapes{ids.shape()};
  std::vector<mx::Dtype> dtypes{mx::uint32};
  std::vector<mx::array> inputs{ids};
  for (int t = 0; t < layer->tensors; ++t) {
    auto& a = slot_tensors[t];
    if (a.shape(0) != layer->slots || int64_t(a.nbytes()) != layer->row_bytes[t] * layer->slots)
      throw std::invalid_argument("resolve: slot tensor " + std::to_string(t) + " is not slots x its row size");
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
    inputs.push_back(a);
  }
  auto s = mx::default_stream(mx::default_device());
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), std::make_shared<ResolveMisses>(s, layer),
                                std::move(inputs));
}

}  // namespace

NB_MODULE(_resolve_misses, m) {
  nb::module_::import_("mlx.core");
  nb::class_<LayerSlots>(m, "LayerSlots")
      .def(nb::new_([](int layer, int experts, int slots, std::vector<int64_t> row_bytes, std::vector<int> file_of,
                       std::vector<int64_t> offset_of, std::vector<std::string> paths) {
             return std::make_shared<LayerSlots>(layer, experts, slots, std::move(row_bytes), std::move(file_of),
                                                 std::move(offset_of), std::move(paths));
           }),
           nb::arg("layer"), nb::arg("experts"), nb::arg("slots"), nb::arg("row_bytes"), nb::arg("file_of"),
           nb::arg("offset_of"), nb::arg("paths"))
      .def_prop_ro("slot_of", [](LayerSlots& l) { return l.slot_of; })
      .def_prop_ro("failed", [](LayerSlots& l) { return l.failed(); })
      .def_prop_ro("stats", [](LayerSlots& l) {
        return std::vector<uint64_t>{l.calls, l.hits, l.misses, l.bytes};
      });
  m.def("resolve", &resolve, nb::arg("ids"), nb::arg("slot_tensors"), nb::arg("layer"));
}
