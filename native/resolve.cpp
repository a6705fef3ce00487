// The native decode path (`decode_path: native`, streaming/native_decode.py): a primitive between
// a streamed layer's router and its expert gather. `resolve(ids, slot tensors, table)` maps a
// decode token's expert ids to slots and, where an expert is in no slot, reads its rows from the
// shard into the slot of a victim the layer's eviction policy chooses (LRU or the default
// panel, streaming/policy.py, on the policy's own arrays; every miss admitted), all inside
// the graph's evaluation: the Python thread builds the token as stock does and never waits for
// the routing. Resolutions run in stream order, so no slot is refilled while a gather queued
// before it still reads it: on the CPU backend on the CPU stream's worker; on CUDA (built with
// EXPERT_STREAM_CUDA) the stream copies the ids into page-locked memory, a host function
// resolves them and reads the misses into page-locked staging, and a kernel (land_rows.cu)
// copies the slots and the rows into place: the device waits for the host, never the reverse.
//
// The table is the layer's ExpertCache and policy state itself (numpy arrays the Python path reads and
// writes too, never while a resolution may run: the Python side drains first). A failed read
// or a changed shard fails the evaluation naming the layer, the shard, the offset and the
// length (on CUDA it is set on the evaluation's event, so the wait for the token raises); the
// slot it was filling claims no expert, and every later call of the layer fails the same way
// until the model is reloaded.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#ifdef EXPERT_STREAM_CUDA
#include <cuda_runtime.h>

#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/event.h"
#include "mlx/backend/cuda/utils.h"

// land_rows.cu: the copies a resolution planned, made on the device in stream order.
extern "C" cudaError_t expert_stream_land(const void* moves, const uint32_t* count, uint32_t max_moves,
                                          cudaStream_t stream);
#endif

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

// A layer's eviction policy (streaming/policy.py) on the policy object's own arrays, its Python
// arithmetic step by step, so the Python path and this one make the same decisions on the same
// calls. LRU is the panel's recency member alone; the default (AdaptivePolicy) adds decayed
// counts and windowed counts judged by the points each member earns. The decay factors come
// from Python, computed there as the policy computes them. Every miss is admitted (the
// default's admission needs a scratch buffer for a declined miss: the Python path has one).
struct Panel {
  int experts = 0, members = 1, counts = 0;  // rows: recency, `counts` decayed counts, windowed counts
  std::vector<int> win_rows;                 // windowed member w: the count row (of `counts`) it ranks
  double* key = nullptr;                     // members x experts, row 0 the recency stamps
  double* points = nullptr;                  // members: the judge's points
  double* state = nullptr;                   // [clock, calls, leader, the hit curve's calls]
  std::vector<double> decay;                 // (k - 1) * counts + h: count h's decay for a k-expert call
  std::vector<double> judge;                 // k - 1: the points' decay for a k-expert call
  double window = 0;
  int kth = 0, judge_every = 1;
  bool judging = false;
  std::vector<int32_t> pending;  // inserts placed before any access (warm start): after the next one
  std::vector<double> row;       // scratch of the judge
  std::vector<std::pair<double, double>> by;  // scratch of victims: (rank, stamp) by expert
  static constexpr double BIG = 1e12;

  double* stamp() const { return key; }
  double* member(int m) const { return key + size_t(m) * size_t(experts); }

  // on_access: judge the members on this call, then decay and count, then stamp recency.
  void access(const std::vector<int32_t>& needed) {
    const int k = int(needed.size());
    double& clock = state[0];
    double* st = stamp();
    if (judging && int64_t(state[1]) % judge_every == 0) {
      for (size_t w = 0; w < win_rows.size(); ++w) {
        double* out = member(1 + counts + int(w));
        const double* src = member(1 + win_rows[w]);
        const double since = clock - window;
        for (int e = 0; e < experts; ++e) out[e] = src[e] + (st[e] > since ? BIG : 0.0);
      }
      int leader = 0;
      for (int m = 0; m < members; ++m) {
        const double* r = member(m);
        row.assign(r, r + experts);
        std::nth_element(row.begin(), row.begin() + kth, row.end());
        const double th = row[size_t(kth)];
        int inside = 0;
        for (int e : needed) inside += r[e] >= th;
        points[m] *= judge[size_t(k - 1)];
        points[m] += double(inside);
        if (points[m] > points[leader]) leader = m;
      }
      state[2] = double(leader);
    }
    for (int h = 0; h < counts; ++h) {
      double* r = member(1 + h);
      const double d = decay[size_t(k - 1) * size_t(counts) + size_t(h)];
      for (int e = 0; e < experts; ++e) r[e] *= d;
      for (int e : needed) r[e] += 1.0;
    }
    for (int j = 0; j < k; ++j) st[needed[j]] = clock + double(k - j);  // the first (lowest) id: most recent
    clock += double(k);
    state[1] += 1.0;
    if (counts && !(int64_t(state[1]) & 1023))  // keep long-unused counts out of denormals
      for (int h = 0; h < counts; ++h) {
        double* r = member(1 + h);
        for (int e = 0; e < experts; ++e)
          if (r[e] < 1e-200) r[e] = 0.0;
      }
    for (int32_t e : pending) insert(e);
    pending.clear();
  }

  void insert(int e) {  // more recent than the call's hits
    state[0] += 1.0;
    stamp()[e] = state[0];
  }

  // The leading member's ranking of expert e (higher: kept longer); recency for the first.
  double rank(int e) const {
    const int j = int(state[2]);
    if (j <= counts) return member(j)[e];
    return member(1 + win_rows[size_t(j - 1 - counts)])[e] + (stamp()[e] > state[0] - window ? BIG : 0.0);
  }

  // choose_victims: `count` of the candidates (slot order), the lowest ranked, ties least recent.
  void victims(std::vector<int>& cand, size_t count) {
    if (count >= cand.size()) return;
    const double* st = stamp();
    by.resize(size_t(experts));
    for (int e : cand) by[size_t(e)] = {rank(e), st[e]};
    std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return by[size_t(a)] < by[size_t(b)]; });
    cand.resize(count);
  }
};

// The layer's hit curve while online budgets are on (budget.HitCurve, on its arrays): each
// access's LRU stack distance counted, the counts halved every `half_life` calls.
struct Curve {
  double* hist = nullptr;    // experts + 2 (none: no curve)
  int64_t* stamp = nullptr;  // experts: the call that last used each
  double* calls = nullptr;   // in the policy's state
  int64_t half_life = 0;
  std::vector<int> distance;

  void record(const std::vector<int32_t>& needed, int experts) {
    if (hist == nullptr) return;
    distance.clear();
    for (int e : needed) {
      const int64_t st = stamp[e];
      int d = experts + 1;  // first use
      if (st >= 0) {
        d = 1;
        for (int x = 0; x < experts; ++x) d += stamp[x] > st;
      }
      distance.push_back(d);
    }
    for (int d : distance) hist[d] += 1.0;
    *calls += 1.0;
    const int64_t now = int64_t(*calls);
    for (int e : needed) stamp[e] = now;
    if (now % half_life == 0)
      for (int i = 0; i < experts + 2; ++i) hist[i] *= 0.5;
  }
};

// One copy the CUDA landing kernel makes (land_rows.cu has the same layout).
struct Move {
  uint64_t dst, src, bytes;
};

// Where a miss's rows are read: straight into the slot (CPU), or into page-locked staging that
// the landing kernel copies into the slot once the resolution is done (CUDA).
struct Landing {
  std::vector<char*> bases;  // the slot tensors' memory (device addresses on CUDA)
  char* staging = nullptr;   // nullptr: read into the slot itself
  uint64_t staging_device = 0;
  size_t used = 0, capacity = 0;
  Move* moves = nullptr;
  size_t count = 0, max_moves = 0;
  size_t claimed = 0;  // moves of the experts claimed so far: what lands if a later read fails

  static size_t padded(int64_t bytes) { return (size_t(bytes) + 255) & ~size_t(255); }

  char* target(int t, int slot, int64_t bytes) {
    char* slot_row = bases[size_t(t)] + size_t(slot) * size_t(bytes);
    if (staging == nullptr) return slot_row;
    if (used + padded(bytes) > capacity || count >= max_moves)
      throw std::runtime_error("resolve: a call's misses do not fit its staging");  // sized at encode: a bug
    moves[count++] = {uint64_t(slot_row), staging_device + used, uint64_t(bytes)};
    char* at = staging + used;
    used += padded(bytes);  // rows 256-aligned: the kernel copies 16 bytes a thread
    return at;
  }
};

// One streamed layer's slot table and where each expert's rows are in the shards.
struct LayerTable {
  std::string name;
  int experts, slots, tensors;
  int32_t* slot_of;    // expert -> slot, EMPTY when in none (ExpertCache.slot_of)
  int32_t* expert_in;  // slot -> expert, EMPTY when empty (ExpertCache.expert_in)
  Panel policy;
  Curve curve;
  uint64_t* counts;    // NUM_COUNTS counters
  // (the numpy arrays these point into are kept alive by the Python side, which holds no
  // Python object here: a table's last reference may drop on the stream's worker, GIL-less)
  std::vector<int64_t> row_bytes;  // tensor -> bytes of one expert's row
  size_t staged_bytes = 0;         // one expert's rows in CUDA staging, each padded
  std::vector<int32_t> file_of;    // (expert, tensor) -> shard
  std::vector<int64_t> offset_of;  // (expert, tensor) -> byte offset in the shard
  std::shared_ptr<Shards> shards;
  std::vector<int32_t> needed, missing;  // scratch of one call (the stream's worker is the only user)
  std::vector<int> free_slots, victims;
  std::vector<char> mark;
  std::atomic<bool> broken{false};
  std::mutex failed_mtx;
  std::string failed_why;
  // Resolutions queued by evaluations, and those run: `drain` waits until they are equal.
  std::atomic<uint64_t> issued{0};  // counted where the evaluation encodes
  std::atomic<uint64_t> finished{0};
  std::mutex done_mtx;
  std::condition_variable done_cv;
#ifdef EXPERT_STREAM_CUDA
  std::atomic<cudaStream_t> last_stream{nullptr};
#endif

  void ran() {
    {
      std::lock_guard<std::mutex> lk(done_mtx);
      finished.fetch_add(1);
    }
    done_cv.notify_all();
  }

  // Every resolution queued has run, and on CUDA its landing kernel too (called GIL-less).
  void drain() {
    std::unique_lock<std::mutex> lk(done_mtx);
    done_cv.wait(lk, [this] { return finished.load() >= issued; });
    lk.unlock();
#ifdef EXPERT_STREAM_CUDA
    if (cudaStream_t s = last_stream.load()) cudaStreamSynchronize(s);
#endif
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

  // One decode call: ids -> slots, in the Python path's order (cache.access, then the victims
  // chosen once for the call's misses, place and claim), so both make one policy's decisions.
  void resolve(const uint32_t* ids, uint32_t* out, size_t n, Landing& land) {
    if (broken.load()) throw std::runtime_error(failed());
    needed.clear();
    missing.clear();
    mark.assign(size_t(experts), 0);
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] >= uint32_t(experts))
        fail(name + ": expert id " + std::to_string(ids[i]) + " out of range (" + std::to_string(experts) +
             " experts)");
      mark[ids[i]] = 1;
    }
    for (int e = 0; e < experts; ++e)
      if (mark[e]) needed.push_back(e);
    if (int(needed.size()) > slots) fail(name + ": a decode call routes to more experts than the layer has slots");
    policy.access(needed);
    curve.record(needed, experts);
    for (int e : needed)
      if (slot_of[e] == EMPTY) missing.push_back(e);
    counts[CALLS] += 1;
    counts[HITS] += needed.size() - missing.size();
    counts[MISSES] += missing.size();
    if (missing.empty()) {
      for (size_t i = 0; i < n; ++i) out[i] = uint32_t(slot_of[ids[i]]);
      return;
    }
    counts[DEMAND_CALLS] += 1;
    free_slots.clear();
    victims.clear();
    for (int s = 0; s < slots; ++s) {
      if (expert_in[s] == EMPTY)
        free_slots.push_back(s);
      else if (!mark[expert_in[s]])
        victims.push_back(expert_in[s]);  // candidates: residents the call does not use
    }
    const size_t n_free = std::min(free_slots.size(), missing.size());
    const size_t need = missing.size() - n_free;
    if (need) {
      if (victims.size() < need) fail(name + ": no slot to evict for a miss");
      policy.victims(victims, need);
      for (int v : victims) {  // their bytes are about to be overwritten
        free_slots.push_back(slot_of[v]);
        expert_in[slot_of[v]] = EMPTY;
        slot_of[v] = EMPTY;
      }
      counts[EVICTIONS] += need;
    }
    for (int e : missing) policy.insert(e);
    for (size_t j = 0; j < missing.size(); ++j) {
      const int e = missing[j], slot = free_slots[j < n_free ? j : free_slots.size() - need + (j - n_free)];
      const auto t0 = std::chrono::steady_clock::now();
      for (int t = 0; t < tensors; ++t) read_row(e, t, land.target(t, slot, row_bytes[t]));
      counts[READ_NS] += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::steady_clock::now() - t0)
                                      .count());
      expert_in[slot] = e;  // claimed only now that every row landed
      slot_of[e] = slot;
      land.claimed = land.count;
    }
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

using F64 = nb::ndarray<double, nb::c_contig, nb::device::cpu>;

// The policy's arrays (native_decode.panel_of): key (members x experts), points (members), state
// [clock, calls, leader, the hit curve's calls], and the constants of its arithmetic.
Panel make_panel(int experts, F64 key, F64 points, F64 state, int counts, std::vector<int> win_rows,
                 std::vector<double> decay, std::vector<double> judge, double window, int kth, bool judging,
                 int judge_every, std::vector<int32_t> pending) {
  Panel p;
  p.experts = experts;
  p.counts = counts;
  p.members = 1 + counts + int(win_rows.size());
  p.key = data_of(key, size_t(p.members) * size_t(experts), "the policy's keys");
  p.points = data_of(points, size_t(p.members), "the policy's points");
  p.state = data_of(state, 4, "the policy's state");
  for (int w : win_rows)
    if (w < 0 || w >= counts) throw std::invalid_argument("resolve: a windowed member names no count");
  if (decay.size() != size_t(experts) * size_t(counts) || (judging && judge.size() != size_t(experts)))
    throw std::invalid_argument("resolve: one decay factor per call size");
  if (judging && (kth < 0 || kth >= experts || judge_every < 1))
    throw std::invalid_argument("resolve: the judge's threshold is not an expert rank");
  for (int32_t e : pending)
    if (e < 0 || e >= experts) throw std::invalid_argument("resolve: a pending insert names no expert");
  p.win_rows = std::move(win_rows);
  p.decay = std::move(decay);
  p.judge = std::move(judge);
  p.window = window;
  p.kth = kth;
  p.judging = judging;
  p.judge_every = judge_every;
  p.pending = std::move(pending);
  return p;
}

void make_table(TableHandle* self, std::string name, nb::ndarray<int32_t, nb::c_contig, nb::device::cpu> slot_of,
                nb::ndarray<int32_t, nb::c_contig, nb::device::cpu> expert_in, F64 key, F64 points, F64 state,
                int counts_members, std::vector<int> win_rows, std::vector<double> decay, std::vector<double> judge,
                double window, int kth, bool judging, int judge_every, std::vector<int32_t> pending, F64 curve_hist,
                nb::ndarray<int64_t, nb::c_contig, nb::device::cpu> curve_stamp, int64_t curve_half_life,
                nb::ndarray<uint64_t, nb::c_contig, nb::device::cpu> counts, std::vector<int64_t> row_bytes,
                std::vector<int32_t> file_of, std::vector<int64_t> offset_of, const ShardsHandle& shards) {
  auto t = std::make_shared<LayerTable>();
  t->name = std::move(name);
  t->experts = int(slot_of.size());
  t->slots = int(expert_in.size());
  t->tensors = int(row_bytes.size());
  t->slot_of = data_of(slot_of, size_t(t->experts), "slot_of");
  t->expert_in = data_of(expert_in, size_t(t->slots), "expert_in");
  t->policy = make_panel(t->experts, key, points, state, counts_members, std::move(win_rows), std::move(decay),
                         std::move(judge), window, kth, judging, judge_every, std::move(pending));
  if (curve_hist.size()) {
    if (curve_half_life < 1) throw std::invalid_argument("resolve: the hit curve's half-life is not a call count");
    t->curve.hist = data_of(curve_hist, size_t(t->experts) + 2, "the hit curve");
    t->curve.stamp = data_of(curve_stamp, size_t(t->experts), "the hit curve's stamps");
    t->curve.calls = t->policy.state + 3;
    t->curve.half_life = curve_half_life;
  }
  t->counts = data_of(counts, NUM_COUNTS, "counts");
  if (file_of.size() != size_t(t->experts) * t->tensors || offset_of.size() != file_of.size())
    throw std::invalid_argument("resolve: the row table is not experts x tensors");
  for (int32_t f : file_of)
    if (f < 0 || size_t(f) >= shards.shards->fds.size()) throw std::invalid_argument("resolve: a row names no shard");
  t->row_bytes = std::move(row_bytes);
  for (int64_t b : t->row_bytes) t->staged_bytes += Landing::padded(b);
  t->file_of = std::move(file_of);
  t->offset_of = std::move(offset_of);
  t->shards = shards.shards;
  new (self) TableHandle{std::move(t)};
}

#ifdef EXPERT_STREAM_CUDA
void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("resolve: ") + what + ": " + cudaGetErrorString(err));
}

// Page-locked memory the device reads and writes too (mapped: it has a device address).
struct Pinned {
  char* host = nullptr;
  uint64_t device = 0;
  size_t bytes = 0;

  void ensure(size_t want) {  // only while nothing in flight uses it
    if (want <= bytes) return;
    if (host) cudaFreeHost(host);
    host = nullptr;
    bytes = 0;
    void* p = nullptr;
    void* d = nullptr;
    check(cudaHostAlloc(&p, want, cudaHostAllocMapped | cudaHostAllocPortable), "page-locked memory");
    check(cudaHostGetDevicePointer(&d, p, 0), "a device address for page-locked memory");
    host = static_cast<char*>(p);
    device = uint64_t(d);
    bytes = want;
  }
};

struct Lane;

// One CUDA resolution in flight: its ids, slots and planned copies, in page-locked memory.
struct Entry {
  std::atomic<int> busy{0};  // from encode until the next host function of its lane (its kernel ran)
  Lane* lane = nullptr;
  std::shared_ptr<LayerTable> table;
  Pinned ids, slots, moves;  // moves: [count, pad] then the Move list
  Pinned* staging = nullptr;
  size_t n = 0, max_moves = 0;
  uint64_t out = 0;          // the slots output's device address
  std::vector<char*> bases;
  mx::Event event;           // the evaluation's (async): a failure is set on it
  std::atomic<int> done{0};  // for a synchronous evaluation, which waits here
  std::string error;
};

// Resolutions of one MLX stream: its host functions run one at a time in stream order, so one
// staging buffer serves them all (a call's kernel has run before the next call's host function).
struct Lane {
  std::vector<std::unique_ptr<Entry>> ring;
  size_t next = 0;
  Entry* last = nullptr;             // the host functions'
  std::unique_ptr<Pinned> staging;   // the current one; outgrown ones are kept (calls in flight)
  std::vector<std::unique_ptr<Pinned>> outgrown;
  std::mutex mtx;
  std::condition_variable cv;

  Lane() {
    for (int i = 0; i < 1024; ++i) ring.push_back(std::make_unique<Entry>());  // calls in flight at most
  }

  Entry& acquire(size_t n, size_t max_moves, size_t staging_bytes) {
    Entry& e = *ring[next++ % ring.size()];
    while (e.busy.exchange(1, std::memory_order_acquire)) std::this_thread::yield();
    e.lane = this;
    try {
      e.ids.ensure(n * 4);
      e.slots.ensure(n * 4);
      e.moves.ensure(16 + max_moves * sizeof(Move));
      if (!staging || staging->bytes < staging_bytes) {
        if (staging) outgrown.push_back(std::move(staging));
        staging = std::make_unique<Pinned>();
        staging->ensure(std::max<size_t>(staging_bytes, 1 << 20));
      }
    } catch (...) {
      e.busy.store(0);
      throw;
    }
    e.staging = staging.get();
    e.n = n;
    e.max_moves = max_moves;
    e.done.store(0);
    e.error.clear();
    return e;
  }
};

Lane& lane_of(int stream_index) {
  static auto* lanes = new std::unordered_map<int, std::unique_ptr<Lane>>;  // live as long as MLX's streams
  static std::mutex mtx;
  std::lock_guard<std::mutex> lk(mtx);
  auto& lane = (*lanes)[stream_index];
  if (!lane) lane = std::make_unique<Lane>();
  return *lane;
}

// The host function (CUDA's thread, no GIL, no CUDA calls): resolve, read the misses into
// staging, plan the copies. A failure cannot throw here: it is set on the evaluation's event
// (the wait for the token raises it) and the plan copies only slots in range.
void CUDART_CB resolve_on_host(void* p) {
  Entry& e = *static_cast<Entry*>(p);
  Lane& lane = *e.lane;
  if (lane.last && lane.last != &e) lane.last->busy.store(0, std::memory_order_release);
  lane.last = &e;
  LayerTable& t = *e.table;
  uint32_t* slots = reinterpret_cast<uint32_t*>(e.slots.host);
  auto* count = reinterpret_cast<uint32_t*>(e.moves.host);
  auto* moves = reinterpret_cast<Move*>(e.moves.host + 16);
  Landing land;
  land.bases = std::move(e.bases);  // the entry's next use brings its own
  land.staging = e.staging->host;
  land.staging_device = e.staging->device;
  land.capacity = e.staging->bytes;
  land.moves = moves + 1;
  land.max_moves = e.max_moves - 1;
  std::string failure;
  try {
    t.resolve(reinterpret_cast<const uint32_t*>(e.ids.host), slots, e.n, land);
  } catch (const std::exception& x) {
    failure = x.what();
  } catch (...) {
    failure = t.name + ": the resolution failed";
  }
  if (!failure.empty()) {
    std::fill(slots, slots + e.n, 0u);
    land.count = land.claimed;  // the claimed experts' rows land, no other: no slot claims bytes it lacks
    e.error = failure;
    if (e.event.valid()) {
      auto* error = new mx::Error;  // kept: the event holds its address
      error->set_message(std::make_shared<std::string>(failure));
      e.event.cast<mx::cu::EventImpl>().error.store(error);
    }
  }
  moves[0] = {e.out, e.slots.device, uint64_t(e.n) * 4};
  *count = uint32_t(1 + land.count);
  t.ran();
  {
    std::lock_guard<std::mutex> lk(lane.mtx);
    e.done.store(1);
  }
  lane.cv.notify_all();
}
#endif

class Resolve : public mx::Primitive {
 public:
  Resolve(mx::Stream s, std::shared_ptr<LayerTable> table) : mx::Primitive(s), table_(std::move(table)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& ids = inputs[0];
    auto& out = outputs[0];
    contiguous(ids);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    Landing land;
    for (size_t t = 1; t < inputs.size(); ++t) {
      outputs[t].copy_shared_buffer(inputs[t]);  // the slot tensors again: the gathers wait for us
      land.bases.push_back(const_cast<char*>(inputs[t].data<char>()));
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    table_->issued += 1;
    enc.dispatch([ids = mx::array::unsafe_weak_copy(ids), out = mx::array::unsafe_weak_copy(out),
                  land = std::move(land), table = table_]() mutable {
      uint32_t* slots = out.data<uint32_t>();
      try {
        table->resolve(ids.data<uint32_t>(), slots, ids.size(), land);
      } catch (...) {
        // The evaluation fails; the gathers queued behind still run: give them slots in range.
        std::fill(slots, slots + out.size(), 0u);
        table->ran();
        throw;
      }
      table->ran();
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
#ifdef EXPERT_STREAM_CUDA
    LayerTable& t = *table_;
    if (t.broken.load()) throw std::runtime_error(t.failed());
    auto& ids = inputs[0];
    auto& out = outputs[0];
    contiguous(ids);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    std::vector<char*> bases;
    for (size_t i = 1; i < inputs.size(); ++i) {
      outputs[i].copy_shared_buffer(inputs[i]);  // the slot tensors again: the gathers wait for us
      bases.push_back(static_cast<char*>(mx::gpu_ptr<void>(outputs[i])));
    }
    auto& enc = mx::cu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& a : outputs) enc.set_output_array(a);
    const size_t n = ids.size();
    const size_t misses = std::min(n, size_t(t.slots));  // a call's misses at most
    Lane& lane = lane_of(stream().index);
    Entry& e = lane.acquire(n, misses * size_t(t.tensors) + 1, misses * t.staged_bytes);
    e.table = table_;
    e.bases = std::move(bases);
    e.out = uint64_t(mx::gpu_ptr<void>(out));
    e.event = out.event();  // valid in an async evaluation: the one whose wait yields the token
    enc.commit();           // what the encoder queued (the router) runs first, in stream order
    cudaStream_t s = enc.stream();
    t.last_stream.store(s);
    check(cudaMemcpyAsync(e.ids.host, mx::gpu_ptr<void>(ids), n * 4, cudaMemcpyDeviceToHost, s), "ids to the host");
    check(cudaLaunchHostFunc(s, resolve_on_host, &e), "the host function");
    t.issued += 1;  // it will run: drain waits for it
    check(expert_stream_land(reinterpret_cast<const void*>(e.moves.device + 16),
                             reinterpret_cast<const uint32_t*>(e.moves.device), uint32_t(e.max_moves), s),
          "the landing kernel");
    enc.add_temporary(ids);
    enc.add_temporary(out);
    if (!e.event.valid()) {  // a synchronous evaluation: its caller waits anyway; fail it here
      std::unique_lock<std::mutex> lk(lane.mtx);
      lane.cv.wait(lk, [&e] { return e.done.load() != 0; });
      if (!e.error.empty()) throw std::runtime_error(e.error);
    }
#else
    throw std::runtime_error("this build of the native decode path has no GPU half (it was built for the CPU)");
#endif
  }

  const char* name() const override { return "ExpertStreamResolve"; }

 private:
  std::shared_ptr<LayerTable> table_;

  // A decode call's ids are one row (the Python side sends no others): its elements in order.
  static void contiguous(const mx::array& ids) {
    if (!ids.flags().row_contiguous) throw std::runtime_error("resolve: a decode call's expert ids are not one row");
  }
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
  auto s = mx::default_stream(mx::default_device());  // the stream the ops around it run on
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
      .def("__init__", &make_table, nb::arg("name"), nb::arg("slot_of"), nb::arg("expert_in"), nb::arg("key"),
           nb::arg("points"), nb::arg("state"), nb::arg("counts_members"), nb::arg("win_rows"), nb::arg("decay"),
           nb::arg("judge"), nb::arg("window"), nb::arg("kth"), nb::arg("judging"), nb::arg("judge_every"),
           nb::arg("pending"), nb::arg("curve_hist"), nb::arg("curve_stamp"), nb::arg("curve_half_life"),
           nb::arg("counts"), nb::arg("row_bytes"), nb::arg("file_of"), nb::arg("offset_of"),
           nb::arg("shards"))
      .def_prop_ro("failed", [](TableHandle& h) { return h.table->failed(); })
      .def_prop_ro("queued", [](TableHandle& h) { return h.table->issued.load() - h.table->finished.load(); })
      .def("drain", [](TableHandle& h) { h.table->drain(); }, nb::call_guard<nb::gil_scoped_release>());
  m.attr("NUM_COUNTS") = int(NUM_COUNTS);
  m.def("resolve", &resolve, nb::arg("ids"), nb::arg("slot_tensors"), nb::arg("table"));
}
