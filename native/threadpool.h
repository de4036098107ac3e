// A persistent worker pool: the hot paths are called once per query batch, and
// spawning threads per call would cost more than a small batch's work.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cerrno>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <string>
#include <thread>
#include <vector>

namespace fusionrag {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool(std::max(1u, std::thread::hardware_concurrency()));
    return pool;
  }

  size_t size() const { return workers_.size() + 1; }

  // Runs fn(i, worker) for i in [0, n) on at most `threads` threads (the caller
  // included); worker is in [0, threads) and lets fn use per-thread scratch.
  // Items are handed out one at a time, so uneven items balance themselves.
  // The first exception thrown by fn is rethrown here after all work stops.
  //
  // Calls from several threads at once run at once: each call's job joins a list,
  // the pool's workers help whichever listed jobs still want helpers (oldest first),
  // and the caller works on its own job until every item is handed out, so a call
  // never waits for another's. That is what lets a pipeline's stages overlap: a
  // re-rank whose threads wait on the SSD leaves the cores to the graph search and
  // the PQ scan of the next batches (bench/results/pipeline/pool_overlap.md), where one job
  // at a time had made a stage that waits hold every core. FUSIONRAG_POOL_JOBS=one
  // (read once, at the pool's start) brings that back, for benchmarks to compare.
  void parallel_for(size_t n, size_t threads, const std::function<void(size_t, size_t)>& fn) {
    threads = std::max<size_t>(1, std::min({threads, n, size()}));
    if (threads <= 1) {
      for (size_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    std::unique_lock<std::mutex> one_job(one_job_mutex_, std::defer_lock);
    if (one_job_) one_job.lock();
    Job job{fn, n, threads - 1, thread_nice()};
    {
      std::lock_guard<std::mutex> lk(mutex_);
      jobs_.push_back(&job);
    }
    if (threads - 1 >= workers_.size()) {
      cv_.notify_all();
    } else {
      for (size_t i = 0; i + 1 < threads; ++i) cv_.notify_one();
    }
    run(job, 0);
    std::unique_lock<std::mutex> lk(mutex_);
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));  // no helper joins it from here on
    done_cv_.wait(lk, [&] { return job.running == 0; });
    lk.unlock();
    if (job.error) std::rethrow_exception(job.error);
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  struct Job {
    Job(const std::function<void(size_t, size_t)>& f, size_t items, size_t helpers, int priority)
        : fn(f), n(items), wanted(helpers), nice(priority) {}
    const std::function<void(size_t, size_t)>& fn;
    const size_t n;
    std::atomic<size_t> next{0};
    size_t wanted;       // helpers it may still take (under the pool's mutex)
    size_t running = 0;  // helpers working on it (under the pool's mutex)
    size_t joined = 0;   // helpers that took it: their worker numbers are 1..joined
    const int nice;      // the calling thread's: a background call's (a build, a merge) is helped last
    std::exception_ptr error;
    std::mutex error_mutex;
  };

  // Background work (an import's build, a merge, a vector store's file: their threads lower their own priority,
  // retriever/process.lower_thread_priority) shares this pool with searches. Helpers take the listed job of the
  // least nice caller first (the oldest among equals), and where the process may set a thread's nice both ways
  // (root, or RLIMIT_NICE allowing it) a helper runs at its job's nice: a build's helpers yield the cores to the
  // searches' threads as the build's own thread does.
  static int thread_nice() {
    errno = 0;
    int v = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
    return errno ? 0 : v;
  }

  static bool may_set_nice(int base) {
    if (geteuid() == 0) return true;
    struct rlimit r;
    return getrlimit(RLIMIT_NICE, &r) == 0 && (r.rlim_cur == RLIM_INFINITY || 20 - long(r.rlim_cur) <= base);
  }

  explicit ThreadPool(size_t n) {
    const char* jobs = std::getenv("FUSIONRAG_POOL_JOBS");
    if (jobs && std::string(jobs) == "one") {
      one_job_ = true;
    } else if (jobs && *jobs && std::string(jobs) != "many") {
      throw std::invalid_argument(std::string("FUSIONRAG_POOL_JOBS must be 'one' or 'many', got '") + jobs + "'");
    }
    base_nice_ = thread_nice();
    adopt_nice_ = may_set_nice(base_nice_);
    for (size_t i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }

  static void run(Job& job, size_t worker) {
    for (size_t i; (i = job.next.fetch_add(1)) < job.n;) {
      try {
        job.fn(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lk(job.error_mutex);
        if (!job.error) job.error = std::current_exception();
        job.next = job.n;  // stop handing out items
      }
    }
  }

  // The listed job that wants a helper and has items left, of the least nice caller, the oldest of those; under
  // mutex_.
  Job* wanting() const {
    Job* best = nullptr;
    for (Job* j : jobs_)
      if (j->wanted > 0 && j->next.load(std::memory_order_relaxed) < j->n && (!best || j->nice < best->nice))
        best = j;
    return best;
  }

  void loop() {
    int nice = base_nice_;
    const id_t tid = static_cast<id_t>(syscall(SYS_gettid));
    for (;;) {
      Job* job;
      size_t worker;
      {
        std::unique_lock<std::mutex> lk(mutex_);
        cv_.wait(lk, [&] { return stop_ || (job = wanting()) != nullptr; });
        if (stop_) return;
        --job->wanted;
        ++job->running;
        worker = ++job->joined;
      }
      if (adopt_nice_ && job->nice != nice && setpriority(PRIO_PROCESS, tid, job->nice) == 0) nice = job->nice;
      run(*job, worker);
      {
        std::lock_guard<std::mutex> lk(mutex_);
        --job->running;  // the caller may return (and the job go) once this is 0
      }
      done_cv_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_, one_job_mutex_;
  std::condition_variable cv_, done_cv_;
  std::vector<Job*> jobs_;
  bool stop_ = false, one_job_ = false, adopt_nice_ = false;
  int base_nice_ = 0;
};

// An entry point's num_threads: 0 means every worker of the pool.
inline size_t pool_threads(int num_threads) {
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0, got " + std::to_string(num_threads));
  return num_threads ? size_t(num_threads) : ThreadPool::instance().size();
}

}  // namespace fusionrag
