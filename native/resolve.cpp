// The native decode path (`decode_path: native`, streaming/native_decode.py): a primitive between
// a streamed layer's router and its expert gather. `resolve(ids, slot tensors, table)` maps a
// decode token's expert ids to slots and, where an expert is in no slot, reads its rows from the
// shard into the slot memory of the least recently used expert the call does not use, all inside
// the graph's evaluation: the Python thread builds the token as stock does and never waits for
// the routing. CPU backend only: the resolution runs on the CPU stream's worker in stream order,
// so no slot is refilled while a gather queued before it still reads it.
//
// The table is the layer's ExpertCache state itself (numpy arrays the Python path reads and
// writes too, never while a resolution may run: the Python side settles first). A failed read
// or a changed shard throws from the evaluation naming the layer, the shard, the offset and the
// length; the slot it was filling claims no expert, and every later call of the layer fails the
// same way until the model is reloaded.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

constexpr int32_t EMPTY = -1;
// Counters the Python side folds into the layer's LayerStats.
enum Count { CALLS, HITS, MISSES, EVICTIONS, BYTES, READ_NS, DEMAND_CALLS, NUM_COUNTS };

// The checkpoint's shard files as this path reads them: its own descriptors, checked against the
// identity recorded when the model was indexed (checkpoint.ShardIdentity) before and after reads.
struct Shards {
  struct Identity {
    uint64_t device, inode;
    int64_t size, mtime_ns;
  };
  std::vector<std::string> paths;
  std::vector<Identity> identity;
  std::vector<int> fds;
  bool drop_pages;  // the page cache bypass: drop what a read brought in (posix_fadvise)

  Shards(std::vector<std::string> paths_, std::vector<std::vector<int64_t>> ids, bool drop)
      : paths(std::move(paths_)), drop_pages(drop) {
    if (ids.size() != paths.size()) throw std::invalid_argument("resolve: one identity per shard");
    for (auto& i : ids) {
      if (i.size() != 4) throw std::invalid_argument("resolve: an identity is (device, inode, size, mtime_ns)");
      identity.push_back({uint64_t(i[0]), uint64_t(i[1]), i[2], i[3]});
    }
    for (size_t f = 0; f < paths.size(); ++f) {
      int fd = ::open(paths[f].c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        std::string why = std::strerror(errno);
        close_all();
        throw std::runtime_error("shard " + paths[f] + " cannot be opened: " + why);
      }
#ifdef F_NOCACHE
      if (drop_pages) ::fcntl(fd, F_NOCACHE, 1);
#endif
      fds.push_back(fd);
      std::string why = changed(f, fd);
      if (!why.empty()) {
        close_all();
        throw std::runtime_error(changed_message(f, why));
      }
    }
  }
  ~Shards() { close_all(); }

  void close_all() {
    for (int fd : fds) ::close(fd);
    fds.clear();
  }

  // How the open file (and the path now) differ from the indexed file; "" when they do not.
  std::string changed(size_t f, int fd) const {
    struct stat st;
    if (::fstat(fd, &st) != 0) return std::string("it can no longer be read (") + std::strerror(errno) + ")";
    std::string why = differs(f, st);
    if (!why.empty()) return why;
    if (::stat(paths[f].c_str(), &st) != 0)
      return std::string("it can no longer be opened (") + std::strerror(errno) + ")";
    return differs(f, st);
  }

  std::string differs(size_t f, const struct stat& st) const {
    const Identity& id = identity[f];
    if (uint64_t(st.st_dev) != id.device || uint64_t(st.st_ino) != id.inode) return "it was replaced by another file";
    if (int64_t(st.st_size) != id.size)
      return "its size changed from " + std::to_string(id.size) + " to " + std::to_string(int64_t(st.st_size)) +
             " bytes";
#ifdef __APPLE__
    int64_t mtime = int64_t(st.st_mtimespec.tv_sec) * 1000000000 + st.st_mtimespec.tv_nsec;
#else
    int64_t mtime = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
#endif
    if (mtime != id.mtime_ns) return "it was modified";
    return "";
  }

  std::string changed_message(size_t f, const std::string& why) const {
    return "shard " + paths[f] + " changed on disk since the model was loaded (" + why +
           "); its experts can no longer be read consistently, so this model stops here: reload it";
  }
};

// One streamed layer's slot table and where each expert's rows are in the shards.
struct LayerTable {
  std::string name;
  int experts, slots, tensors;
  int32_t* slot_of;    // expert -> slot, EMPTY when in none (ExpertCache.slot_of)
  int32_t* expert_in;  // slot -> expert, EMPTY when empty (ExpertCache.expert_in)
  double* stamp;       // expert -> recency, larger is more recent (LRUPolicy.stamp)
  double* clock;       // [the policy's clock]
  uint64_t* counts;    // NUM_COUNTS counters
  // (the numpy arrays these point into are kept alive by the Python side, which holds no
  // Python object here: a table's last reference may drop on the stream's worker, GIL-less)
  std::vector<int64_t> row_bytes;  // tensor -> bytes of one expert's row
  std::vector<int32_t> file_of;    // (expert, tensor) -> shard
  std::vector<int64_t> offset_of;  // (expert, tensor) -> byte offset in the shard
  std::shared_ptr<Shards> shards;
  std::vector<int32_t> needed;  // scratch of one call (the stream's worker is the only user)
  std::vector<char> mark;
  std::atomic<bool> broken{false};
  std::mutex failed_mtx;
  std::string failed_why;

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
    const int f = file_of[at];
    const int64_t offset = offset_of[at], length = row_bytes[tensor];
    const int fd = shards->fds[f];
    int64_t done = 0;
    while (done < length) {
      ssize_t got = ::pread(fd, dst + done, size_t(length - done), offset + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        fail(name + ": reading expert " + std::to_string(expert) + " from " + shards->paths[f] + " at offset " +
             std::to_string(offset) + ", length " + std::to_string(length) + ": " +
             (got == 0 ? std::string("the shard ends early") : std::string(std::strerror(errno))));
      done += got;
    }
#ifdef POSIX_FADV_DONTNEED
    if (shards->drop_pages) ::posix_fadvise(fd, offset, length, POSIX_FADV_DONTNEED);
#endif
    std::string why = shards->changed(size_t(f), fd);
    if (!why.empty()) fail(name + ": " + shards->changed_message(size_t(f), why));
    counts[BYTES] += uint64_t(length);
  }

  // One decode call: ids -> slots, the misses read into LRU victims the call does not use, in
  // the Python path's order (cache.access, then place and claim), so both keep one LRU.
  void resolve(const uint32_t* ids, uint32_t* out, size_t n, const std::vector<char*>& bases) {
    if (broken.load()) throw std::runtime_error(failed());
    needed.clear();
    mark.assign(size_t(experts), 0);
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] >= uint32_t(experts))
        fail(name + ": expert id " + std::to_string(ids[i]) + " out of range (" + std::to_string(experts) +
             " experts)");
      mark[ids[i]] = 1;
    }
    for (int e = 0; e < experts; ++e)
      if (mark[e]) needed.push_back(e);
    const int k = int(needed.size());
    if (k > slots) fail(name + ": a decode call routes to more experts than the layer has slots");
    // on_access: the first (lowest) id becomes the most recent
    for (int j = 0; j < k; ++j) stamp[needed[j]] = *clock + double(k - j);
    *clock += double(k);
    counts[CALLS] += 1;
    const uint64_t misses_before = counts[MISSES];
    for (int e : needed) {
      if (slot_of[e] != EMPTY) {
        counts[HITS] += 1;
        continue;
      }
      int slot = -1;
      for (int s = 0; s < slots && slot < 0; ++s)
        if (expert_in[s] == EMPTY) slot = s;
      if (slot < 0) {  // evict the least recent resident expert this call does not use
        for (int s = 0; s < slots; ++s) {
          const int r = expert_in[s];
          if (!mark[r] && (slot < 0 || stamp[r] < stamp[expert_in[slot]])) slot = s;
        }
        if (slot < 0) fail(name + ": no slot to evict for a miss");
        slot_of[expert_in[slot]] = EMPTY;
        expert_in[slot] = EMPTY;  // claims nothing until every row landed
        counts[EVICTIONS] += 1;
      }
      const auto t0 = std::chrono::steady_clock::now();
      for (int t = 0; t < tensors; ++t) read_row(e, t, bases[t] + size_t(slot) * size_t(row_bytes[t]));
      counts[READ_NS] += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::steady_clock::now() - t0)
                                      .count());
      expert_in[slot] = e;
      slot_of[e] = slot;
      *clock += 1.0;  // on_insert: more recent than the call's hits
      stamp[e] = *clock;
      counts[MISSES] += 1;
    }
    if (counts[MISSES] != misses_before) counts[DEMAND_CALLS] += 1;
    for (size_t i = 0; i < n; ++i) out[i] = uint32_t(slot_of[ids[i]]);
  }
};

template <typename T>
T* data_of(nb::ndarray<T, nb::c_contig, nb::device::cpu>& a, size_t size, const char* what) {
  if (a.size() != size) throw std::invalid_argument(std::string("resolve: ") + what + " has the wrong size");
  return a.data();
}

// What Python holds: plain C++ shared pointers inside. (A shared_ptr nanobind makes from a Python
// object releases it under the GIL; a table's last copy may drop on the stream's worker while
// the Python thread waits for that worker, GIL held.)
struct ShardsHandle {
  std::shared_ptr<Shards> shards;
};
struct TableHandle {
  std::shared_ptr<LayerTable> table;
};

void make_table(TableHandle* self, std::string name, nb::ndarray<int32_t, nb::c_contig, nb::device::cpu> slot_of,
                nb::ndarray<int32_t, nb::c_contig, nb::device::cpu> expert_in,
                nb::ndarray<double, nb::c_contig, nb::device::cpu> stamp,
                nb::ndarray<double, nb::c_contig, nb::device::cpu> clock,
                nb::ndarray<uint64_t, nb::c_contig, nb::device::cpu> counts, std::vector<int64_t> row_bytes,
                std::vector<int32_t> file_of, std::vector<int64_t> offset_of, const ShardsHandle& shards) {
  auto t = std::make_shared<LayerTable>();
  t->name = std::move(name);
  t->experts = int(slot_of.size());
  t->slots = int(expert_in.size());
  t->tensors = int(row_bytes.size());
  t->slot_of = data_of(slot_of, size_t(t->experts), "slot_of");
  t->expert_in = data_of(expert_in, size_t(t->slots), "expert_in");
  t->stamp = data_of(stamp, size_t(t->experts), "stamp");
  t->clock = data_of(clock, 1, "clock");
  t->counts = data_of(counts, NUM_COUNTS, "counts");
  if (file_of.size() != size_t(t->experts) * t->tensors || offset_of.size() != file_of.size())
    throw std::invalid_argument("resolve: the row table is not experts x tensors");
  for (int32_t f : file_of)
    if (f < 0 || size_t(f) >= shards.shards->fds.size()) throw std::invalid_argument("resolve: a row names no shard");
  t->row_bytes = std::move(row_bytes);
  t->file_of = std::move(file_of);
  t->offset_of = std::move(offset_of);
  t->shards = shards.shards;
  new (self) TableHandle{std::move(t)};
}

class Resolve : public mx::Primitive {
 public:
  Resolve(mx::Stream s, std::shared_ptr<LayerTable> table) : mx::Primitive(s), table_(std::move(table)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& ids = inputs[0];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    std::vector<char*> bases;
    for (size_t t = 1; t < inputs.size(); ++t) {
      outputs[t].copy_shared_buffer(inputs[t]);  // the slot tensors again: the gathers wait for us
      bases.push_back(const_cast<char*>(inputs[t].data<char>()));
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([ids = mx::array::unsafe_weak_copy(ids), out = mx::array::unsafe_weak_copy(out),
                  bases = std::move(bases), table = table_]() mutable {
      uint32_t* slots = out.data<uint32_t>();
      try {
        table->resolve(ids.data<uint32_t>(), slots, ids.size(), bases);
      } catch (...) {
        // The evaluation fails; the gathers queued behind still run: give them slots in range.
        std::fill(slots, slots + out.size(), 0u);
        throw;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("the native decode path runs on MLX's CPU backend only");
  }

  const char* name() const override { return "ExpertStreamResolve"; }

 private:
  std::shared_ptr<LayerTable> table_;
};

std::vector<mx::array> resolve(const mx::array& ids, const std::vector<mx::array>& slot_tensors,
                               const TableHandle& handle) {
  const std::shared_ptr<LayerTable>& table = handle.table;
  if (ids.dtype() != mx::uint32) throw std::invalid_argument("resolve: ids must be uint32");
  if (int(slot_tensors.size()) != table->tensors) throw std::invalid_argument("resolve: one slot tensor per row size");
  std::vector<mx::Shape> shapes{ids.shape()};
  std::vector<mx::Dtype> dtypes{mx::uint32};
  std::vector<mx::array> inputs{ids};
  for (int t = 0; t < table->tensors; ++t) {
    auto& a = slot_tensors[t];
    if (a.ndim() < 1 || a.shape(0) != table->slots || int64_t(a.nbytes()) != table->row_bytes[t] * table->slots)
      throw std::invalid_argument("resolve: slot tensor " + std::to_string(t) + " is not slots x its row size");
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
    inputs.push_back(a);
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), std::make_shared<Resolve>(s, table),
                                std::move(inputs));
}

}  // namespace

NB_MODULE(_resolve, m) {
  nb::module_::import_("mlx.core");
  nb::class_<ShardsHandle>(m, "Shards")
      .def(
          "__init__",
          [](ShardsHandle* self, std::vector<std::string> paths, std::vector<std::vector<int64_t>> identities,
             bool drop_pages) {
            new (self) ShardsHandle{std::make_shared<Shards>(std::move(paths), std::move(identities), drop_pages)};
          },
          nb::arg("paths"), nb::arg("identities"), nb::arg("drop_pages"));
  nb::class_<TableHandle>(m, "LayerTable")
      .def("__init__", &make_table, nb::arg("name"), nb::arg("slot_of"), nb::arg("expert_in"), nb::arg("stamp"),
           nb::arg("clock"), nb::arg("counts"), nb::arg("row_bytes"), nb::arg("file_of"), nb::arg("offset_of"),
           nb::arg("shards"))
      .def_prop_ro("failed", [](TableHandle& h) { return h.table->failed(); });
  m.attr("NUM_COUNTS") = int(NUM_COUNTS);
  m.def("resolve", &resolve, nb::arg("ids"), nb::arg("slot_tensors"), nb::arg("table"));
}
