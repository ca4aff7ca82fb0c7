// ferry-bench gpu (builds with CUDA): GPU object pulls between two ferryd processes.
#ifndef FERRY_TESTS_BENCH_GPU_BENCH_H_
#define FERRY_TESTS_BENCH_GPU_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

namespace ferry::bench {

struct GpuFlags {
  std::string ferryd;
  std::string provider = "tcp";  // tcp (on lo) or shm
  size_t rails = 2;
  uint64_t size = uint64_t{1} << 30;
  std::vector<uint64_t> pieces = {1, 4096, 16384};  // contiguous, 256 KiB, 64 KiB at 1 GiB
  int iters = 5;
  bool staged = true;  // also force the staged path (tcp between the two processes)
  bool json = false;
  std::vector<std::string> ferryd_args;  // more arguments for both ferryd
};

int RunGpuBench(const GpuFlags& flags);

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_GPU_BENCH_H_
