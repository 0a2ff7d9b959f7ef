// The cache of large CPU outputs (cpu_alloc.h, empty_cached_output).

#include "gem_kernels/cpu_alloc.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace gem_kernels {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;

// Freed blocks kept for reuse, by exact (2 MiB-rounded) size, newest last; at most `limit` bytes of
// them in all. Never destroyed: an output may be freed after static destructors have run.
class OutputCache {
 public:
  static OutputCache& get() {
    static auto* cache = new OutputCache();
    return *cache;
  }

  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = free_.size(); i-- > 0;) {
      if (free_[i].bytes == bytes) {
        void* ptr = free_[i].ptr;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        idle_ -= bytes;
        return ptr;
      }
    }
    return nullptr;
  }

  void give(void* ptr, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (idle_ + bytes <= limit_) {
        free_.push_back({ptr, bytes});
        idle_ += bytes;
        return;
      }
    }
    unmap(ptr, bytes);
  }

  // Sets the limit, releasing idle blocks beyond it (oldest first); returns the previous one.
  size_t set_limit(size_t limit) {
    std::vector<Block> released;
    size_t previous;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      previous = limit_;
      limit_ = limit;
      while (idle_ > limit_) {
        released.push_back(free_.front());
        idle_ -= free_.front().bytes;
        free_.erase(free_.begin());
      }
    }
    for (const Block& b : released) unmap(b.ptr, b.bytes);
    return previous;
  }

  size_t idle_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return idle_;
  }

  static void* map(size_t bytes) {
#ifdef __linux__
    // Map a huge page more and trim, so the block starts on a 2 MiB boundary: transparent huge pages
    // back only whole aligned 2 MiB ranges.
    void* raw = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (begin + kHugePage - 1) & ~(kHugePage - 1);
    if (aligned > begin) munmap(raw, aligned - begin);
    const uintptr_t tail = aligned + bytes, end = begin + bytes + kHugePage;
    if (end > tail) munmap(reinterpret_cast<void*>(tail), end - tail);
#ifdef MADV_HUGEPAGE
    madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
#endif
    return reinterpret_cast<void*>(aligned);
#else
    return std::aligned_alloc(kHugePage, bytes);
#endif
  }

  static void unmap(void* ptr, size_t bytes) {
#ifdef __linux__
    munmap(ptr, bytes);
#else
    (void)bytes;
    std::free(ptr);
#endif
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };

  // GEM_KERNELS_OUTPUT_CACHE_MIB: a whole number of MiB >= 0 (0: off); unset or empty: kDefaultOutputCacheMiB.
  static size_t default_limit() {
    const char* env = std::getenv("GEM_KERNELS_OUTPUT_CACHE_MIB");
    if (env == nullptr || *env == '\0') return static_cast<size_t>(kDefaultOutputCacheMiB) << 20;
    char* end = nullptr;
    errno = 0;
    const long long mib = std::strtoll(env, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && errno == 0 && mib >= 0 && mib <= (1LL << 40),
                      "GEM_KERNELS_OUTPUT_CACHE_MIB must be a whole number of MiB >= 0, got '", env, "'");
    return static_cast<size_t>(mib) << 20;
  }

  std::mutex mutex_;
  std::vector<Block> free_;
  size_t idle_ = 0;
  size_t limit_ = default_limit();
};

// The storage's deleter context: the block and its mapped size.
struct CachedBlock {
  void* ptr;
  size_t bytes;
};

void release_block(void* ctx) {
  auto* block = static_cast<CachedBlock*>(ctx);
  OutputCache::get().give(block->ptr, block->bytes);
  delete block;
}

}  // namespace

at::Tensor empty_cached_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (nbytes < kCachedOutputMinBytes) return empty_for_streaming_write(sizes, options);
  const size_t bytes = (nbytes + kHugePage - 1) & ~(kHugePage - 1);
  void* ptr = OutputCache::get().take(bytes);
  if (ptr == nullptr) ptr = OutputCache::map(bytes);
  if (ptr == nullptr) throw std::bad_alloc();
  c10::DataPtr data(ptr, new CachedBlock{ptr, bytes}, &release_block, c10::Device(c10::kCPU));
  // Resizable with the default allocator: a resize past the block moves the data to a normal
  // allocation and hands the block back here through the deleter.
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), c10::GetCPUAllocator(), true);
  return at::empty({0}, options).set_(storage, 0, sizes);
}

int64_t set_output_cache_limit(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "bytes must be >= 0, got ", bytes);
  return static_cast<int64_t>(OutputCache::get().set_limit(static_cast<size_t>(bytes)));
}

int64_t output_cache_idle_bytes() { return static_cast<int64_t>(OutputCache::get().idle_bytes()); }

}  // namespace gem_kernels
