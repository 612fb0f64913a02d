// The backend's stream-ordered device allocator (cudaMallocAsync / cudaFreeAsync on CUDA).
#include <reviva/device_allocator.h>
#include <reviva/error.h>

namespace reviva {

DeviceAllocator::~DeviceAllocator() = default;

namespace {

class BackendDeviceAllocator final : public DeviceAllocator {
 public:
  explicit BackendDeviceAllocator(std::shared_ptr<Backend> backend)
      : backend_(std::move(backend)) {}
  void* allocate(std::size_t bytes, StreamHandle stream) override {
    return backend_->allocate_device(bytes, stream);
  }
  void deallocate(void* ptr, std::size_t, StreamHandle stream) noexcept override {
    backend_->free_device(ptr, stream);
  }
  std::string name() const override { return "backend (" + backend_->name() + ")"; }

 private:
  std::shared_ptr<Backend> backend_;
};

}  // namespace

std::shared_ptr<DeviceAllocator> make_backend_device_allocator(std::shared_ptr<Backend> backend) {
  REVIVA_CHECK_ARG(backend != nullptr, "make_backend_device_allocator: backend is null");
  return std::make_shared<BackendDeviceAllocator>(std::move(backend));
}

}  // namespace reviva
