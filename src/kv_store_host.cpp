// KVStore's layers attended on the host (see kv_store.h): their K/V stays in the pinned host
// copy, read and written there (Note [Host-side appends] in append_blocks.cpp, Note [Attention on
// the host] in host_attention.cpp).
#include <reviva/error.h>
#include <reviva/kv_store.h>

namespace reviva {

void KVStore::attend_on_host(int layer) {
  check_open("attend_on_host");
  check_whole(layer, "attend_on_host");
  const BlockId id = block_at(layer, "attend_on_host");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(!resident_[i], "KVStore::attend_on_host: layer ", layer,
                   " is resident (its K/V is read on the device)");
  REVIVA_CHECK_ARG(acquired_[i] == nullptr, "KVStore::attend_on_host: layer ", layer,
                   " is acquired");
  if (host_attended_[i]) return;
  REVIVA_CHECK_ARG(!spills_[i].on, "KVStore::attend_on_host: layer ", layer,
                   " spills to disk (its host copy is pinned only around its use)");
  REVIVA_CHECK_ARG(manager_->host_bytes(id) > 0, "KVStore::attend_on_host: layer ", layer,
                   " has no host copy yet (no tokens written)");
  manager_->settle(id);   // (a prefetch in flight lands first)
  manager_->offload(id);  // clean: the host copy is whole; the memory goes back
  manager_->settle(id);
  host_attended_[i] = true;
  ++counts_.host_attended_layers;
  declare_cycle();
}

bool KVStore::host_attended(int layer) const {
  block_at(layer, "host_attended");
  return host_attended_[static_cast<std::size_t>(layer)];
}

const void* KVStore::host_rows(int layer) {
  const BlockId id = block_at(layer, "host_rows");
  REVIVA_CHECK_ARG(host_attended_[static_cast<std::size_t>(layer)], "KVStore::host_rows: layer ",
                   layer, " is not attended on the host (attend_on_host)");
  return manager_->host_rows(id);
}

void KVStore::host_wrote(int layer, std::size_t first, std::size_t count, const void* rows) {
  const BlockId id = block_at(layer, "host_wrote");
  REVIVA_CHECK_ARG(host_attended_[static_cast<std::size_t>(layer)], "KVStore::host_wrote: layer ",
                   layer, " is not attended on the host (attend_on_host)");
  const std::size_t cap = capacity(layer);
  REVIVA_CHECK_ARG(count <= cap && first <= cap - count, "KVStore::host_wrote: tokens [", first,
                   ", ", first + count, ") exceed layer ", layer, "'s capacity of ", cap,
                   " tokens");
  const std::size_t tb = options_.token_bytes;
  manager_->host_wrote(id, first * tb, rows, count * tb);
  counts_.bytes_written_on_host += count * tb;
}

}  // namespace reviva
