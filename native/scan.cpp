// The CPU filter tier: what the GPU does in FusionANNS, done on the CPU for
// machines without one. Per query: gather the IDs of the probed posting lists,
// drop duplicates (boundary replication puts a vector in up to 8 lists), score
// each by asymmetric distance computation (ADC) against the query's PQ table,
// and keep the n best. The tables come as one array, or are built per query
// by the scanning thread (scan_topn_pq).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "distance.h"
#include "numpy_out.h"
#include "scan4.h"
#include "scratch_meter.h"
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fusionrag {
namespace {

template <class T>
using Array = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

template <class T>
void check_ndim(const Array<T>& a, size_t ndim, const char* name) {
  if (a.ndim() != ndim)
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(ndim) + "-D, got shape " +
                                shape_of(a));
}

// Posting lists in CSR form. Offsets are checked only for the lists a query
// probes, so a call costs nothing per list it does not touch.
struct Lists {
  const int32_t* probes;  // q x m, -1 = no list
  size_t q, m;
  const int64_t* offsets;  // C + 1
  size_t num_lists;
  const uint32_t* ids;
  size_t total;

  Lists(const Array<int32_t>& probe_lists, const Array<int64_t>& list_offsets, const Array<uint32_t>& list_ids) {
    check_ndim(probe_lists, 2, "probe_lists");
    check_ndim(list_offsets, 1, "list_offsets");
    check_ndim(list_ids, 1, "list_ids");
    if (list_offsets.shape(0) < 1) throw std::invalid_argument("list_offsets must hold C+1 >= 1 entries");
    probes = probe_lists.data();
    q = probe_lists.shape(0);
    m = probe_lists.shape(1);
    offsets = list_offsets.data();
    num_lists = list_offsets.shape(0) - 1;
    ids = list_ids.data();
    total = list_ids.shape(0);
  }

  // The vector id stored at p (a place in ids), checked against the n codes it must index.
  uint32_t id_at(const uint32_t* p, size_t n) const {
    uint32_t id = *p;
    if (id >= n)
      throw std::invalid_argument("list_ids[" + std::to_string(p - ids) + "] = " + std::to_string(id) +
                                  " is out of range for " + std::to_string(n) + " codes");
    return id;
  }

  // Calls fn(begin, end) for each list query i probes.
  template <class Fn>
  void for_each_list(size_t i, Fn&& fn) const {
    for (size_t j = 0; j < m; ++j) {
      int32_t c = probes[i * m + j];
      if (c == -1) continue;
      if (c < 0 || size_t(c) >= num_lists)
        throw std::invalid_argument("probe_lists[" + std::to_string(i) + ", " + std::to_string(j) + "] = " +
                                    std::to_string(c) + " is not a list in [0, " + std::to_string(num_lists) + ")");
      int64_t lo = offsets[c], hi = offsets[c + 1];
      if (lo < 0 || lo > hi || uint64_t(hi) > total)
        throw std::invalid_argument("list_offsets[" + std::to_string(c) + ":" + std::to_string(c + 2) +
                                    "] is not a range inside list_ids (length " + std::to_string(total) + ")");
      fn(ids + lo, ids + hi);
    }
  }
};

// The PQ codes a scan scores, one byte per sub-space.
struct Codes {
  const uint8_t* codes;  // N x M
  size_t M, N;

  Codes(const Array<uint8_t>& code_array, size_t m, const char* tables) : M(m) {
    check_ndim(code_array, 2, "codes");
    if (M == 0 || code_array.shape(1) != M)
      throw std::invalid_argument("codes must have shape (N, " + std::to_string(M) + ") to match " + tables +
                                  ", got " + shape_of(code_array));
    codes = code_array.data();
    N = code_array.shape(0);
  }

  float adc(const float* lut, size_t id) const { return fusionrag::adc(lut, codes + id * M, M); }
};

// Per-query PQ tables given as one array, q x M x 256.
struct LutArray {
  const float* luts;
  size_t M;

  LutArray(const Array<float>& lut_array, size_t q) {
    check_ndim(lut_array, 3, "luts");
    if (lut_array.shape(0) != q || lut_array.shape(2) != kCodebook || lut_array.shape(1) == 0)
      throw std::invalid_argument("luts must have shape (" + std::to_string(q) + ", M, 256), got " +
                                  shape_of(lut_array));
    luts = lut_array.data();
    M = lut_array.shape(1);
  }

  const float* lut(size_t query) const { return luts + query * M * kCodebook; }
};

using AnyArray = nb::ndarray<nb::ro, nb::device::cpu>;

// A float32 C-contiguous array, taken as given: converting would hide a caller's
// wrong dtype and copy a whole batch.
const float* float32_array(const AnyArray& a, size_t ndim, const char* name) {
  if (a.dtype() != nb::dtype<float>()) {
    static const char* kinds[] = {"int", "uint", "float", "bfloat", "complex", "bool"};
    uint8_t code = a.dtype().code;
    throw std::invalid_argument(std::string(name) + " must be float32, got " + (code < 6 ? kinds[code] : "dtype") +
                                std::to_string(a.dtype().bits));
  }
  if (a.ndim() != ndim)
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(ndim) + "-D, got shape " +
                                shape_of(a));
  int64_t step = 1;
  for (size_t i = ndim; i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != step)
      throw std::invalid_argument(std::string(name) + " must be C-contiguous");
    step *= int64_t(a.shape(i));
  }
  return static_cast<const float*>(a.data());
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The codebooks laid out for building tables: M x dsub x 256, so the inner loops run
// across the 256 centroids (independent sums, vector code without -ffast-math), and
// ||c||^2 of every centroid. CpuFilterTier makes one per index; a call given the raw
// (M, 256, dsub) array makes its own, ~0.1 ms of set-up a single query would pay each time.
class PqCodebooks {
 public:
  static constexpr size_t kEntries = kCodebook;
  static constexpr const char* kName = "PqCodebooks";
  size_t M, dsub;
  std::vector<float> columns, norms;

  explicit PqCodebooks(const AnyArray& codebook_array) {
    const float* c = float32_array(codebook_array, 3, "codebooks");
    M = codebook_array.shape(0);
    dsub = codebook_array.shape(2);
    if (M == 0 || dsub == 0 || codebook_array.shape(1) != kCodebook)
      throw std::invalid_argument("codebooks must have shape (M, 256, dsub) with M, dsub >= 1, got " +
                                  shape_of(codebook_array));
    columns.resize(M * dsub * kCodebook);
    for (size_t m = 0; m < M; ++m)  // written in order; the reads stride dsub floats, cache lines reused
      for (size_t d = 0; d < dsub; ++d)
        for (size_t k = 0; k < kCodebook; ++k)
          columns[(m * dsub + d) * kCodebook + k] = c[(m * kCodebook + k) * dsub + d];
    norms.assign(M * kCodebook, 0.0f);
    for (size_t m = 0; m < M; ++m)
      for (size_t d = 0; d < dsub; ++d) {
        const float* col = &columns[(m * dsub + d) * kCodebook];
        float* norm = &norms[m * kCodebook];
        for (size_t k = 0; k < kCodebook; ++k) norm[k] += col[k] * col[k];
      }
  }

  size_t nbytes() const { return (columns.size() + norms.size()) * sizeof(float); }
};

// A call's codebooks: Books (PqCodebooks, Pq4Codebooks) made earlier, or the raw array, laid out for this call.
template <class Books>
struct BooksArg {
  std::optional<Books> own;
  const Books* cb;
  double setup_seconds = 0;  // laying out a raw array

  explicit BooksArg(nb::handle h) {
    if (nb::isinstance<Books>(h)) {
      cb = nb::cast<const Books*>(h);
      return;
    }
    AnyArray raw;
    if (!nb::try_cast(h, raw))
      throw std::invalid_argument(std::string("codebooks must be a float32 (M, ") + std::to_string(Books::kEntries) +
                                  ", dsub) array or a " + Books::kName);
    auto start = Clock::now();
    own.emplace(raw);
    cb = &*own;
    setup_seconds = seconds_since(start);
  }
};
using CodebooksArg = BooksArg<PqCodebooks>;

// Queries of dim dimensions against codebooks of M sub-spaces of dsub (entries centroids each): dsub = ceil(dim / M),
// the dimensions the codebooks were trained for.
void check_query_dim(size_t dim, size_t M, size_t dsub, size_t entries) {
  if (dim > M * dsub || dim <= M * (dsub - 1))
    throw std::invalid_argument("queries have dimension " + std::to_string(dim) + ", but codebooks of shape (" +
                                std::to_string(M) + ", " + std::to_string(entries) + ", " + std::to_string(dsub) +
                                ") are for dimensions " + std::to_string(M * (dsub - 1) + 1) + ".." +
                                std::to_string(M * dsub));
}

// ids (q x n, -1 for none) are vector ids of n_codes codes.
void check_ids(const int64_t* id, size_t q, size_t n, size_t n_codes) {
  for (size_t i = 0; i < q * n; ++i)
    if (id[i] < -1 || id[i] >= int64_t(n_codes))
      throw std::invalid_argument("ids[" + std::to_string(i / std::max<size_t>(n, 1)) + ", " +
                                  std::to_string(i % std::max<size_t>(n, 1)) + "] = " + std::to_string(id[i]) +
                                  " is out of range for " + std::to_string(n_codes) + " codes");
}

// Builds each query's PQ table as ProductQuantizer.luts does (the query zero-padded to
// M * dsub; l2: ||q||^2 - 2 q.c + ||c||^2 per sub-space, ip: -q.c).
class LutBuilder {
 public:
  size_t q, dim, M, dsub;

  LutBuilder(const AnyArray& query_array, const PqCodebooks& cb, const std::string& metric)
      : M(cb.M), dsub(cb.dsub), cb_(cb) {
    ip_ = parse_metric(metric) == Metric::IP;
    queries_ = float32_array(query_array, 2, "queries");
    q = query_array.shape(0);
    dim = query_array.shape(1);
    check_query_dim(dim, M, dsub, kCodebook);
  }

  // Writes the M x 256 table of query i to lut; padded is scratch of M * dsub floats.
  void build(size_t i, float* lut, float* padded) const {
    const float* x = queries_ + i * dim;
    std::copy(x, x + dim, padded);
    std::fill(padded + dim, padded + M * dsub, 0.0f);
    pq_table(padded, cb_.columns.data(), ip_ ? nullptr : cb_.norms.data(), M, dsub, lut);
  }

 private:
  bool ip_;
  const float* queries_;
  const PqCodebooks& cb_;
};

// (distance, id) packed into one integer whose order is distance first, then
// id: selection and sorting become plain integer compares with the tie rule built in.
uint64_t rank_key(float d, uint32_t id) {
  uint32_t u;
  d += 0.0f;  // -0 -> +0, so equal distances tie
  std::memcpy(&u, &d, 4);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // IEEE order as unsigned order
  return (uint64_t(u) << 32) | id;
}

float key_distance(uint64_t key) {
  uint32_t u = uint32_t(key >> 32);
  u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
  float d;
  std::memcpy(&d, &u, 4);
  return d;
}

// State kept per thread between calls (thread-local, since two Python threads
// may scan at once). The seen-bitmap costs N/8 bytes and must start all zero,
// which is cheaper to restore after each query than to allocate.
struct ScanScratch {
  std::vector<uint64_t> seen;  // bit id set: id already a candidate of this query
  std::vector<std::pair<const uint32_t*, const uint32_t*>> ranges;  // the probed lists
  std::vector<uint32_t> unique;
  std::vector<uint64_t> keys;
  std::vector<float> lut, padded;  // the table of the query this thread scans, and its zero-padded query
  ScratchMeter meter;              // its bytes in native.scratch_bytes()

  size_t bytes() const { return capacity_bytes(seen, ranges, unique, keys, lut, padded); }

  // Not inlined: seen through an inlined accessor, GCC re-derives the
  // thread-local address after every call in the scan loop.
  __attribute__((noinline)) static ScanScratch& local(size_t n_codes) {
    thread_local ScanScratch s;
    if (s.seen.size() * 64 < n_codes) s.seen.resize((n_codes + 63) / 64, 0);
    return s;
  }
};


// What a scan returns: rows of n ids and distances, two counts and the seconds of each query.
struct ScanOut {
  size_t q, n;
  std::unique_ptr<int64_t[]> ids;
  std::unique_ptr<float[]> dists;
  std::unique_ptr<int64_t[]> counts;
  std::unique_ptr<double[]> seconds;

  ScanOut(size_t queries, int64_t top) : q(queries), n(top > 0 ? size_t(top) : 0) {
    if (top <= 0) throw std::invalid_argument("n must be positive, got " + std::to_string(top));
    ids = std::make_unique<int64_t[]>(q * n);
    dists = std::make_unique<float[]>(q * n);
    counts = std::make_unique<int64_t[]>(q * 2);
    seconds = std::make_unique<double[]>(q);
  }

  auto release() {
    return std::make_tuple(to_numpy(std::move(ids), {q, n}), to_numpy(std::move(dists), {q, n}),
                           to_numpy(std::move(counts), {q, size_t(2)}), to_numpy(std::move(seconds), {q}));
  }
};

const uint8_t* exclude_bitmap(const std::optional<Array<uint8_t>>& exclude, size_t n_codes) {
  if (!exclude) return nullptr;
  check_ndim(*exclude, 1, "exclude");
  if (exclude->shape(0) != (n_codes + 7) / 8)
    throw std::invalid_argument("exclude must be a bitmap of ceil(N/8) = " + std::to_string((n_codes + 7) / 8) +
                                " bytes, got " + std::to_string(exclude->shape(0)));
  return exclude->data();
}

// Unmarks exactly the words of s.seen a query touched, also when a bad id throws: a word is cleared whole, every
// bit set in it belonging to an id in s.unique.
struct Unmark {
  ScanScratch& s;
  ~Unmark() {
    for (uint32_t id : s.unique) s.seen[id >> 6] = 0;
  }
};

// Query i's candidates (scan_query's, scan_query4's): the ids of the lists it probes, de-duplicated and less the
// excluded ones, in s.unique in the order the lists give them; gathered: how many the lists held, duplicates
// counted. Their bits in s.seen are cleared when it ends (unmark, made first, so also when the gathering throws).
struct QueryIds {
  Unmark unmark;
  int64_t gathered = 0;

  QueryIds(ScanScratch& s, size_t i, const Lists& lists, size_t n_codes, const uint8_t* exclude) : unmark{s} {
    s.unique.clear();
    // Lists lie scattered in memory: find and prefetch them all before reading any.
    s.ranges.clear();
    lists.for_each_list(i, [&](const uint32_t* begin, const uint32_t* end) {
      __builtin_prefetch(begin);
      s.ranges.emplace_back(begin, end);
      gathered += end - begin;
    });
    for (auto [begin, end] : s.ranges) {
      for (const uint32_t* p = begin; p != end; ++p) {
        uint32_t id = lists.id_at(p, n_codes);
        if (exclude && (exclude[id >> 3] >> (id & 7) & 1)) continue;
        uint64_t& word = s.seen[id >> 6];
        uint64_t bit = uint64_t(1) << (id & 63);
        if (word & bit) continue;
        word |= bit;
        s.unique.push_back(id);
      }
    }
  }
};

void scan_query(size_t i, const Lists& lists, const Codes& pq, const float* lut, const uint8_t* exclude,
                ScanOut& out) {
  ScanScratch& s = ScanScratch::local(pq.N);
  SettleOnExit<ScanScratch> settle{s};
  QueryIds candidates(s, i, lists, pq.N, exclude);
  const int64_t gathered = candidates.gathered;

  size_t u = s.unique.size();
  s.keys.resize(u);
  constexpr size_t kAhead = 16;  // codes are scattered in memory; fetch them early
  for (size_t j = 0; j < u; ++j) {
    if (j + kAhead < u) __builtin_prefetch(pq.codes + size_t(s.unique[j + kAhead]) * pq.M);
    s.keys[j] = rank_key(pq.adc(lut, s.unique[j]), s.unique[j]);
  }
  size_t n = out.n, keep = std::min(n, u);
  std::nth_element(s.keys.begin(), s.keys.begin() + keep, s.keys.end());
  std::sort(s.keys.begin(), s.keys.begin() + keep);

  for (size_t j = 0; j < n; ++j) {
    out.ids[i * n + j] = j < keep ? int64_t(uint32_t(s.keys[j])) : -1;
    out.dists[i * n + j] = j < keep ? key_distance(s.keys[j]) : std::numeric_limits<float>::infinity();
  }
  out.counts[2 * i] = gathered;
  out.counts[2 * i + 1] = int64_t(u);
}

auto scan_topn(Array<float> luts, Array<int32_t> probe_lists, Array<int64_t> list_offsets, Array<uint32_t> list_ids,
               Array<uint8_t> codes, int64_t n, int num_threads, std::optional<Array<uint8_t>> exclude) {
  Lists lists(probe_lists, list_offsets, list_ids);
  LutArray tables(luts, lists.q);
  Codes pq(codes, tables.M, "luts");
  ScanOut out(lists.q, n);
  const uint8_t* excluded = exclude_bitmap(exclude, pq.N);
  size_t threads = pool_threads(num_threads);
  {
    nb::gil_scoped_release unlocked;
    ThreadPool::instance().parallel_for(lists.q, threads, [&](size_t i, size_t) {
      auto start = Clock::now();
      scan_query(i, lists, pq, tables.lut(i), excluded, out);
      out.seconds[i] = seconds_since(start);
    });
  }
  return out.release();
}

// The batch plan (Aether's S2): a group of queries that share posting lists is scanned
// list by list, not query by query. Each distinct list of the group is read once; each
// of its codes is loaded once and scored against the table of every query of the group
// that probes the list. What each query gets is what scan_query gives it: the same
// gathered and unique counts, the same keys, so the same top-n. De-duplication stays per
// query: a mask of a bit per query of the group, per vector, says which queries already hold it
// (N bytes per scanning thread, kept between calls). Off by default: not faster on the CPU
// (bench/results/pipeline/batch_plan.md).
using PlanMask = uint8_t;                             // a bit per query of a group (8: half the
constexpr size_t kPlanGroup = 8 * sizeof(PlanMask);  // mask memory of 16)
constexpr size_t kPlanTableBytes = 1 << 20;          // the group's tables held at once, at most

struct PlanScratch {
  std::vector<PlanMask> mask;  // per vector: the group's queries that hold it; all zero between groups
  std::vector<uint32_t> touched;
  std::vector<std::pair<int32_t, uint32_t>> pairs;  // (list, query of the group)
  std::vector<std::pair<uint64_t, PlanMask>> runs;   // (order key, queries asking) per distinct list
  std::vector<std::pair<uint32_t, PlanMask>> entries;  // (id, queries of the group that score it)
  std::vector<uint64_t> keys[kPlanGroup];
  std::vector<float> luts, padded;
  ScratchMeter meter;  // its bytes in native.scratch_bytes()

  size_t bytes() const {
    size_t b = capacity_bytes(mask, touched, pairs, runs, entries, luts, padded);
    for (const auto& k : keys) b += capacity_bytes(k);
    return b;
  }

  __attribute__((noinline)) static PlanScratch& local(size_t n_codes) {
    thread_local PlanScratch s;
    if (s.mask.size() < n_codes) s.mask.resize(n_codes, 0);
    return s;
  }
};

// Scans queries order[0..g) (g <= kPlanGroup) as one group; their tables are built here.
void scan_group(const uint32_t* order, size_t g, const Lists& lists, const Codes& pq, const LutBuilder& builder,
                const uint8_t* exclude, double shared, ScanOut& out, double* lut_seconds) {
  auto t0 = Clock::now();
  PlanScratch& s = PlanScratch::local(pq.N);
  SettleOnExit<PlanScratch> settle{s};
  size_t table = builder.M * kCodebook;
  s.luts.resize(g * table);
  s.padded.resize(builder.M * builder.dsub);
  for (size_t k = 0; k < g; ++k) builder.build(order[k], s.luts.data() + k * table, s.padded.data());
  auto t1 = Clock::now();

  s.touched.clear();
  struct Unmark {  // also when a bad id throws
    PlanScratch& s;
    ~Unmark() {
      for (uint32_t id : s.touched) s.mask[id] = 0;
    }
  } unmark{s};
  s.pairs.clear();
  int64_t gathered[kPlanGroup] = {};
  for (size_t k = 0; k < g; ++k) {
    s.keys[k].clear();
    size_t i = order[k];
    // Validates the query's probes as scan_query does.
    lists.for_each_list(i, [&](const uint32_t* begin, const uint32_t* end) { gathered[k] += end - begin; });
    for (size_t j = 0; j < lists.m; ++j) {
      int32_t c = lists.probes[i * lists.m + j];
      if (c >= 0) s.pairs.emplace_back(c, uint32_t(k));
    }
  }
  std::sort(s.pairs.begin(), s.pairs.end());
  // The group's distinct lists, each with the queries asking for it: the shared ones first, in list order;
  // then the lists only one query asks for, query by query, so that its table stays in cache.
  s.runs.clear();
  for (size_t a = 0; a < s.pairs.size();) {
    int32_t c = s.pairs[a].first;
    PlanMask asking = 0;
    for (; a < s.pairs.size() && s.pairs[a].first == c; ++a) asking |= PlanMask(1u << s.pairs[a].second);
    bool shared = asking & (asking - 1);
    uint64_t key = shared ? uint64_t(c) : (uint64_t(1) << 63) | (uint64_t(__builtin_ctz(asking)) << 32) | uint32_t(c);
    s.runs.emplace_back(key, asking);
  }
  std::sort(s.runs.begin(), s.runs.end());
  // First the ids, de-duplicated per query (lists are short and scattered: prefetch a few runs ahead),
  // then the codes, each loaded once for all its asking queries (prefetched ahead, as scan_query does).
  s.entries.clear();
  constexpr size_t kRunsAhead = 4, kAhead = 16;
  for (size_t r = 0; r < s.runs.size(); ++r) {
    if (r + kRunsAhead < s.runs.size())
      __builtin_prefetch(lists.ids + lists.offsets[uint32_t(s.runs[r + kRunsAhead].first)]);
    auto [key, asking] = s.runs[r];
    int32_t c = int32_t(uint32_t(key));
    const uint32_t* begin = lists.ids + lists.offsets[c];
    const uint32_t* end = lists.ids + lists.offsets[c + 1];
    for (const uint32_t* p = begin; p != end; ++p) {
      uint32_t id = lists.id_at(p, pq.N);
      if (exclude && (exclude[id >> 3] >> (id & 7) & 1)) continue;
      PlanMask held = s.mask[id];
      PlanMask want = asking & PlanMask(~held);
      if (!want) continue;
      if (!held) s.touched.push_back(id);
      s.mask[id] = held | want;
      s.entries.emplace_back(id, want);
    }
  }
  size_t e = s.entries.size();
  for (size_t j = 0; j < e; ++j) {
    if (j + kAhead < e) __builtin_prefetch(pq.codes + size_t(s.entries[j + kAhead].first) * pq.M);
    auto [id, want] = s.entries[j];
    const uint8_t* code = pq.codes + size_t(id) * pq.M;
    for (unsigned w = want; w; w &= w - 1) {
      unsigned k = unsigned(__builtin_ctz(w));
      s.keys[k].push_back(rank_key(fusionrag::adc(s.luts.data() + k * table, code, pq.M), id));
    }
  }

  size_t n = out.n;
  for (size_t k = 0; k < g; ++k) {
    size_t i = order[k];
    std::vector<uint64_t>& keys = s.keys[k];
    size_t u = keys.size(), keep = std::min(n, u);
    std::nth_element(keys.begin(), keys.begin() + keep, keys.end());
    std::sort(keys.begin(), keys.begin() + keep);
    for (size_t j = 0; j < n; ++j) {
      out.ids[i * n + j] = j < keep ? int64_t(uint32_t(keys[j])) : -1;
      out.dists[i * n + j] = j < keep ? key_distance(keys[j]) : std::numeric_limits<float>::infinity();
    }
    out.counts[2 * i] = gathered[k];
    out.counts[2 * i + 1] = int64_t(u);
  }
  // A group's time is shared evenly by its queries.
  double build = std::chrono::duration<double>(t1 - t0).count() / double(g), scan = seconds_since(t1) / double(g);
  for (size_t k = 0; k < g; ++k) {
    lut_seconds[order[k]] = build + shared;
    out.seconds[order[k]] = scan;
  }
}

// As scan_topn, but each query's table is built by the thread that scans it, right
// before the scan: threads x one table in memory instead of a whole batch of them.
auto scan_topn_pq(AnyArray queries, nb::handle codebooks, const std::string& metric, Array<int32_t> probe_lists,
                  Array<int64_t> list_offsets, Array<uint32_t> list_ids, Array<uint8_t> codes, int64_t n,
                  int num_threads, std::optional<Array<uint8_t>> exclude, bool batch_plan) {
  CodebooksArg cb(codebooks);
  LutBuilder builder(queries, *cb.cb, metric);
  Lists lists(probe_lists, list_offsets, list_ids);
  if (lists.q != builder.q)
    throw std::invalid_argument("probe_lists has " + std::to_string(lists.q) + " rows for " +
                                std::to_string(builder.q) + " queries");
  Codes pq(codes, builder.M, "codebooks");
  ScanOut out(lists.q, n);
  const uint8_t* excluded = exclude_bitmap(exclude, pq.N);
  size_t threads = pool_threads(num_threads);
  auto lut_seconds = std::make_unique<double[]>(lists.q);
  {
    nb::gil_scoped_release unlocked;
    double shared = lists.q ? cb.setup_seconds / double(lists.q) : 0.0;  // spread over the batch
    // Groups of at most kPlanGroup queries (and kPlanTableBytes of tables), at least one per thread;
    // queries ordered by their nearest list, so that a group's queries share lists.
    size_t group = std::min(kPlanGroup, std::max<size_t>(1, kPlanTableBytes / (builder.M * kCodebook * sizeof(float))));
    group = std::min(group, (lists.q + threads - 1) / std::max<size_t>(threads, 1));
    if (batch_plan && group > 1) {
      std::vector<uint32_t> order(lists.q);
      for (size_t i = 0; i < lists.q; ++i) order[i] = uint32_t(i);
      auto first = [&](uint32_t i) {
        for (size_t j = 0; j < lists.m; ++j)
          if (lists.probes[i * lists.m + j] >= 0) return lists.probes[i * lists.m + j];
        return int32_t(-1);
      };
      std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return first(a) < first(b); });
      size_t groups = (lists.q + group - 1) / group;
      ThreadPool::instance().parallel_for(groups, threads, [&](size_t b, size_t) {
        size_t lo = b * group, g = std::min(group, lists.q - lo);
        scan_group(order.data() + lo, g, lists, pq, builder, excluded, shared, out, lut_seconds.get());
      });
    } else
    ThreadPool::instance().parallel_for(lists.q, threads, [&](size_t i, size_t) {
      auto t0 = Clock::now();
      ScanScratch& s = ScanScratch::local(pq.N);
      s.lut.resize(builder.M * kCodebook);
      s.padded.resize(builder.M * builder.dsub);
      builder.build(i, s.lut.data(), s.padded.data());
      auto t1 = Clock::now();
      scan_query(i, lists, pq, s.lut.data(), excluded, out);
      lut_seconds[i] = std::chrono::duration<double>(t1 - t0).count() + shared;
      out.seconds[i] = seconds_since(t1);
    });
  }
  size_t q = lists.q;
  return std::tuple_cat(out.release(), std::make_tuple(to_numpy(std::move(lut_seconds), {q})));
}

// The tables scan_topn_pq builds, as one array: to check them against ProductQuantizer.luts.
auto pq_luts(AnyArray queries, nb::handle codebooks, const std::string& metric, int num_threads) {
  CodebooksArg cb(codebooks);
  LutBuilder builder(queries, *cb.cb, metric);
  size_t threads = pool_threads(num_threads);
  auto luts = std::make_unique<float[]>(builder.q * builder.M * kCodebook);
  {
    nb::gil_scoped_release unlocked;
    ThreadPool::instance().parallel_for(builder.q, threads, [&](size_t i, size_t) {
      ScanScratch& s = ScanScratch::local(0);
      SettleOnExit<ScanScratch> settle{s};
      std::vector<float>& padded = s.padded;
      padded.resize(builder.M * builder.dsub);
      builder.build(i, luts.get() + i * builder.M * kCodebook, padded.data());
    });
  }
  return to_numpy(std::move(luts), {builder.q, builder.M, kCodebook});
}

// Where each query's ids start in the concatenation of its probed lists (q + 1 entries); validates every
// probe before anything is copied.
std::unique_ptr<int64_t[]> gathered_offsets(const Lists& lists) {
  auto offsets = std::make_unique<int64_t[]>(lists.q + 1);
  for (size_t i = 0; i < lists.q; ++i) {
    int64_t count = 0;
    lists.for_each_list(i, [&](const uint32_t* begin, const uint32_t* end) { count += end - begin; });
    offsets[i + 1] = offsets[i] + count;
  }
  return offsets;
}

void copy_lists(const Lists& lists, const int64_t* offsets, uint32_t* ids, int num_threads) {
  nb::gil_scoped_release unlocked;
  ThreadPool::instance().parallel_for(lists.q, pool_threads(num_threads), [&](size_t i, size_t) {
    uint32_t* dst = ids + offsets[i];
    lists.for_each_list(i, [&](const uint32_t* begin, const uint32_t* end) { dst = std::copy(begin, end, dst); });
  });
}

auto gather(Array<int32_t> probe_lists, Array<int64_t> list_offsets, Array<uint32_t> list_ids, int num_threads) {
  Lists lists(probe_lists, list_offsets, list_ids);
  auto offsets = gathered_offsets(lists);
  size_t total = size_t(offsets[lists.q]);
  auto ids = std::make_unique<uint32_t[]>(total);
  copy_lists(lists, offsets.get(), ids.get(), num_threads);
  return std::make_pair(to_numpy(std::move(ids), {total}), to_numpy(std::move(offsets), {lists.q + 1}));
}

auto gather_offsets(Array<int32_t> probe_lists, Array<int64_t> list_offsets, Array<uint32_t> list_ids) {
  Lists lists(probe_lists, list_offsets, list_ids);
  return to_numpy(gathered_offsets(lists), {lists.q + 1});
}

// gather into a buffer of the caller's (the GPU tier's pinned staging memory): no array made and touched
// for each batch, and no second copy.
auto gather_into(Array<int32_t> probe_lists, Array<int64_t> list_offsets, Array<uint32_t> list_ids,
                 nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> out, int num_threads) {
  Lists lists(probe_lists, list_offsets, list_ids);
  auto offsets = gathered_offsets(lists);
  size_t total = size_t(offsets[lists.q]);
  if (out.shape(0) < total)
    throw std::invalid_argument("out holds " + std::to_string(out.shape(0)) + " ids; the probed lists hold " +
                                std::to_string(total));
  copy_lists(lists, offsets.get(), out.data(), num_threads);
  return to_numpy(std::move(offsets), {lists.q + 1});
}

auto pq_distances(Array<float> luts, Array<int64_t> ids, Array<uint8_t> codes, int num_threads) {
  check_ndim(ids, 2, "ids");
  size_t q = ids.shape(0), n = ids.shape(1);
  LutArray tables(luts, q);
  Codes pq(codes, tables.M, "luts");
  const int64_t* id = ids.data();
  check_ids(id, q, n, pq.N);
  auto dists = std::make_unique<float[]>(q * n);
  // A filter's passing vectors (Index.search_among) lie anywhere in the codes: each code is fetched ahead of its
  // sum, as the scan does, and one query's ids are cut into blocks the threads share (a call is most often one
  // query with thousands of ids, which one thread did alone).
  constexpr size_t kBlock = 4096, kAhead = 16;
  const size_t blocks = (n + kBlock - 1) / kBlock;
  {
    nb::gil_scoped_release unlocked;
    ThreadPool::instance().parallel_for(q * blocks, pool_threads(num_threads), [&](size_t task, size_t) {
      const size_t i = task / blocks, lo = (task % blocks) * kBlock, hi = std::min(n, lo + kBlock);
      const int64_t* row = id + i * n;
      const float* lut = tables.lut(i);
      for (size_t j = lo; j < hi; ++j) {
        if (j + kAhead < hi && row[j + kAhead] >= 0) __builtin_prefetch(pq.codes + size_t(row[j + kAhead]) * pq.M);
        dists[i * n + j] = row[j] < 0 ? std::numeric_limits<float>::infinity() : pq.adc(lut, size_t(row[j]));
      }
    });
  }
  return to_numpy(std::move(dists), {q, n});
}


// ---- 4-bit PQ (scan4.h): the same scan over codes of 16 centroids a sub-space, two a byte ----------------------

// 4-bit codebooks laid out for building tables: M x dsub x 16 and ||c||^2 of every centroid (M x 16).
class Pq4Codebooks {
 public:
  static constexpr size_t kEntries = kCodebook4;
  static constexpr const char* kName = "Pq4Codebooks";
  size_t M, dsub, P;
  std::vector<float> columns, norms;

  explicit Pq4Codebooks(const AnyArray& codebook_array) {
    const float* c = float32_array(codebook_array, 3, "codebooks");
    M = codebook_array.shape(0);
    dsub = codebook_array.shape(2);
    if (M == 0 || M > kMaxM4 || dsub == 0 || codebook_array.shape(1) != kCodebook4)
      throw std::invalid_argument("4-bit codebooks must have shape (M, 16, dsub) with 1 <= M <= " +
                                  std::to_string(kMaxM4) + ", dsub >= 1, got " + shape_of(codebook_array));
    P = (M + 1) / 2;
    columns.resize(M * dsub * kCodebook4);
    norms.assign(M * kCodebook4, 0.0f);
    for (size_t m = 0; m < M; ++m)
      for (size_t d = 0; d < dsub; ++d)
        for (size_t k = 0; k < kCodebook4; ++k) {
          float x = c[(m * kCodebook4 + k) * dsub + d];
          columns[(m * dsub + d) * kCodebook4 + k] = x;
          norms[m * kCodebook4 + k] += x * x;
        }
  }

  size_t nbytes() const { return (columns.size() + norms.size()) * sizeof(float); }
};

using Codebooks4Arg = BooksArg<Pq4Codebooks>;

// A query's 4-bit table, quantized: q8 (2P x 16: a row a sub-space, the rows past M zero), and the float distance
// of a uint16 sum s is base + scale * s. Each sub-space's entries less its least, over one scale (the widest
// sub-space's range / 255), rounded: a sum is within M * scale / 2 of the float table's.
struct Table4 {
  std::vector<float> lut;  // M x 16 floats: l2 ||q_m - c||^2, ip -q_m.c
  std::vector<float> padded, mins;
  std::vector<uint8_t> q8;
  float base = 0, scale = 0;
};

class Lut4Builder {
 public:
  size_t q, dim;
  const Pq4Codebooks& cb;

  Lut4Builder(const AnyArray& query_array, const Pq4Codebooks& codebooks, const std::string& metric)
      : cb(codebooks) {
    ip_ = parse_metric(metric) == Metric::IP;
    queries_ = float32_array(query_array, 2, "queries");
    q = query_array.shape(0);
    dim = query_array.shape(1);
    check_query_dim(dim, cb.M, cb.dsub, kCodebook4);
  }

  // The float table by pq4_table (the query zero-padded to M * dsub, as ProductQuantizer splits it), then its
  // quantization here, in the baseline build: no fused multiply-add, so numpy's float32 arithmetic gives the same.
  void build(size_t i, Table4& t) const {
    const size_t M = cb.M;
    const float* x = queries_ + i * dim;
    t.padded.assign(M * cb.dsub, 0.0f);
    std::copy(x, x + dim, t.padded.begin());
    t.lut.resize(M * kCodebook4);
    pq4_table(t.padded.data(), cb.columns.data(), ip_ ? nullptr : cb.norms.data(), M, cb.dsub, t.lut.data());
    t.q8.assign(2 * cb.P * kCodebook4, 0);
    t.mins.resize(M);
    float widest = 0;
    t.base = 0;
    for (size_t m = 0; m < M; ++m) {
      const float* row = &t.lut[m * kCodebook4];
      float lo = row[0], hi = row[0];
      for (size_t k = 1; k < kCodebook4; ++k) lo = std::min(lo, row[k]), hi = std::max(hi, row[k]);
      t.mins[m] = lo;
      t.base += lo;
      widest = std::max(widest, hi - lo);
    }
    t.scale = widest / 255.0f;
    const float inv = widest > 0 ? 255.0f / widest : 0.0f;
    for (size_t m = 0; m < M; ++m) {
      const float* row = &t.lut[m * kCodebook4];
      for (size_t k = 0; k < kCodebook4; ++k)
        t.q8[m * kCodebook4 + k] = uint8_t(std::min(255.0f, (row[k] - t.mins[m]) * inv + 0.5f));
    }
  }

 private:
  bool ip_;
  const float* queries_;
};

// 4-bit codes, P bytes a vector.
struct Codes4 {
  const uint8_t* codes;
  size_t P, N;

  Codes4(const Array<uint8_t>& code_array, const Pq4Codebooks& cb) : P(cb.P) {
    check_ndim(code_array, 2, "codes");
    if (code_array.shape(1) != P)
      throw std::invalid_argument("4-bit codes must have shape (N, " + std::to_string(P) + ") to match " +
                                  std::to_string(cb.M) + " sub-spaces, got " + shape_of(code_array));
    codes = code_array.data();
    N = code_array.shape(0);
  }
};

struct Scan4Scratch {
  Table4 table;
  std::vector<uint16_t> sums;
  ScratchMeter meter;

  size_t bytes() const { return capacity_bytes(table.lut, table.padded, table.mins, table.q8, sums); }

  __attribute__((noinline)) static Scan4Scratch& local() {
    thread_local Scan4Scratch s;
    return s;
  }
};

// scan_query over 4-bit codes: the same gathering and de-duplication (QueryIds), each unique candidate's sum
// by pq4_sums, the n best by (sum, id), their distances base + scale * sum.
void scan_query4(size_t i, const Lists& lists, const Codes4& pq, const Table4& t, const uint8_t* exclude,
                 ScanOut& out) {
  ScanScratch& s = ScanScratch::local(pq.N);
  SettleOnExit<ScanScratch> settle{s};
  Scan4Scratch& s4 = Scan4Scratch::local();
  SettleOnExit<Scan4Scratch> settle4{s4};
  QueryIds candidates(s, i, lists, pq.N, exclude);
  const int64_t gathered = candidates.gathered;
  const size_t u = s.unique.size();
  s4.sums.resize(u);
  pq4_sums(pq.codes, pq.N, pq.P, s.unique.data(), u, t.q8.data(), s4.sums.data());
  s.keys.resize(u);
  for (size_t j = 0; j < u; ++j) s.keys[j] = (uint64_t(s4.sums[j]) << 32) | s.unique[j];
  size_t n = out.n, keep = std::min(n, u);
  std::nth_element(s.keys.begin(), s.keys.begin() + keep, s.keys.end());
  std::sort(s.keys.begin(), s.keys.begin() + keep);
  for (size_t j = 0; j < n; ++j) {
    out.ids[i * n + j] = j < keep ? int64_t(uint32_t(s.keys[j])) : -1;
    out.dists[i * n + j] =
        j < keep ? t.base + t.scale * float(s.keys[j] >> 32) : std::numeric_limits<float>::infinity();
  }
  out.counts[2 * i] = gathered;
  out.counts[2 * i + 1] = int64_t(u);
}

auto scan_topn_pq4(AnyArray queries, nb::handle codebooks, const std::string& metric, Array<int32_t> probe_lists,
                   Array<int64_t> list_offsets, Array<uint32_t> list_ids, Array<uint8_t> codes, int64_t n,
                   int num_threads, std::optional<Array<uint8_t>> exclude) {
  Codebooks4Arg cb(codebooks);
  Lut4Builder builder(queries, *cb.cb, metric);
  Lists lists(probe_lists, list_offsets, list_ids);
  if (lists.q != builder.q)
    throw std::invalid_argument("probe_lists has " + std::to_string(lists.q) + " rows for " +
                                std::to_string(builder.q) + " queries");
  Codes4 pq(codes, *cb.cb);
  ScanOut out(lists.q, n);
  const uint8_t* excluded = exclude_bitmap(exclude, pq.N);
  auto lut_seconds = std::make_unique<double[]>(lists.q);
  {
    nb::gil_scoped_release unlocked;
    ThreadPool::instance().parallel_for(lists.q, pool_threads(num_threads), [&](size_t i, size_t) {
      auto t0 = Clock::now();
      Table4& t = Scan4Scratch::local().table;
      builder.build(i, t);
      auto t1 = Clock::now();
      scan_query4(i, lists, pq, t, excluded, out);
      lut_seconds[i] = std::chrono::duration<double>(t1 - t0).count();
      out.seconds[i] = seconds_since(t1);
    });
  }
  size_t q = lists.q;
  return std::tuple_cat(out.release(), std::make_tuple(to_numpy(std::move(lut_seconds), {q})));
}

// The tables scan_topn_pq4 builds: (float32 (q, M, 16), uint8 (q, 2P, 16) quantized, base float32 (q),
// scale float32 (q)).
auto pq4_tables(AnyArray queries, nb::handle codebooks, const std::string& metric) {
  Codebooks4Arg cb(codebooks);
  Lut4Builder builder(queries, *cb.cb, metric);
  const size_t q = builder.q, M = cb.cb->M, rows = 2 * cb.cb->P;
  auto luts = std::make_unique<float[]>(q * M * kCodebook4);
  auto q8 = std::make_unique<uint8_t[]>(q * rows * kCodebook4);
  auto base = std::make_unique<float[]>(q), scale = std::make_unique<float[]>(q);
  Table4 t;
  for (size_t i = 0; i < q; ++i) {
    builder.build(i, t);
    std::copy(t.lut.begin(), t.lut.end(), luts.get() + i * M * kCodebook4);
    std::copy(t.q8.begin(), t.q8.end(), q8.get() + i * rows * kCodebook4);
    base[i] = t.base;
    scale[i] = t.scale;
  }
  return std::make_tuple(to_numpy(std::move(luts), {q, M, kCodebook4}), to_numpy(std::move(q8), {q, rows, kCodebook4}),
                         to_numpy(std::move(base), {q}), to_numpy(std::move(scale), {q}));
}

// The uint16 sums of ids' codes under one quantized table, by the kernel isa names ("auto", "avx2", "baseline").
auto pq4_sums_of(Array<uint8_t> q8, Array<uint32_t> ids, Array<uint8_t> codes, const std::string& isa) {
  check_ndim(q8, 2, "q8");
  check_ndim(ids, 1, "ids");
  check_ndim(codes, 2, "codes");
  const size_t P = codes.shape(1), N = codes.shape(0), count = ids.shape(0);
  if (q8.shape(0) != 2 * P || q8.shape(1) != kCodebook4)
    throw std::invalid_argument("q8 must have shape (" + std::to_string(2 * P) + ", 16) for codes of " +
                                std::to_string(P) + " bytes, got " + shape_of(q8));
  for (size_t j = 0; j < count; ++j)
    if (ids.data()[j] >= N)
      throw std::invalid_argument("ids[" + std::to_string(j) + "] is out of range for " + std::to_string(N) + " codes");
  auto sums = std::make_unique<uint16_t[]>(count);
  if (isa == "auto")
    pq4_sums(codes.data(), N, P, ids.data(), count, q8.data(), sums.get());
  else if (!pq4_sums_isa(isa.c_str(), codes.data(), N, P, ids.data(), count, q8.data(), sums.get()))
    throw std::invalid_argument("no " + isa + " kernel here (auto, avx2 where the CPU has it, baseline)");
  return to_numpy(std::move(sums), {count});
}

// pq_distances over 4-bit codes (Index.search_among): each query's table built and quantized here.
auto pq4_distances(AnyArray queries, nb::handle codebooks, const std::string& metric, Array<int64_t> ids,
                   Array<uint8_t> codes, int num_threads) {
  Codebooks4Arg cb(codebooks);
  Lut4Builder builder(queries, *cb.cb, metric);
  check_ndim(ids, 2, "ids");
  Codes4 pq(codes, *cb.cb);
  const size_t q = ids.shape(0), n = ids.shape(1);
  if (q != builder.q)
    throw std::invalid_argument("ids has " + std::to_string(q) + " rows for " + std::to_string(builder.q) +
                                " queries");
  const int64_t* id = ids.data();
  check_ids(id, q, n, pq.N);
  auto dists = std::make_unique<float[]>(q * n);
  std::vector<Table4> tables(q);
  constexpr size_t kBlock = 4096;
  const size_t blocks = (n + kBlock - 1) / kBlock;
  {
    nb::gil_scoped_release unlocked;
    for (size_t i = 0; i < q; ++i) builder.build(i, tables[i]);
    ThreadPool::instance().parallel_for(q * blocks, pool_threads(num_threads), [&](size_t task, size_t) {
      const size_t i = task / blocks, lo = (task % blocks) * kBlock, hi = std::min(n, lo + kBlock);
      const Table4& t = tables[i];
      std::vector<uint32_t> block_ids(hi - lo);
      std::vector<uint16_t> sums(hi - lo);
      size_t count = 0;
      for (size_t j = lo; j < hi; ++j)
        if (id[i * n + j] >= 0) block_ids[count++] = uint32_t(id[i * n + j]);
      pq4_sums(pq.codes, pq.N, pq.P, block_ids.data(), count, t.q8.data(), sums.data());
      size_t at = 0;
      for (size_t j = lo; j < hi; ++j)
        dists[i * n + j] = id[i * n + j] < 0 ? std::numeric_limits<float>::infinity()
                                             : t.base + t.scale * float(sums[at++]);
    });
  }
  return to_numpy(std::move(dists), {q, n});
}

}  // namespace
}  // namespace fusionrag

void bind_scan(nb::module_& m) {
  using namespace fusionrag;
  m.def("scan_topn", &scan_topn, "luts"_a, "probe_lists"_a, "list_offsets"_a, "list_ids"_a, "codes"_a, "n"_a,
        "num_threads"_a = 0, "exclude"_a = nb::none(),
        "Per query: gather the probed posting lists (-1 entries skipped), de-duplicate, score by PQ ADC and keep\n"
        "the n nearest. Returns (ids int64[q, n], dists float32[q, n], counts int64[q, 2], seconds float64[q]):\n"
        "rows ascending by (distance, id), padded with -1 / inf; counts[:, 0] = ids gathered with duplicates,\n"
        "counts[:, 1] = unique ids scored (after exclude). exclude: uint8[ceil(N/8)], bit i (little-endian\n"
        "bit order, as np.packbits(..., bitorder='little')) set = vector i is left out.");
  nb::class_<PqCodebooks>(m, "PqCodebooks",
                          "PQ codebooks laid out for building tables (scan_topn_pq, pq_luts): made once per index, "
                          "so a call does not lay them out again.")
      .def(nb::init<const AnyArray&>(), "codebooks"_a, "codebooks: float32 (M, 256, dsub), C-contiguous.")
      .def_ro("M", &PqCodebooks::M)
      .def_ro("dsub", &PqCodebooks::dsub)
      .def_prop_ro("nbytes", &PqCodebooks::nbytes, "Bytes held.");
  m.def("scan_topn_pq", &scan_topn_pq, "queries"_a, "codebooks"_a, "metric"_a, "probe_lists"_a, "list_offsets"_a,
        "list_ids"_a, "codes"_a, "n"_a, "num_threads"_a = 0, "exclude"_a = nb::none(), "batch_plan"_a = false,
        "As scan_topn, the PQ tables built inside: each query's (as ProductQuantizer.luts: float32 queries\n"
        "(q, dim) zero-padded to M * dsub, codebooks float32 (M, 256, dsub), metric 'l2' or 'ip') by the thread\n"
        "that scans it; codebooks may also be a PqCodebooks made once. Returns (ids, dists, counts, seconds,\n"
        "lut_seconds float64[q]): seconds of the scan alone, lut_seconds of building the query's table (with\n"
        "its share of laying out raw codebooks). batch_plan: scan groups of queries that share lists list by\n"
        "list, each code loaded once and scored against every asking query's table (the same results; a\n"
        "group's seconds shared evenly by its queries).");
  m.def("pq_luts", &pq_luts, "queries"_a, "codebooks"_a, "metric"_a, "num_threads"_a = 0,
        "float32 (q, M, 256): the tables scan_topn_pq builds, all at once (to check them).");
  m.def("gather", &gather, "probe_lists"_a, "list_offsets"_a, "list_ids"_a, "num_threads"_a = 0,
        "The ids of each query's probed lists concatenated, duplicates kept: (ids uint32[total], offsets int64[q+1]).");
  m.def("gather_offsets", &gather_offsets, "probe_lists"_a, "list_offsets"_a, "list_ids"_a,
        "gather's offsets alone (int64[q+1]: where each query's ids start), every probe validated.");
  m.def("gather_into", &gather_into, "probe_lists"_a, "list_offsets"_a, "list_ids"_a, "out"_a.noconvert(),
        "num_threads"_a = 0,
        "gather's ids written into out (uint32[>= total], writable), which must hold them all; returns the\n"
        "offsets int64[q+1]. Nothing is written when a probe is invalid or out is too small.");
  m.def("pq_distances", &pq_distances, "luts"_a, "ids"_a, "codes"_a, "num_threads"_a = 0,
        "PQ ADC distances float32[q, n] of the given ids; id -1 gives +inf.");
  nb::class_<Pq4Codebooks>(m, "Pq4Codebooks",
                           "4-bit PQ codebooks laid out for building tables (scan_topn_pq4, pq4_tables, "
                           "pq4_distances): made once per index.")
      .def(nb::init<const AnyArray&>(), "codebooks"_a, "codebooks: float32 (M, 16, dsub), C-contiguous, M <= 256.")
      .def_ro("M", &Pq4Codebooks::M)
      .def_ro("dsub", &Pq4Codebooks::dsub)
      .def_ro("P", &Pq4Codebooks::P, "Code bytes a vector: ceil(M / 2).")
      .def_prop_ro("nbytes", &Pq4Codebooks::nbytes, "Bytes held.");
  m.def("scan_topn_pq4", &scan_topn_pq4, "queries"_a, "codebooks"_a, "metric"_a, "probe_lists"_a,
        "list_offsets"_a, "list_ids"_a, "codes"_a, "n"_a, "num_threads"_a = 0, "exclude"_a = nb::none(),
        "scan_topn_pq over 4-bit codes (uint8 (N, ceil(M / 2)): sub-space 2b in byte b's low nibble, 2b + 1 in\n"
        "its high one) with codebooks float32 (M, 16, dsub) or a Pq4Codebooks: each query's table built, quantized\n"
        "to uint8 (pq4_tables) and summed 32 candidates at a time (pq4_isa). Rows ascend by (integer sum, id);\n"
        "dists are base + scale * sum. Returns (ids, dists, counts, seconds, lut_seconds) as scan_topn_pq.");
  m.def("pq4_tables", &pq4_tables, "queries"_a, "codebooks"_a, "metric"_a,
        "The tables scan_topn_pq4 builds (to check them): (float32 (q, M, 16), uint8 (q, 2 ceil(M / 2), 16):\n"
        "each entry less its sub-space's least over scale, rounded, rows past M zero; base float32 (q): the sum\n"
        "of the sub-spaces' least entries; scale float32 (q): the widest sub-space's range / 255).");
  m.def("pq4_sums", &pq4_sums_of, "q8"_a, "ids"_a, "codes"_a, "isa"_a = "auto",
        "uint16 (len(ids),): the sums of the ids' 4-bit codes under one quantized table q8 (2P, 16), by the\n"
        "kernel isa names: 'auto' (pq4_isa()), 'avx2' (where the CPU has it) or 'baseline' (the scalar loop).");
  m.def("pq4_distances", &pq4_distances, "queries"_a, "codebooks"_a, "metric"_a, "ids"_a, "codes"_a,
        "num_threads"_a = 0,
        "pq_distances over 4-bit codes: float32 (q, n), base + scale * sum of each id's code; id -1 gives +inf.");
  m.def("pq4_isa", [] { return std::string(pq4_isa()); },
        "The kernel scan_topn_pq4 sums with: 'avx2' or 'baseline' (FUSIONRAG_SCAN4_ISA=baseline asks for it).");
}
