// The DRAM page buffer: block frames in shards, replaced by CLOCK, TinyLFU or whichever a miniature of both
// serves more (Auto), optionally holding blocks zero-run coded in chunks.
#include <sys/mman.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "pagefile.h"

namespace fusionrag {

BufferPolicy parse_buffer_policy(const std::string& name) {
  if (name == "clock") return BufferPolicy::Clock;
  if (name == "lfu") return BufferPolicy::Lfu;
  if (name == "auto") return BufferPolicy::Auto;
  throw std::invalid_argument("buffer_policy must be 'auto', 'clock' or 'lfu', not '" + name + "'");
}

namespace {
size_t pow2_at_least(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}
}  // namespace

namespace {
// The index of the first set bit of bits ^ flip at or after `from`, or `limit` if none is before it.
inline size_t next_set(const uint64_t* bits, size_t from, size_t limit, uint64_t flip = 0) {
  for (size_t w = from / 64; w * 64 < limit; ++w) {
    uint64_t v = bits[w] ^ flip;
    if (w == from / 64) v &= ~uint64_t(0) << (from % 64);
    if (v) return std::min(limit, w * 64 + size_t(__builtin_ctzll(v)));
  }
  return limit;
}
}  // namespace

size_t zero_runs_encode(const uint8_t* src, size_t n, uint8_t* dst) {
  // Bit i of zero: byte i is 0; of run3: bytes i, i + 1 and i + 2 are (past the end counts as 0).
  const size_t words = n / 64 + 2;
  thread_local std::vector<uint64_t> zero, run3;
  zero.assign(words, ~uint64_t(0)), run3.resize(words);
  for (size_t w = 0; w * 64 < n; ++w) {
    uint64_t v = 0;
    const size_t m = std::min<size_t>(64, n - w * 64);
    const uint8_t* p = src + w * 64;
#if defined(__SSE2__)
    if (m == 64) {
      const __m128i z = _mm_setzero_si128();
      for (int k = 0; k < 4; ++k) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + k);
        v |= uint64_t(uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, z)))) << (16 * k);
      }
    } else
#endif
      for (size_t k = 0; k < m; ++k) v |= uint64_t(!p[k]) << k;
    if (m < 64) v |= ~uint64_t(0) << m;
    zero[w] = v;
  }
  for (size_t w = 0; w < words; ++w) {
    const uint64_t a = zero[w], b = w + 1 < words ? zero[w + 1] : ~uint64_t(0);
    run3[w] = a & (a >> 1 | b << 63) & (a >> 2 | b << 62);
  }
  size_t i = 0, o = 0;
  while (i < n) {
    const size_t from = std::min(next_set(zero.data(), i, n, ~uint64_t(0)), i + 255);
    const size_t l = std::min(next_set(run3.data(), from, n), from + 255) - from;
    if (o + 2 + l >= n) return 0;
    dst[o] = uint8_t(from - i), dst[o + 1] = uint8_t(l);
    std::memcpy(dst + o + 2, src + from, l);
    o += 2 + l, i = from + l;
  }
  return o;
}

void zero_runs_decode(const uint8_t* src, size_t len, uint8_t* dst, size_t n) {
  const uint8_t* const end = dst + n;
  for (size_t i = 0; i + 1 < len;) {
    const size_t z = src[i], l = src[i + 1];
#if defined(__SSE2__)
    // Away from both ends, whole 16-byte stores: a token writes up to 15 bytes past its own, which the next
    // tokens overwrite (they cover every byte up to the end, and at least 32 are left).
    if (size_t(end - dst) >= z + l + 32 && i + 2 + l + 16 <= len) {
      const __m128i zero = _mm_setzero_si128();
      for (size_t k = 0; k < z; k += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), zero);
      dst += z;
      for (size_t k = 0; k < l; k += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 2 + k)));
      dst += l, i += 2 + l;
      continue;
    }
#endif
    std::memset(dst, 0, z);
    std::memcpy(dst + z, src + i + 2, l);
    dst += z + l, i += 2 + l;
  }
}

PageBuffer::PageBuffer(size_t capacity, size_t block_bytes, BufferPolicy policy, bool active, double compress_gain)
    : capacity_(capacity), block_bytes_(block_bytes), policy_(policy), active_(active) {
  if (!capacity) return;
  if (compress_gain > 1) {
    if (!block_bytes || block_bytes % kChunkBytes)
      throw std::invalid_argument("a compressed page buffer needs blocks of whole chunks");
    compressed_ = true;
    entry_factor_ = std::min(4.0, compress_gain * 1.25);
  }
  // Anonymous memory is page-aligned and committed only as frames fill. No block bytes: a shadow, metadata only.
  arena_bytes_ = capacity * block_bytes;
  if (arena_bytes_) {
    arena_ = mmap(nullptr, arena_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (arena_ == MAP_FAILED) throw std::bad_alloc();
  }
  // At least 256 frames a shard, so CLOCK still sees a useful window.
  size_t n = std::clamp<size_t>(capacity / 256, 1, 16);
  shards_ = std::vector<Shard>(n);
  for (size_t i = 0; i < n; ++i) {
    size_t lo = capacity * i / n, hi = capacity * (i + 1) / n;
    shards_[i].frames = arena_ ? static_cast<uint8_t*>(arena_) + lo * block_bytes : nullptr;
    shards_[i].nominal = hi - lo;
    const size_t entries = compressed_ ? size_t(std::ceil(double(hi - lo) * entry_factor_)) : hi - lo;
    if (active) {
      init(shards_[i], entries, policy != BufferPolicy::Clock);
      if (compressed_) init_chunks(shards_[i]);
    } else {
      shards_[i].size = entries;
    }
  }
  if (policy == BufferPolicy::Auto) {
    // A sample of the blocks big enough that each shadow is a shard's size: about 256 frames or more. Compressed:
    // shadows of as many blocks as the memory is expected to hold.
    const size_t effective = compressed_ ? size_t(double(capacity) * compress_gain) : capacity;
    mini_ = std::make_unique<Miniature>();
    mini_->rate = std::max<size_t>(1, effective / 256);
    const size_t frames = std::max<size_t>(1, effective / mini_->rate);
    mini_->period = frames;
    for (int i = 0; i < 2; ++i) init(mini_->shadow[i], frames, i == 1);
  }
}

void FrameMap::reset(size_t frames) {
  slots_.assign(pow2_at_least(std::max<size_t>(8, 2 * frames)), Slot{kNone, 0});
  mask_ = slots_.size() - 1;
}

bool FrameMap::erase(uint32_t key) {
  if (slots_.empty()) return false;
  size_t i = home(key);
  for (; slots_[i].key != key; i = (i + 1) & mask_)
    if (slots_[i].key == kNone) return false;
  // Backward shift: an entry after the hole moves into it unless its home lies cyclically in (hole, entry].
  for (size_t j = i;;) {
    j = (j + 1) & mask_;
    if (slots_[j].key == kNone) break;
    const size_t h = home(slots_[j].key);
    if (((j - h) & mask_) >= ((j - i) & mask_)) slots_[i] = slots_[j], i = j;
  }
  slots_[i] = Slot{kNone, 0};
  return true;
}

// A shard's frames all free; with a sketch (Lfu, Auto) of sixteen counters a frame:
// it must tell apart blocks not in the buffer too.
void PageBuffer::init(Shard& s, size_t frames, bool sketch) {
  s.size = frames;
  s.block_of.assign(frames, kEmpty);
  s.uses.assign(frames, 0);
  s.pinned.assign(frames, 0);
  s.frame_of.reset(frames);
  if (sketch) s.sketch.assign(pow2_at_least(std::max<size_t>(64, 16 * frames)), 0);
}

void PageBuffer::init_chunks(Shard& s) const {
  const size_t chunks = s.nominal * block_bytes_ / kChunkBytes;
  s.next.resize(chunks);
  for (size_t c = 0; c < chunks; ++c) s.next[c] = c + 1 < chunks ? uint32_t(c + 1) : kEmpty;
  s.free_head = chunks ? 0 : kEmpty, s.free_chunks = chunks;
  s.head.assign(s.block_of.size(), kEmpty);
  s.coded.assign(s.block_of.size(), 0);
}

size_t PageBuffer::entries() const {
  if (!compressed_) return capacity_;
  size_t n = 0;
  for (const Shard& s : shards_) n += s.size;
  return n;
}

size_t PageBuffer::chunk_bytes_held() {
  size_t n = 0;
  if (!compressed_) return n;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    n += (s.next.size() - s.free_chunks) * kChunkBytes;
  }
  return n;
}

// Empties a shard: no block, nothing pinned or wanted, no counts.
void PageBuffer::reset(Shard& s) {
  std::fill(s.block_of.begin(), s.block_of.end(), kEmpty);
  std::fill(s.uses.begin(), s.uses.end(), 0);
  std::fill(s.pinned.begin(), s.pinned.end(), 0);
  std::fill(s.sketch.begin(), s.sketch.end(), 0);
  s.frame_of.clear();
  s.wanted.clear();
  s.hand = s.num_pinned = 0;
  s.requests = 0;
}

PageBuffer::~PageBuffer() {
  if (arena_) munmap(arena_, arena_bytes_);
}

// Auto's miniature as new: shadows empty, no hits, no score (the mode it runs in is left as it is).
void PageBuffer::reset_miniature() {
  if (!mini_) return;
  std::lock_guard<std::mutex> lk(mini_->mutex);
  for (Shard& s : mini_->shadow) reset(s);
  mini_->seen = mini_->hits[0] = mini_->hits[1] = 0;
  mini_->score[0] = mini_->score[1] = 0;
}

void PageBuffer::set_active(bool on) {
  if (!capacity_ || active_.load() == on) return;
  if (!on) active_.store(false);  // new lookups miss from here on; those under way finish under their shard's lock
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    if (on) {
      init(s, s.size, policy_ != BufferPolicy::Clock);
      if (compressed_) init_chunks(s);
    } else {  // metadata freed, not just emptied: the other layout holds the bytes now
      s.block_of = {}, s.uses = {}, s.pinned = {}, s.sketch = {};
      s.next = {}, s.head = {}, s.coded = {};
      s.free_head = kEmpty, s.free_chunks = 0;
      s.frame_of.release(), s.wanted = {};
      s.hand = s.num_pinned = 0;
      s.requests = 0;
    }
  }
  if (!on && arena_) madvise(arena_, arena_bytes_, MADV_DONTNEED);  // the frames' memory back to the system
  reset_miniature();
  if (on) active_.store(true);
}

namespace {
// Two hashes of a block into the sketch, independent of the shard hash.
inline size_t sketch_slot(uint32_t block, int row, size_t mask) {
  uint64_t h = (uint64_t(block) + 1) * (row ? 0xC2B2AE3D27D4EB4Full : 0x9E3779B97F4A7C15ull);
  return size_t(h >> 32) & mask;
}
}  // namespace

uint32_t PageBuffer::estimate(const Shard& s, uint32_t block) const {
  const size_t mask = s.sketch.size() - 1;
  return std::min(s.sketch[sketch_slot(block, 0, mask)], s.sketch[sketch_slot(block, 1, mask)]);
}

void PageBuffer::count(Shard& s, uint32_t block, uint32_t weight) {
  if (s.sketch.empty()) return;  // Clock
  const size_t mask = s.sketch.size() - 1;
  // Conservative update: only the counters at the minimum grow.
  const uint32_t now = estimate(s, block), to = std::min<uint32_t>(255, now + weight);
  for (int row = 0; row < 2; ++row) {
    uint8_t& c = s.sketch[sketch_slot(block, row, mask)];
    if (c < to) c = uint8_t(to);
  }
  // Aging: halve every count once the shard has seen kAgingRequests requests a frame.
  s.requests += weight;
  if (s.requests >= kAgingRequests * s.block_of.size()) {
    for (uint8_t& c : s.sketch) c >>= 1;
    for (uint8_t& u : s.uses) u >>= 1;
    s.requests /= 2;
  }
}

// The frame to fill: a free one, or the victim of a sweep that passes pinned
// frames and spends one use of every other frame it passes.
size_t PageBuffer::victim(Shard& s) {
  for (;;) {
    size_t f = s.hand;
    s.hand = (s.hand + 1) % s.block_of.size();
    if (s.block_of[f] == kEmpty) return f;
    if (s.pinned[f]) continue;
    if (!s.uses[f]) return f;
    --s.uses[f];
  }
}

// A hit on a frame: Clock marks it referenced, Lfu counts its uses.
void PageBuffer::hit(Shard& s, size_t frame, uint32_t weight, bool lfu) {
  uint8_t& uses = s.uses[frame];
  uses = lfu ? uint8_t(std::min<uint32_t>(kMaxUses, uses + weight)) : 1;
}

// The frame a missed block takes, with `need` chunks free for it (compressed; 0 otherwise), its victims evicted
// (*evicted counts them), or SIZE_MAX when Lfu's admission keeps a victim (those evicted before it stay free).
// Clock: a new block earns its second chance only when it is hit again, so one scan of cold blocks cannot flush
// the hot ones. Lfu: it was admitted for its requests, and starts with one use.
size_t PageBuffer::place(Shard& s, uint32_t block, uint32_t weight, bool lfu, bool pin, size_t need,
                         size_t* evicted) {
  size_t entry = SIZE_MAX;
  *evicted = 0;
  while (entry == SIZE_MAX || s.free_chunks < need) {
    const size_t f = victim(s);
    if (s.block_of[f] != kEmpty) {
      // TinyLFU admission: a block requested no more often than the victim would
      // only push out something as likely to come back.
      if (lfu && !pin && estimate(s, block) <= estimate(s, s.block_of[f])) return SIZE_MAX;
      drop_frame(s, f);
      ++*evicted;
    }
    if (entry == SIZE_MAX) entry = f;
  }
  s.block_of[entry] = block;
  s.uses[entry] = lfu ? uint8_t(std::min<uint32_t>(kMaxUses, weight)) : 0;
  s.frame_of.insert(block, uint32_t(entry));
  return entry;
}

void PageBuffer::drop_frame(Shard& s, size_t f) {
  s.frame_of.erase(s.block_of[f]);
  s.block_of[f] = kEmpty, s.uses[f] = 0;
  if (s.pinned[f]) s.pinned[f] = 0, --s.num_pinned;
  if (s.head.empty()) return;  // no chunks: a plain buffer, or a shadow
  for (uint32_t c = s.head[f], n = uint32_t(chunks_for(s.coded[f])); n--;) {
    const uint32_t after = s.next[c];
    s.next[c] = s.free_head, s.free_head = c, ++s.free_chunks;
    c = after;
  }
  s.head[f] = kEmpty, s.coded[f] = 0;
}

// Frame f takes a block's bytes: data, or with compression its code (len bytes; coded null: data as it is).
void PageBuffer::store_frame(Shard& s, size_t f, const uint8_t* data, const uint8_t* coded, size_t len) {
  if (!block_bytes_) return;
  if (!compressed_) {
    std::memcpy(s.frames + f * block_bytes_, data, block_bytes_);
    return;
  }
  const uint8_t* src = coded ? coded : data;
  if (!coded) len = block_bytes_;
  s.coded[f] = uint32_t(len);
  uint32_t* link = &s.head[f];
  for (size_t at = 0; at < len; at += kChunkBytes) {
    const uint32_t c = s.free_head;
    s.free_head = s.next[c], --s.free_chunks;
    *link = c, link = &s.next[c];
    std::memcpy(s.frames + size_t(c) * kChunkBytes, src + at, std::min(kChunkBytes, len - at));
  }
}

void PageBuffer::load_frame(const Shard& s, size_t f, uint8_t* out) const {
  if (!block_bytes_) return;
  if (!compressed_) {
    std::memcpy(out, s.frames + f * block_bytes_, block_bytes_);
    return;
  }
  const size_t len = s.coded[f];
  thread_local std::vector<uint8_t> code;
  uint8_t* dst = out;
  if (len != block_bytes_) {
    if (code.size() < len) code.resize(block_bytes_);
    dst = code.data();
  }
  uint32_t c = s.head[f];
  for (size_t at = 0; at < len; at += kChunkBytes, c = s.next[c])
    std::memcpy(dst + at, s.frames + size_t(c) * kChunkBytes, std::min(kChunkBytes, len - at));
  if (len != block_bytes_) zero_runs_decode(code.data(), len, out, block_bytes_);
}

// Auto: a request of a sampled block through both shadows; at the end of each
// period the buffer takes the mode whose shadow served more, recent periods
// weighing most.
void PageBuffer::simulate(uint32_t block, uint32_t weight) {
  Miniature& m = *mini_;
  std::lock_guard<std::mutex> lk(m.mutex);
  for (int i = 0; i < 2; ++i) {
    Shard& s = m.shadow[i];
    count(s, block, weight);
    const uint32_t f = s.frame_of.find(block);
    size_t evicted;
    if (f != FrameMap::kNone) {
      m.hits[i] += weight;
      hit(s, f, weight, i == 1);
    } else {
      place(s, block, weight, i == 1, false, 0, &evicted);
    }
  }
  m.seen += weight;
  if (m.seen < m.period) return;
  m.seen = 0;
  for (int i = 0; i < 2; ++i) m.score[i] = m.score[i] / 2 + double(m.hits[i]), m.hits[i] = 0;
  const bool lfu = m.score[1] >= m.score[0];
  if (lfu_mode_.exchange(lfu, std::memory_order_relaxed) != lfu) switches_.fetch_add(1, std::memory_order_relaxed);
}

bool PageBuffer::lookup(uint32_t block, uint8_t* out, uint32_t weight) {
  if (!capacity_ || !active()) return false;
  if (mini_ && mini_sampled(block)) simulate(block, weight);
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  if (s.block_of.empty()) return false;  // off
  count(s, block, weight);
  const uint32_t f = s.frame_of.find(block);
  if (f == FrameMap::kNone) return false;
  hit(s, f, weight, lfu_now());
  if (out) load_frame(s, f, out);
  return true;
}

bool PageBuffer::offer(uint32_t block, const uint8_t* data, uint32_t weight, bool requested) {
  if (!capacity_ || (requested && !active())) return false;
  if (requested && mini_ && mini_sampled(block)) simulate(block, weight);
  // Coded before the lock is taken, so that other threads do not wait for it.
  thread_local std::vector<uint8_t> code;
  size_t len = 0;
  if (compressed_) {
    if (code.size() < block_bytes_) code.resize(block_bytes_);
    len = zero_runs_encode(data, block_bytes_, code.data());
  }
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  if (s.block_of.empty()) return false;  // off
  if (requested) count(s, block, weight);
  const bool pin = !s.wanted.empty() && s.wanted.count(block) && s.num_pinned < pin_limit(s);
  const bool lfu = lfu_now();
  const uint32_t held = s.frame_of.find(block);
  if (held != FrameMap::kNone) {  // a hit, or another query read it meanwhile
    if (requested) hit(s, held, weight, lfu);
    if (pin && !s.pinned[held]) s.pinned[held] = 1, ++s.num_pinned;
    return true;
  }
  size_t evicted;
  const size_t need = compressed_ ? chunks_for(len ? len : block_bytes_) : 0;
  const size_t f = place(s, block, weight, lfu, pin, need, &evicted);
  if (evicted) evictions_.fetch_add(evicted, std::memory_order_relaxed);
  if (f == SIZE_MAX) return false;
  if (pin) s.pinned[f] = 1, ++s.num_pinned;
  store_frame(s, f, data, len ? code.data() : nullptr, len);
  return false;
}

bool PageBuffer::resident(uint32_t block) { return peek(block, nullptr); }

std::vector<std::pair<uint32_t, uint32_t>> PageBuffer::held_blocks() {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    for (size_t f = 0; f < s.block_of.size(); ++f)
      if (s.block_of[f] != kEmpty) out.push_back({s.uses[f], s.block_of[f]});
  }
  return out;
}

bool PageBuffer::evict(uint32_t block, const std::function<void(const uint8_t*)>& take) {
  if (!capacity_) return false;
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  const uint32_t f = s.frame_of.find(block);
  if (f == FrameMap::kNone) return false;
  if (take && s.frames && !compressed_) {
    take(s.frames + size_t(f) * block_bytes_);
  } else if (take && s.frames) {
    thread_local std::vector<uint8_t> bytes;
    bytes.resize(block_bytes_);
    load_frame(s, f, bytes.data());
    take(bytes.data());
  }
  drop_frame(s, f);
  // Whole pages, frames page-aligned; a compressed block's chunks share pages with others and stay.
  if (s.frames && !compressed_) madvise(s.frames + size_t(f) * block_bytes_, block_bytes_, MADV_DONTNEED);
  return true;
}

bool PageBuffer::peek(uint32_t block, uint8_t* out) {
  if (!capacity_) return false;
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  const uint32_t f = s.frame_of.find(block);
  if (f == FrameMap::kNone) return false;
  if (out) load_frame(s, f, out);
  return true;
}

std::vector<uint32_t> PageBuffer::pin(const uint32_t* blocks, size_t n) {
  std::vector<uint32_t> missing;
  if (!capacity_) return missing;
  std::vector<std::vector<uint32_t>> per_shard(shards_.size());
  for (size_t i = 0; i < n; ++i) per_shard[shard_index(blocks[i])].push_back(blocks[i]);
  for (size_t i = 0; i < shards_.size(); ++i) {
    Shard& s = shards_[i];
    std::lock_guard<std::mutex> lk(s.mutex);
    if (s.block_of.empty()) continue;  // off: nothing pinned
    std::fill(s.pinned.begin(), s.pinned.end(), 0);
    s.num_pinned = 0;
    s.wanted.clear();
    for (uint32_t b : per_shard[i]) {
      if (s.wanted.size() >= pin_limit(s)) break;
      if (!s.wanted.insert(b).second) continue;
      const uint32_t f = s.frame_of.find(b);
      if (f == FrameMap::kNone) {
        missing.push_back(b);
      } else {
        s.pinned[f] = 1, ++s.num_pinned;
      }
    }
  }
  return missing;
}

size_t PageBuffer::pinned() {
  size_t total = 0;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    total += s.num_pinned;
  }
  return total;
}

void PageBuffer::clear() {
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    reset(s);
    if (compressed_ && !s.block_of.empty()) init_chunks(s);
  }
  reset_miniature();
  if (mini_) lfu_mode_.store(true, std::memory_order_relaxed);
}

}  // namespace fusionrag
