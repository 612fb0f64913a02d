// Offloads a buffer to pinned host memory and brings it back, through an installed Reviva.
#include <reviva/reviva.h>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

int main() {
  auto backend = reviva::make_default_backend();
  auto pool = reviva::PinnedHostPool::create(backend);
  reviva::TransferEngine engine(pool);
  reviva::Stream compute(backend);

  const std::size_t n = std::size_t{8} << 20;
  std::vector<unsigned char> data(n);
  std::iota(data.begin(), data.end(), 0);
  reviva::PinnedBlock host = pool->allocate(n);
  std::memcpy(host.data(), data.data(), n);
  void* device = backend->allocate_device(n, compute.handle());
  compute.synchronize();

  engine.restore(host, device, n).enqueue_wait(engine.stream(reviva::Direction::DeviceToHost));
  reviva::PinnedBlock back = pool->allocate(n);
  engine.offload(device, back, n).wait();
  backend->free_device(device, compute.handle());
  compute.synchronize();

  const bool ok = std::memcmp(back.data(), data.data(), n) == 0;
  std::printf("reviva %s on %s: %s\n", reviva::version_string(), backend->name().c_str(),
              ok ? "round trip ok" : "round trip MISMATCH");
  return ok ? 0 : 1;
}
