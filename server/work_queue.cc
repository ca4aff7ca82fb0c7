#include "server/work_queue.h"

namespace ferry::server {

WorkQueue::WorkQueue(size_t threads) {
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back(&WorkQueue::Loop, this);
}

WorkQueue::~WorkQueue() { Stop(); }

void WorkQueue::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  std::deque<std::function<void()>> late;  // queued as the threads ended: dropped
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    late.swap(queue_);
  }
}

bool WorkQueue::Run(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return false;
  queue_.push_back(std::move(work));
  return true;
}

void WorkQueue::Loop() {
  for (;;) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

}  // namespace ferry::server
