// engine/cuda.h for builds without CUDA: host memory only.
#include "engine/cuda.h"

namespace ferry::engine {
namespace {

absl::Status NoCuda() {
  return absl::UnimplementedError("this ferry was built without CUDA: GPU memory is not supported");
}

}  // namespace

bool CudaBuilt() { return false; }
int CudaDeviceCount() { return 0; }
absl::Status CheckCudaDevice(int) { return NoCuda(); }
absl::StatusOr<void*> CudaAlloc(int, size_t) { return NoCuda(); }
void CudaFree(void*) {}
absl::StatusOr<void*> CudaHostAlloc(size_t) { return NoCuda(); }
void CudaHostFree(void*) {}
absl::Status CudaCopy(void*, const void*, size_t) { return NoCuda(); }
absl::StatusOr<CudaIpcExport> CudaExportIpc(const void*) { return NoCuda(); }
absl::StatusOr<CudaDmabuf> CudaExportDmabuf(const void*, size_t) { return NoCuda(); }
absl::StatusOr<int> CudaDeviceByUuid(const std::string&) { return NoCuda(); }
absl::Status CudaEnablePeerAccess(int, int) { return NoCuda(); }

struct CudaIpcCache::Impl {};
CudaIpcCache::CudaIpcCache(size_t) {}
CudaIpcCache::~CudaIpcCache() = default;
absl::StatusOr<CudaMapping> CudaIpcCache::Open(const std::string&, int) { return NoCuda(); }

absl::Status CudaCopyPieces(int, const std::vector<CopyPiece>& pieces, int) {
  return pieces.empty() ? absl::OkStatus() : NoCuda();
}

uint64_t CopyChunksBound(uint64_t pieces, uint64_t bytes) { return pieces + bytes / (256 << 10); }

struct CudaCopyBatch::State {};
CudaCopyBatch::CudaCopyBatch(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaCopyBatch::CudaCopyBatch(CudaCopyBatch&& other) noexcept = default;
CudaCopyBatch::~CudaCopyBatch() = default;
absl::StatusOr<CudaCopyBatch> CudaCopyBatch::Begin(int, uint64_t, int) { return NoCuda(); }
absl::Status CudaCopyBatch::Add(uint64_t, uint64_t, uint64_t) { return NoCuda(); }
absl::Status CudaCopyBatch::Finish() { return NoCuda(); }

}  // namespace ferry::engine
