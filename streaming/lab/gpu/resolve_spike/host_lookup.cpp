// Issue 31, stage 2 spike: a primitive between a layer's router and its expert gather,
// `slots = host_lookup(ids, table)`, that maps expert ids to slots through a table the host
// owns, without the calling (Python) thread ever waiting for the device. Lookup only: the spike
// asks what one such round trip costs a layer beside stock's layer, not how a miss is read.
//
// CUDA: the primitive's stream copies the ids into pinned host memory, runs a host function
// (cudaLaunchHostFunc: the lookup, on the driver's thread, no GIL), and copies the slots into
// the output; the device waits for the host, the host never for the device.
// CPU: the lookup runs on the CPU stream's worker, in order with the ops around it.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#ifdef SPIKE_CUDA
#include <cuda_runtime.h>

#include "mlx/backend/cuda/device.h"
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

constexpr size_t RING = 512;  // calls in flight at most (layers x tokens mlx-lm runs ahead)
constexpr size_t MAX_IDS = 1 << 16;

struct SlotTable {
  std::vector<uint32_t> slot_of;
  std::atomic<uint64_t> host_calls{0};
#ifdef SPIKE_CUDA
  // Pinned staging, one entry per call in flight: ids in, slots out, a done flag.
  struct Entry {
    uint32_t* ids = nullptr;
    uint32_t* slots = nullptr;
    size_t n = 0;
    std::atomic<int> busy{0};
    SlotTable* table = nullptr;
  };
  std::vector<Entry> ring = std::vector<Entry>(RING);
  std::atomic<size_t> next{0};
#endif

  explicit SlotTable(std::vector<uint32_t> table) : slot_of(std::move(table)) {
#ifdef SPIKE_CUDA
    for (auto& e : ring) {
      if (cudaMallocHost(&e.ids, MAX_IDS * 4) != cudaSuccess || cudaMallocHost(&e.slots, MAX_IDS * 4) != cudaSuccess)
        throw std::runtime_error("host_lookup: cudaMallocHost failed");
      e.table = this;
    }
#endif
  }

  void lookup(const uint32_t* ids, uint32_t* slots, size_t n) {
    const size_t size = slot_of.size();
    for (size_t i = 0; i < n; ++i) slots[i] = ids[i] < size ? slot_of[ids[i]] : 0;
    host_calls.fetch_add(1, std::memory_order_relaxed);
  }
};

#ifdef SPIKE_CUDA
void CUDART_CB resolve_on_host(void* p) {
  auto* e = static_cast<SlotTable::Entry*>(p);
  e->table->lookup(e->ids, e->slots, e->n);
}

void CUDART_CB release_entry(void* p) {
  static_cast<SlotTable::Entry*>(p)->busy.store(0, std::memory_order_release);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("host_lookup: ") + what + ": " + cudaGetErrorString(err));
}
#endif

class HostLookup : public mx::Primitive {
 public:
  HostLookup(mx::Stream s, std::shared_ptr<SlotTable> table) : mx::Primitive(s), table_(std::move(table)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& ids = inputs[0];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(ids);
    enc.set_output_array(out);
    enc.dispatch([ids = mx::array::unsafe_weak_copy(ids), out = mx::array::unsafe_weak_copy(out),
                  table = table_]() mutable {
      table->lookup(ids.data<uint32_t>(), out.data<uint32_t>(), ids.size());
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
#ifdef SPIKE_CUDA
    auto& ids = inputs[0];
    auto& out = outputs[0];
    if (ids.size() > MAX_IDS) throw std::runtime_error("host_lookup: too many ids in one call");
    auto& entry = table_->ring[table_->next.fetch_add(1) % RING];
    while (entry.busy.exchange(1, std::memory_order_acquire)) {
    }  // a ring entry is reused only after its call's copies ran (never in practice)
    entry.n = ids.size();
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cu::get_command_encoder(stream());
    enc.set_input_array(ids);
    enc.set_output_array(out);
    enc.commit();  // what the encoder queued before runs first, in stream order
    cudaStream_t s = enc.stream();
    check(cudaMemcpyAsync(entry.ids, ids.data<uint32_t>(), ids.nbytes(), cudaMemcpyDefault, s), "ids to host");
    check(cudaLaunchHostFunc(s, resolve_on_host, &entry), "host function");
    check(cudaMemcpyAsync(out.data<uint32_t>(), entry.slots, out.nbytes(), cudaMemcpyDefault, s), "slots to device");
    check(cudaLaunchHostFunc(s, release_entry, &entry), "release");
    enc.add_temporary(ids);
    enc.add_temporary(out);
#else
    throw std::runtime_error("host_lookup: built without CUDA");
#endif
  }

  const char* name() const override { return "HostLookup"; }

 private:
  std::shared_ptr<SlotTable> table_;
};

mx::array host_lookup(const mx::array& ids, std::shared_ptr<SlotTable> table) {
  if (ids.dtype() != mx::uint32) throw std::invalid_argument("host_lookup: ids must be uint32");
  auto s = mx::default_stream(mx::default_device());
  return mx::array(ids.shape(), mx::uint32, std::make_shared<HostLookup>(s, std::move(table)), {ids});
}

}  // namespace

NB_MODULE(_host_lookup, m) {
  nb::module_::import_("mlx.core");
  nb::class_<SlotTable>(m, "SlotTable")
      .def(nb::new_([](std::vector<uint32_t> table) { return std::make_shared<SlotTable>(std::move(table)); }))
      .def_prop_ro("host_calls", [](SlotTable& t) { return t.host_calls.load(); });
  m.def("host_lookup", &host_lookup, nb::arg("ids"), nb::arg("table"));
}
